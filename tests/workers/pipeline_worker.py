"""Worker of the multi-process pipeline tests: `python pipeline_worker.py SCENARIO OUT_DIR [...]`.

Each scenario writes what the parent test compares (grads, losses, checksums) to OUT_DIR as
safetensors / JSON, one file per rank. `HF_ACTCOMP_TEST_DEVICE=cuda` runs the stages of `exact`,
`compressed` and `hung_peer` on the GPU (tests/test_cuda.py), still over gloo.
"""

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan
from hf_actcomp.debug import debug_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_cases import (  # noqa: E402
    COMPRESSED_PLANS,
    EXACT_CASES,
    exact_runs,
    padded_batch,
    schedule_of,
    training_batches,
)

DEVICE = torch.device(os.environ.get("HF_ACTCOMP_TEST_DEVICE", "cpu"))


def stage_grads(pipe) -> dict:
    """This stage's gradients by parameter name; a parameter without one (the first stage's copy
    of a tied embedding, owned by the last stage) is recorded as `nograd.<name>`."""
    return {(f"grad.{n}" if p.grad is not None else f"nograd.{n}"): (p.grad if p.grad is not None else torch.zeros(1))
            for n, p in pipe.stage.named_parameters()}


def exact(out_dir: str, num_stages: int) -> None:
    """Identity codec: one train_step per family and schedule; save each stage's grads + loss."""
    rank = dist.get_rank()
    for case, schedule in exact_runs(num_stages):
        family, overrides = EXACT_CASES[case]
        model = debug_model(family, seed=0, **overrides)
        name, micro_batches = schedule_of(schedule, num_stages)
        plan = Plan(num_stages=num_stages, micro_batches=micro_batches, schedule=name)
        pipe = hf_actcomp.prepare(model, plan, timeout=60, device=DEVICE)
        kept = {id(p) for p in pipe.stage.parameters()}
        assert all(p.numel() == 0 for p in model.parameters() if id(p) not in kept), "other stages not freed"
        out = pipe.train_step(padded_batch(model.config.vocab_size))
        tensors = stage_grads(pipe)
        tensors["loss"] = out.loss.reshape(1)
        before = pipe.stats()["categories"]
        tensors["eval_loss"] = pipe.eval_step(padded_batch(model.config.vocab_size)).loss.reshape(1)
        after = pipe.stats()["categories"]
        for category in ("evaluation", "router"):  # what eval_step sent, by category
            sent = [c.get(category, {}).get("bytes_sent", 0) for c in (before, after)]
            tensors[f"eval_step_{category}_bytes"] = torch.tensor([sent[1] - sent[0]])
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                  os.path.join(out_dir, f"{case}-{schedule}-rank{rank}.safetensors"))


def accumulate(out_dir: str, family: str) -> None:
    """k = 1, 2, 3 train_steps on different batches without zero_grad (the last one syncing),
    then (zbh1) two steps with num_items_in_batch and 3 AdamW steps; save grads after accumulation
    and the parameters after the steps."""
    rank = dist.get_rank()
    for k in (1, 2, 3):
        model = debug_model(family, seed=0)
        plan = Plan(num_stages=dist.get_world_size(), micro_batches=dist.get_world_size(), schedule="1f1b")
        pipe = hf_actcomp.prepare(model, plan, timeout=60)
        for step in range(k):
            with pipe.no_sync() if step < k - 1 else contextlib.nullcontext():
                pipe.train_step(padded_batch(model.config.vocab_size, seed=step))
        tensors = stage_grads(pipe)
        tensors["tie_bytes"] = torch.tensor([pipe.stats()["categories"]["tie"]["bytes_sent"]])
        save_file({kk: v.contiguous() for kk, v in tensors.items()},
                  os.path.join(out_dir, f"{family}-k{k}-rank{rank}.safetensors"))
    # Normalised by the tokens of the whole accumulated step, as Trainer's num_items_in_batch;
    # here and in the AdamW steps below under zero-bubble H1 (weight gradients deferred).
    model = debug_model(family, seed=0)
    pipe = hf_actcomp.prepare(model, Plan(num_stages=dist.get_world_size(), micro_batches=dist.get_world_size(),
                                          schedule="zbh1"), timeout=60)
    batches = [padded_batch(model.config.vocab_size, seed=step) for step in range(2)]
    num_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    losses = [pipe.train_step(b, num_items_in_batch=num_items, sync=i == 1).loss for i, b in enumerate(batches)]
    # Every held-back `W` ran, and left plain gradients: no graph chaining the steps' activations.
    assert not pipe.runner.weight_gradients.pending
    assert all(p.grad is None or (p.grad.grad_fn is None and not p.grad.requires_grad) for p in pipe.parameters())
    tensors = stage_grads(pipe)
    tensors["losses"] = torch.stack(losses)
    save_file({kk: v.contiguous() for kk, v in tensors.items()}, os.path.join(out_dir, f"{family}-items-rank{rank}.safetensors"))

    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for step in range(3):
        optimizer.zero_grad()
        pipe.train_step(padded_batch(model.config.vocab_size, seed=10 + step))
        pipe.clip_grad_norm_(0.5)
        optimizer.step()
    pipe.eval_step(padded_batch(model.config.vocab_size, seed=0))  # refreshes the first stage's rows
    tensors = {f"param.{n}": p.detach() for n, p in pipe.stage.named_parameters()}
    save_file({kk: v.contiguous() for kk, v in tensors.items()}, os.path.join(out_dir, f"{family}-adamw-rank{rank}.safetensors"))


def memory_checksums(pipe) -> dict:
    """Checksums of the AQ-SGD memory this rank holds (the sender's mirror and the receiver's) and
    of a compressed tie's table."""
    sums = {}
    if pipe.forward_out is not None and hasattr(pipe.forward_out.sender.mirror, "memory"):
        mem = pipe.forward_out.sender.mirror.memory
        sums[f"boundary{pipe.stage_index}.sender"] = float(mem.values.double().sum()) if mem.values is not None else 0.0
    if pipe.forward_in is not None and hasattr(pipe.forward_in.receiver, "memory"):
        mem = pipe.forward_in.receiver.memory
        sums[f"boundary{pipe.stage_index - 1}.receiver"] = float(mem.values.double().sum()) if mem.values is not None else 0.0
    tie = pipe.tie.compressor if pipe.tie is not None else None
    if tie is not None:  # the compressed tie: the first stage's copy and the owner's mirror of it
        sums[f"tie.{tie.table_name}"] = float(tie.table.double().sum())
    return sums


def compressed(out_dir: str, plan_name: str, steps: int, schedule: str) -> None:
    """Train a few steps under a compressed plan; record losses and memory checksums per step."""
    rank = dist.get_rank()
    model = debug_model("gpt2", seed=0)
    plan = COMPRESSED_PLANS[plan_name](schedule)
    pipe = hf_actcomp.prepare(model, plan, timeout=60, device=DEVICE)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses, checksums = [], []
    for batch in training_batches(model.config.vocab_size, steps):
        out = pipe.train_step(batch)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, memory_checksums(pipe))
        merged = {}
        for p in parts:
            merged.update(p)
        checksums.append(merged)
    stats = pipe.stats(gather=True)
    eval_loss = pipe.eval_step(padded_batch(model.config.vocab_size)).loss.item()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "checksums": checksums, "stats": stats, "eval_loss": eval_loss}, f)


def resume(out_dir: str, phase: str) -> None:
    """`full`: 4 steps. `first`: 2 steps then save. `second`: load, then steps 3-4."""
    rank = dist.get_rank()
    plan = COMPRESSED_PLANS["aqsgd"]("1f1b")
    batches = list(training_batches(256, 4))
    if phase == "second":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "ckpt"))
        assert Plan.from_pretrained(os.path.join(out_dir, "ckpt")) == plan
    else:
        model = debug_model("gpt2", seed=0)
    pipe = hf_actcomp.prepare(model, plan, timeout=60)
    if phase == "second":
        pipe.load_compression_state(os.path.join(out_dir, "ckpt", "actcomp_state"))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    todo = {"full": batches, "first": batches[:2], "second": batches[2:]}[phase]
    losses = []
    for batch in todo:
        losses.append(pipe.train_step(batch).loss.item())
        optimizer.step()
        optimizer.zero_grad()
    if phase == "first":
        pipe.save_pretrained(os.path.join(out_dir, "ckpt"), model=model)
        pipe.save_compression_state(os.path.join(out_dir, "ckpt", "actcomp_state"), max_shard_size=20_000)
    if phase != "first":
        tensors = {f"param.{n}": p.detach().clone() for n, p in pipe.stage.named_parameters()}
        tensors.update({f"state.{k}": v for k, v in pipe.compression_state_dict().items()})
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(out_dir, f"{phase}-rank{rank}.safetensors"))
    with open(os.path.join(out_dir, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump({"losses": losses}, f)


def dead_peer(out_dir: str) -> None:
    """The last rank dies before the first step; the others must fail with a clear error."""
    model = debug_model("gpt2", seed=0)
    plan = Plan(num_stages=dist.get_world_size(), micro_batches=2, schedule="gpipe")
    pipe = hf_actcomp.prepare(model, plan, timeout=5)
    if pipe.is_last:
        os._exit(3)
    start = time.perf_counter()
    try:
        pipe.train_step(padded_batch(model.config.vocab_size))
    except hf_actcomp.PeerTimeoutError as err:
        with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"error": str(err), "seconds": time.perf_counter() - start}, f)
        os._exit(4)


def non_finite(out_dir: str) -> None:
    """Stage 0's weights turn NaN after a good step: stage 1 stops at the next payload with an
    error naming the step, stage, direction and micro-batch; stage 0 then loses its peer."""
    model = debug_model("gpt2", seed=0)
    plan = Plan(num_stages=2, micro_batches=2, forward=Compression("quantize", bits=8))
    pipe = hf_actcomp.prepare(model, plan, timeout=10)
    batch = padded_batch(model.config.vocab_size)
    pipe.train_step(batch)
    if pipe.is_first:
        with torch.no_grad():
            next(p for n, p in pipe.stage.named_parameters() if ".h.0." in n).fill_(float("nan"))
    try:
        pipe.train_step(batch)
    except (hf_actcomp.NonFiniteError, hf_actcomp.PeerTimeoutError) as err:
        with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"type": type(err).__name__, "error": str(err)}, f)
        os._exit(5)


def bad_world(out_dir: str) -> None:
    """A 3-stage plan in a 2-process job fails on every rank before any message."""
    try:
        hf_actcomp.prepare(debug_model("gpt2"), Plan(num_stages=3, micro_batches=3))
    except ValueError as err:
        with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"error": str(err)}, f)


def autocast(out_dir: str) -> None:
    """bf16 autocast on CPU: the step runs and its loss is saved for comparison."""
    model = debug_model("gpt2", seed=0)
    pipe = hf_actcomp.prepare(model, Plan(num_stages=2, micro_batches=2), autocast_dtype=torch.bfloat16)
    dtypes = set()
    for block in pipe.stage.modules():  # the blocks' matmuls: what autocast changes
        if type(block).__name__ == "Conv1D":
            block.register_forward_hook(lambda m, i, o: dtypes.add(str(o.dtype)))
    out = pipe.train_step(padded_batch(model.config.vocab_size))
    grads = {n: p.grad for n, p in pipe.stage.named_parameters() if not (pipe.tie and p is pipe.tie.param and pipe.is_first)}
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    stats = pipe.stats(gather=True)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"loss": out.loss.item(), "matmul_dtypes": sorted(dtypes), "channels": stats["channels"]}, f)


def accelerate_state(out_dir: str) -> None:
    """accelerator.save_state / load_state carry every rank's compression state."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    model = debug_model("gpt2", seed=0)
    pipe = hf_actcomp.prepare(model, COMPRESSED_PLANS["aqsgd"]("1f1b"))
    pipe.register_for_checkpointing(accelerator)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    data = training_batches(model.config.vocab_size, 6)

    def step():
        pipe.train_step(next(data))
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(4):
        step()
    saved = {k: v.clone() for k, v in pipe.compression_state_dict().items()}
    accelerator.save_state(os.path.join(out_dir, "state"))
    for _ in range(2):  # revisits samples with changed weights: the memories move
        step()
    changed = any(not torch.equal(saved[k], v) for k, v in pipe.compression_state_dict().items())
    accelerator.load_state(os.path.join(out_dir, "state"))
    restored = all(torch.equal(saved[k], v) for k, v in pipe.compression_state_dict().items())
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"changed": changed, "restored": restored, "keys": sorted(saved)}, f)


def two_d(out_dir: str, hook: str) -> None:
    """S=2 x D=2: replica r trains on rows [4r, 4r+4) of one global batch of 8 (with a compressed
    hook: AQ-SGD on the boundary, each replica keeping memory for its 4 sample ids only)."""
    model = debug_model("gpt2", seed=0)
    dp_compression = {"allreduce": "allreduce", "topk": {"method": "topk", "ratio": 0.1},
                      "powersgd": {"method": "powersgd", "matrix_approximation_rank": 2, "start_powerSGD_iter": 2}}[hook]
    aqsgd = {} if hook == "allreduce" else dict(forward=Compression("aqsgd", bits=4),
                                                memory=MemoryConfig(num_samples=8))
    plan = Plan(num_stages=2, data_parallel=2, micro_batches=2, dp_compression=dp_compression, **aqsgd)
    pipe = hf_actcomp.prepare(model, plan, timeout=60)
    full = padded_batch(model.config.vocab_size, batch=8)
    if aqsgd:
        full["sample_id"] = torch.arange(8)
        boundary = pipe.forward_out or pipe.forward_in
        end = boundary.sender or boundary.receiver
        memory_rows = end.memory.num_samples if hasattr(end, "memory") else end.mirror.memory.num_samples
        other = slice(4 * (1 - pipe.replica), 4 * (1 - pipe.replica) + 4)
        try:
            pipe.train_step({k: v[other] for k, v in full.items()})
            wrong_shard = None
        except ValueError as err:
            wrong_shard = str(err)
    full["attention_mask"][4, -7:] = 0  # the replicas' shards have different token counts
    full["labels"][4, -7:] = -100
    rows = slice(4 * pipe.replica, 4 * pipe.replica + 4)
    shard = {k: v[rows] for k, v in full.items()}
    out = pipe.train_step(shard)
    tensors = stage_grads(pipe)
    tensors["loss"] = out.loss.reshape(1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, f"rank{dist.get_rank()}.safetensors"))
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = [out.loss.item()]
    for _ in range(5):
        optimizer.step()
        optimizer.zero_grad()
        losses.append(pipe.train_step(shard).loss.item())
    optimizer.step()
    pipe.eval_step(shard)  # the first stage reads the current rows of the tied embedding
    params = {f"param.{n}": p.detach() for n, p in pipe.stage.named_parameters()}
    params["rows"] = torch.unique(shard["input_ids"])
    save_file({k: v.contiguous() for k, v in params.items()}, os.path.join(out_dir, f"params-rank{dist.get_rank()}.safetensors"))
    if hook == "allreduce":  # two accumulated steps, averaged once, normalised by all their tokens
        model = debug_model("gpt2", seed=0)
        pipe = hf_actcomp.prepare(model, plan, timeout=60)
        second = padded_batch(model.config.vocab_size, batch=8, seed=1)
        num_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in (full, second))
        with pipe.no_sync():
            pipe.train_step(shard, num_items_in_batch=num_items)
        assert pipe.dp_compressor.step == 0, "no_sync() must not average"
        pipe.train_step({k: v[rows] for k, v in second.items()}, num_items_in_batch=num_items)
        assert pipe.dp_compressor.step == 1
        save_file({k: v.contiguous() for k, v in stage_grads(pipe).items()},
                  os.path.join(out_dir, f"accumulated-rank{dist.get_rank()}.safetensors"))
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"losses": losses, "replica": pipe.replica, "stage": pipe.stage_index,
                   "dp": pipe.stats()["data_parallel"], "sample_range": list(pipe.sample_range or []),
                   "memory_rows": memory_rows if aqsgd else None, "wrong_shard": wrong_shard if aqsgd else None}, f)


def gradient_rules(out_dir: str) -> None:
    """S=2 x D=2 with frozen parameters (the tied embedding and block 0, as PEFT leaves a base
    model): what gets a gradient, what is communicated; eval_step keeps the mode; fp16 refused;
    equal shards for the replicas."""
    import datasets

    rank = dist.get_rank()
    result = {}
    try:
        hf_actcomp.prepare(debug_model("gpt2"), Plan(num_stages=2, data_parallel=2, micro_batches=2),
                           autocast_dtype=torch.float16)
    except ValueError as err:
        result["fp16_error"] = str(err)
    model = debug_model("gpt2", seed=0)
    for name, p in model.named_parameters():
        if name.startswith(("transformer.wte", "transformer.h.0.")):
            p.requires_grad_(False)
    pipe = hf_actcomp.prepare(model, Plan(num_stages=2, data_parallel=2, micro_batches=2), timeout=60)
    batch = padded_batch(model.config.vocab_size, seed=pipe.replica)
    for _ in range(2):
        pipe.train_step(batch)
        result["norm"] = pipe.clip_grad_norm_(1.0).item()
    result["no_grad"] = sorted(n for n, p in pipe.stage.named_parameters() if p.grad is None)
    result["frozen"] = sorted(n for n, p in pipe.stage.named_parameters() if not p.requires_grad)
    result["trainable_numel"] = sum(p.numel() for p in pipe.stage.parameters() if p.requires_grad)
    stats = pipe.stats()
    result["categories"] = stats["categories"]
    modes = []
    for training in (True, False):
        pipe.stage.train(training)
        pipe.eval_step(batch)
        modes.append(pipe.stage.training)
    result["modes_after_eval"] = modes
    shard = pipe.shard_dataset(datasets.Dataset.from_dict({"x": list(range(9))}))
    result["shard"] = list(shard["x"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def hung_peer(out_dir: str) -> None:
    """Rank 1 stays alive but never sends: rank 0's receive fails after its timeout, also when
    waiting by polling the work (the way the transport waits on CUDA)."""
    from hf_actcomp.pipeline.transport import Transport

    names = ("poll1", "early", "poll0")
    if dist.get_rank() == 0:
        # a gloo timeout closes the pair: poll first. "early": a receive posted ahead (as the
        # engine posts a step's receives at its start), taken later.
        for name in names:
            transport = Transport(None, 0, timeout=2.0, device=DEVICE, poll=name != "poll0", early=name == "early")
            start = time.perf_counter()
            try:
                posted = transport.post_recv(16, 1, DEVICE, "a message that never comes", tag=2)
                time.sleep(0.5 if name == "early" else 0.0)
                transport.wait_recv(posted)
            except hf_actcomp.PeerTimeoutError as err:
                with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                    json.dump({"error": str(err), "seconds": time.perf_counter() - start,
                               "waiting": transport.seconds_waiting}, f)
        os._exit(0)  # the posted receive is abandoned with the process
    deadline = time.monotonic() + 30  # alive (never sending) until rank 0 has reported every wait
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(out_dir, f"{name}.json")) for name in names):
        time.sleep(0.2)
    time.sleep(0.5)
    os._exit(0)


def main() -> None:
    scenario, out_dir, *rest = sys.argv[1:]
    if scenario != "accelerate_state":  # there the Accelerator initialises torch.distributed
        dist.init_process_group("gloo")
    {"exact": lambda: exact(out_dir, int(rest[0])),
     "gradient_rules": lambda: gradient_rules(out_dir),
     "hung_peer": lambda: hung_peer(out_dir),
     "accumulate": lambda: accumulate(out_dir, rest[0]),
     "compressed": lambda: compressed(out_dir, rest[0], int(rest[1]), rest[2]),
     "resume": lambda: resume(out_dir, rest[0]),
     "dead_peer": lambda: dead_peer(out_dir),
     "non_finite": lambda: non_finite(out_dir),
     "bad_world": lambda: bad_world(out_dir),
     "autocast": lambda: autocast(out_dir),
     "two_d": lambda: two_d(out_dir, rest[0]),
     "accelerate_state": lambda: accelerate_state(out_dir)}[scenario]()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
