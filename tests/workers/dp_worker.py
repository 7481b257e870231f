"""Worker of the data-parallel hook tests: `python dp_worker.py SCENARIO OUT_DIR [...]`."""

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_actcomp import dp

HOOK_PARAMS = {
    "allreduce": {},
    "topk": {"ratio": 0.1},
    "randk": {"ratio": 0.1},
    "dgc": {"ratio": 0.05, "momentum": 0.0},
    "qsgd": {"levels": 15, "bucket_size": 64},
    "ef_sign": {},
    "marsit": {},
    "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2},
}


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def shard(rank: int, step: int, rows: int = 32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(rows, 16, generator=g)
    target = torch.stack([x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8].sin(), x[:, 9:].mean(1)], dim=1)
    return x, target


def exact_average(out_dir):
    """The no-compression hook gives exactly the mean of the per-rank gradients. DDP's own
    all-reduce gives the same mean, so the hook's stats are written too: they show it ran."""
    rank = dist.get_rank()
    model = DDP(small_model())
    state = dp.register(model, "allreduce")
    x, y = shard(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    save_file({n: p.grad.contiguous() for n, p in model.module.named_parameters()},
              os.path.join(out_dir, f"rank{rank}.safetensors"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(state.stats(), f)


def marsit_owners(out_dir, per_chunk):
    """Which worker's sign each coordinate of Marsit's ring ends with, through the real hook.

    Experiment w: worker w's gradient is +1 everywhere, every other worker's -1, so the hook's
    output is positive exactly where the ring kept worker w's bit. A fresh hook per experiment
    (same seed, so the same random masks) makes the 4 experiments share one assignment: the
    owner of coordinate i is the w whose experiment gave a positive output at i."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = world * per_chunk
    params = [torch.nn.Parameter(torch.zeros(n))]
    positive = []
    for w in range(world):
        state = dp.make_compressor("marsit", None, compensation=False)
        g = torch.full((n,), 1.0 if rank == w else -1.0)
        out = state.reduce(g, params)
        assert state.stats()["bytes_sent"] > 0
        positive.append(out > 0)
    save_file({"positive": torch.stack(positive).to(torch.uint8)}, os.path.join(out_dir, f"rank{rank}.safetensors"))


def accounting(out_dir):
    """For each EF hook: what this rank sent + its new residual == gradient + old residual, and
    the output is the average of what all ranks sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = [torch.nn.Parameter(torch.zeros(300)), torch.nn.Parameter(torch.zeros(200))]
    report = {}
    for name, key in [("topk", "memory"), ("randk", "memory"), ("ef_sign", "memory"), ("marsit", "compensation")]:
        state = dp.make_compressor(name, None, **HOOK_PARAMS[name])
        state.param_names = {id(params[0]): "a", id(params[1]): "b"}
        checks = []
        for step in range(3):
            g = torch.randn(500, generator=torch.Generator().manual_seed(10 * step + rank))
            old = torch.cat([state.state[key].get(n, torch.zeros(s)) for n, s in (("a", 300), ("b", 200))])
            out = state.reduce(g.clone(), params)
            new = torch.cat([state.state[key][n] for n in ("a", "b")])
            sent = g + old - new
            everyone = [torch.empty(500) for _ in range(world)]
            dist.all_gather(everyone, sent)
            mean_sent = torch.stack(everyone).mean(0)
            checks.append(float((out - mean_sent).abs().max()))
            if name in ("topk", "randk"):
                assert int((sent != 0).sum()) <= 50, int((sent != 0).sum())
        report[name] = checks
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def unbiased(out_dir, repeats):
    """Average many reductions of fixed gradients: qsgd and randk (no EF) estimate the mean
    gradient, marsit (no compensation) the mean sign times the mean scale."""
    rank = dist.get_rank()
    params = [torch.nn.Parameter(torch.zeros(256))]
    g = torch.randn(256, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
    result = {}
    for name, kwargs in [("qsgd", {"levels": 3, "bucket_size": 64}), ("randk", {"ratio": 0.25, "error_feedback": False}),
                         ("marsit", {"compensation": False})]:
        state = dp.make_compressor(name, None, **kwargs)
        total = torch.zeros(256)
        for _ in range(repeats):
            total += state.reduce(g.clone(), params)
        result[name] = (total / repeats).tolist()
        result[f"{name}.stats"] = state.stats()
    result["g"] = g.tolist()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def train(out_dir, steps, cast):
    """Train the small model with every hook under DDP; record the loss on a fixed eval set.
    A hook that `register` refuses is recorded with its error under "refused" (torch's bf16
    wrapper for PowerSGD needs CUDA + NCCL), never skipped silently."""
    rank = dist.get_rank()
    x_eval, y_eval = shard(99, 99, rows=256)
    result = {}
    refused = {}
    for name, params in HOOK_PARAMS.items():
        model = DDP(small_model())
        try:
            state = dp.register(model, name, cast=None if cast == "none" else cast, **params)
        except (TypeError, RuntimeError) as err:
            refused[name] = str(err)
            continue
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(steps):
            x, y = shard(rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                losses.append(torch.nn.functional.mse_loss(model.module(x_eval), y_eval).item())
        result[name] = {"losses": losses, "stats": state.stats()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"runs": result, "refused": refused}, f)


def resume(out_dir, names):
    """For each hook: 4 steps == 2 steps, save hook state + params, fresh DDP, load, 2 steps."""
    rank = dist.get_rank()

    def run(model, state, steps):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in steps:
            x, y = shard(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    diffs = {}
    for name in names:
        full = DDP(small_model())
        run(full, dp.register(full, name, **HOOK_PARAMS[name]), range(4))
        first = DDP(small_model())
        state = dp.register(first, name, **HOOK_PARAMS[name])
        run(first, state, range(2))
        dp.save_state(state, os.path.join(out_dir, f"hook-{name}"))
        second = DDP(small_model())
        second.module.load_state_dict(first.module.state_dict())
        state2 = dp.register(second, name, **HOOK_PARAMS[name])
        dp.load_state(state2, os.path.join(out_dir, f"hook-{name}"))
        run(second, state2, range(2, 4))
        diffs[name] = max(float((a - b).abs().max()) for a, b in zip(full.parameters(), second.parameters(),
                                                                     strict=True))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(diffs, f)


def errors(out_dir):
    rank = dist.get_rank()
    messages = {}
    model = DDP(small_model())
    for key, call in {
        "unknown": lambda: dp.register(model, "top-k"),
        "ratio": lambda: dp.register(model, "topk", ratio=1.5),
        "cast": lambda: dp.register(model, "topk", cast="int8"),
        "not_ddp": lambda: dp.register(small_model(), "topk"),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as err:
            messages[key] = str(err)
    dp.register(model, "topk", ratio=0.1)
    try:
        dp.register(model, "qsgd")
    except RuntimeError as err:
        messages["twice"] = str(err)
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    try:
        dp.make_compressor("topk", solo, ratio=0.1)
    except ValueError as err:
        messages["solo"] = str(err)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(messages, f)


def accelerate_ddp(out_dir):
    """The DDP model that accelerator.prepare returns takes our hook by name."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(small_model(), torch.optim.SGD(small_model().parameters(), lr=0.05))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = dp.register(model, "dgc", ratio=0.05, momentum=0.0)
    losses = []
    for step in range(20):
        x, y = shard(accelerator.process_index, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"type": type(model).__name__, "losses": losses, "stats": state.stats()}, f)


def powersgd_like_torch(out_dir, steps):
    """The pipeline's PowerSGD (`PowerSGDCompressor.reduce`: a step's gradients as one flat
    buffer) against torch's PowerSGD hook under DDP (one bucket), on the same gradients: every
    step's averaged gradients from both, and the exact mean, per parameter and step."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    from hf_actcomp.dp.powersgd import PowerSGDCompressor

    rank = dist.get_rank()
    settings = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
    ddp = DDP(small_model(), bucket_cap_mb=100)  # one bucket
    orders = []

    def recording(state, bucket):
        orders.append([id(p) for p in bucket.parameters()])
        return powersgd.powerSGD_hook(state, bucket)

    ddp.register_comm_hook(powersgd.PowerSGDState(process_group=None, min_compression_rate=2.0, warm_start=True,
                                                  random_seed=0, **settings), recording)
    ours = PowerSGDCompressor(**settings)  # the pipeline's defaults: seed 0, warm start, min rate 2
    local = small_model()  # the same weights: each rank's own gradients, before any averaging
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    local_params = dict(local.named_parameters())
    out = {}
    for step in range(steps):
        x, y = shard(rank, step)
        ddp.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        local.zero_grad()
        torch.nn.functional.mse_loss(local(x), y).backward()
        order = [names[i] for i in orders[-1]]  # the bucket's order this step
        flat = torch.cat([local_params[n].grad.reshape(-1) for n in order])
        exact = flat.clone()
        dist.all_reduce(exact)
        exact /= dist.get_world_size()
        reduced = ours.reduce(flat, [local_params[n] for n in order])
        offset = 0
        for n in order:
            size = local_params[n].numel()
            out[f"{step}.torch.{n}"] = dict(ddp.module.named_parameters())[n].grad.clone()
            out[f"{step}.ours.{n}"] = reduced[offset:offset + size].view_as(local_params[n]).clone()
            out[f"{step}.exact.{n}"] = exact[offset:offset + size].view_as(local_params[n]).clone()
            offset += size
    save_file(out, os.path.join(out_dir, f"rank{rank}.safetensors"))


def main():
    scenario, out_dir, *rest = sys.argv[1:]
    if scenario != "accelerate":
        dist.init_process_group("gloo")
    {"accelerate": lambda: accelerate_ddp(out_dir),
     "exact_average": lambda: exact_average(out_dir),
     "marsit_owners": lambda: marsit_owners(out_dir, int(rest[0])),
     "accounting": lambda: accounting(out_dir),
     "unbiased": lambda: unbiased(out_dir, int(rest[0])),
     "train": lambda: train(out_dir, int(rest[0]), rest[1]),
     "resume": lambda: resume(out_dir, rest),
     "errors": lambda: errors(out_dir),
     "powersgd_like_torch": lambda: powersgd_like_torch(out_dir, int(rest[0]))}[scenario]()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
