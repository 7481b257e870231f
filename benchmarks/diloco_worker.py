"""One process of benchmarks/diloco.py: one method, one training run, from the same initialisation.

Methods (`--method`, a label of METHODS): DDP with torch's built-in all-reduce (the peer), DDP
with PowerSGD rank 4 or DGC 50x (the hooks and settings of benchmarks/dp_hooks_worker.py), and
DiLoCo through `hf_actcomp.prepare` (one stage, or two stages with AQ-SGD boundaries: the 2-D run).
Every method trains with AdamW (DiLoCo's inner optimizer) at the same lr, on the same shards
(contiguous halves of the training split, as `Pipeline.shard_dataset` cuts them), in the same
per-replica order, for `--steps` steps. Every `--eval_every` steps (and at the end) the
training clock stops, each replica evaluates its own weights on the whole held-out split, and the
clock starts again. Rank 0 writes one JSON row: the eval points (training seconds, each
replica's loss), bytes per step per worker (counted), time split, replicas' agreement at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import time

import torch
import torch.distributed as dist
from dp_hooks_worker import HOOKS, PEER
from harness import add_arguments, busy_cpu_seconds, other_cpu_share
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, GPT2Config

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan, dp
from hf_actcomp.data import build_tokenizer, causal_lm_datasets, offline_corpus

INT8 = {"method": "quantize", "bits": 8}
HADAMARD4 = {"method": "hadamard", "bits": 4}
_HOOKS = {label: (hook, params) for label, hook, params in HOOKS}
# label -> (kind, settings). DDP hooks in their loss-run configuration of dp_hooks (PowerSGD
# compressing from step 10, DGC with 20 sparsity warm-up steps); DGC's own momentum is off
# because AdamW brings its own (dp_hooks paired DGC with momentum-free SGD instead).
METHODS: dict[str, tuple[str, dict]] = {
    PEER: ("ddp", {"hook": None, "params": {}}),
    "PowerSGD rank 4 (torch)": ("ddp", {"hook": "powersgd", "params": _HOOKS["PowerSGD rank 4 (torch)"][1]}),
    "dgc 50x": ("ddp", {"hook": "dgc", "params": {**_HOOKS["dgc 50x"][1], "momentum": 0.0}}),
    **{f"DiLoCo H={h} {name}": ("diloco", {"sync_every": h, "compression": codec})
       for h in (8, 32, 128) for name, codec in (("int8", INT8), ("hadamard4", HADAMARD4))},
}
TWO_D = "2 stages x 2 replicas: AQ-SGD boundaries + DiLoCo H=32 int8"
METHODS[TWO_D] = ("diloco", {"sync_every": 32, "compression": INT8, "num_stages": 2})
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}


def outer_label(outer: dict) -> str:
    """E.g. `lr 1.0, no momentum` or `Nesterov lr 0.7, momentum 0.9`."""
    if not outer.get("outer_momentum"):
        return f"lr {outer['outer_lr']}, no momentum"
    return f"{'Nesterov ' if outer.get('nesterov') else ''}lr {outer['outer_lr']}, momentum {outer['outer_momentum']}"


def interface_address(ifname: str) -> str:
    """The IPv4 address of network device `ifname` (this namespace's veth)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", ifname], check=True, capture_output=True,
                         text=True).stdout
    return out.split()[3].split("/")[0]


def build_model(vocab: int, args) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config)


def contiguous_shard(dataset, replicas: int, replica: int):
    """`Pipeline.shard_dataset`'s cut: equal contiguous shards (the last rows dropped)."""
    usable = len(dataset) - len(dataset) % replicas
    return dataset.select(range(usable)).shard(replicas, replica, contiguous=True)


class Batches:
    """Replica `replica`'s batches: its shard in a fresh random order each epoch (seeded by replica
    and epoch, so every method sees the same sequence)."""

    def __init__(self, shard, replica: int, batch_size: int) -> None:
        self.shard, self.replica, self.batch_size = shard, replica, batch_size
        self.orders: dict[int, torch.Tensor] = {}

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        n = len(self.shard)
        rows = []
        for k in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch = k // n
            if epoch not in self.orders:
                g = torch.Generator().manual_seed(1000 * self.replica + epoch)
                self.orders[epoch] = torch.randperm(n, generator=g)
            rows.append(int(self.orders[epoch][k % n]))
        batch = self.shard[rows]
        return {k: batch[k] for k in ("input_ids", "attention_mask", "labels", "sample_id")}


def digest(params) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, required=("out", "link"), steps=384, eval_every=16, batch_size=8, seq_len=64,
                  n_embd=128, n_layer=2, lr=3e-3, timeout=300)
    p.add_argument("--method", required=True, choices=list(METHODS))
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--outer", default=None,
                   help="DiLoCo's outer settings as JSON (default: OUTER); the row's label names them")
    args = p.parse_args()
    outer = OUTER if args.outer is None else json.loads(args.outer)
    label = args.method if args.outer is None else f"{args.method}, outer {outer_label(outer)}"
    torch.set_num_threads(1)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    if ifname != "lo":  # inside a namespace: torchft's servers bind to this namespace's address
        os.environ[hf_actcomp.dp.outer.HOST_ENV] = interface_address(ifname)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kind, settings = METHODS[args.method]

    texts = offline_corpus()
    tokenizer = build_tokenizer(texts, vocab_size=1024)
    train, evaluation = causal_lm_datasets(tokenizer, texts, seq_len=args.seq_len)
    train = train.with_format("torch")
    eval_rows = evaluation.with_format("torch")[:]
    eval_batch = {k: eval_rows[k] for k in ("input_ids", "attention_mask", "labels")}
    model = build_model(len(tokenizer), args)
    parameters = sum(q.numel() for q in model.parameters())
    param_bytes = sum(q.numel() * q.element_size() for q in model.parameters())

    pipe = state = None
    if kind == "ddp":
        replica, replicas, stage, stages = rank, world, 0, 1
        net = DDP(model)
        if settings["hook"] is not None:
            state = dp.register(net, settings["hook"], **settings["params"])
        optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr)
        shard = contiguous_shard(train, replicas, replica)

        def step(batch) -> None:
            net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                labels=batch["labels"]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        def eval_loss() -> float:
            with torch.no_grad():
                return float(model(**eval_batch).loss)

        def weights():
            return list(model.parameters())
    else:
        stages = settings.get("num_stages", 1)
        replicas = world // stages
        dp_compression = {"method": "diloco", "sync_every": settings["sync_every"], **outer,
                          "compression": settings["compression"]}
        if stages == 1:
            plan = Plan(num_stages=1, data_parallel=replicas, dp_compression=dp_compression)
        else:
            plan = Plan(num_stages=stages, data_parallel=replicas, micro_batches=stages,
                        forward=Compression("aqsgd", bits=4), backward=Compression("quantize", bits=8),
                        memory=MemoryConfig(num_samples=len(train)), dp_compression=dp_compression)
        pipe = hf_actcomp.prepare(model, plan, timeout=args.timeout)
        replica, stage = pipe.replica, pipe.stage_index
        optimizer = pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=args.lr))
        shard = pipe.shard_dataset(train)
        mine = contiguous_shard(train, replicas, replica)
        assert len(shard) == len(mine) and torch.equal(shard[:]["sample_id"], mine[:]["sample_id"])

        def step(batch) -> None:
            pipe.train_step(batch)
            optimizer.step()
            optimizer.zero_grad()

        if stages == 1:
            # One stage is the whole model: its parameters are the model's, so the model itself
            # gives this replica's own eval loss (eval_step would average over the replicas).
            assert {id(q) for q in pipe.parameters()} <= {id(q) for q in model.parameters()}

            def eval_loss() -> float:
                with torch.no_grad():
                    return float(model(**eval_batch).loss)
        else:
            def eval_loss() -> float:  # the mean over the replicas (equal after a sync)
                return float(pipe.eval_step(eval_batch, compress=False).loss)

        def weights():
            return [q for _, q in pipe.grads.trainable()]

    batches = Batches(shard, replica, args.batch_size)
    if kind == "diloco":
        assert args.steps % settings["sync_every"] == 0, "the last step must be a sync step"
    evals = []
    train_seconds = 0.0
    dist.barrier()
    busy, own = busy_cpu_seconds()[0], time.process_time()
    wall_start = time.perf_counter()
    start = time.perf_counter()
    for i in range(args.steps):
        step(batches(i))
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            dist.barrier()  # waiting for the slower replica is training time
            train_seconds += time.perf_counter() - start
            loss = eval_loss()
            losses = [None] * world
            dist.all_gather_object(losses, (replica, stage, loss))
            evals.append(dict(step=i + 1, seconds=train_seconds, losses=[x[2] for x in losses]))
            if rank == 0 and ((i + 1) % (8 * args.eval_every) == 0 or i + 1 == args.steps):
                print(f"{args.link:>10} r{args.round} {label:<60} step {i + 1:4d} {train_seconds:6.1f} s "
                      f"eval {max(x[2] for x in losses):.3f}", flush=True)
            dist.barrier()
            start = time.perf_counter()
    wall = time.perf_counter() - wall_start
    cpu = [None] * world
    dist.all_gather_object(cpu, (busy_cpu_seconds()[0] - busy, time.process_time() - own, wall))
    other = other_cpu_share(cpu[0][0], [c[1] for c in cpu], cpu[0][2])

    # Bytes this process sent per step, and where its time went.
    info = dict(stage=stage, replica=replica, digest=digest(weights()))
    if kind == "ddp":
        if state is None:
            info.update(bytes_per_step=dp.ring_allreduce_bytes(param_bytes, world), comm_seconds=None)
        else:
            s = state.stats()
            info.update(bytes_per_step=s["bytes_sent"] / args.steps, comm_seconds=s["seconds"])
    else:
        stats = pipe.stats()
        categories = {k: v["bytes_sent"] / args.steps for k, v in stats["categories"].items() if k != "evaluation"}
        timing = stats["stages"][stage]
        info.update(bytes_per_step=categories["data_parallel"], categories=categories,
                    comm_seconds=timing["seconds_outer_sync"], seconds_waiting=timing["seconds_waiting"],
                    syncs=stats["data_parallel"]["syncs"], failed_syncs=stats["data_parallel"]["failed_syncs"])
    infos = [None] * world
    dist.all_gather_object(infos, info)
    # The replicas hold the same weights at the end (DDP: always; DiLoCo: the last step synced).
    for s in range(stages):
        digests = {i["digest"] for i in infos if i["stage"] == s}
        assert len(digests) == 1, f"stage {s}: the replicas differ at the end: {infos}"
    if rank == 0:
        row = dict(label=label, kind=kind, settings={**settings, **(outer if kind == "diloco" else {})}, link=args.link, round=args.round,
                   workers=world, stages=stages, replicas=replicas, steps=args.steps, parameters=parameters,
                   param_bytes=param_bytes, train_rows=len(train),
                   eval_rows=len(evaluation), samples_per_replica=args.steps * args.batch_size,
                   seconds_per_step=train_seconds / args.steps, train_seconds=train_seconds, evals=evals,
                   final_eval_loss=max(evals[-1]["losses"]), final_eval_losses=evals[-1]["losses"],
                   other_cpu_share=other, per_rank=infos,
                   bytes_per_step=sum(i["bytes_per_step"] for i in infos) / world)
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    if pipe is not None and pipe.outer is not None:
        pipe.outer.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torchft's threads must not keep the process alive


if __name__ == "__main__":
    main()
