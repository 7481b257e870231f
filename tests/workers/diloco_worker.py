"""Worker of the DiLoCo tests: `python diloco_worker.py SCENARIO OUT_DIR [...]`.

Each rank writes its weights (and what the test compares) to OUT_DIR as safetensors / JSON.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan
from hf_actcomp.debug import debug_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_cases import padded_batch  # noqa: E402

NUM_SAMPLES = 32


def replica_batch(vocab: int, replica: int, step: int) -> dict:
    """Each replica's own batch (the same label-token count on every replica)."""
    batch = padded_batch(vocab, seed=1000 * replica + step % 4)
    batch["sample_id"] = torch.arange(4) + 4 * (step % 4) + (NUM_SAMPLES // 2) * replica
    return batch


def weights(pipe) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pipe.grads.trainable()}


def train(pipe, optimizer, steps: int, vocab: int, on_step=None) -> list[float]:
    losses = []
    for step in range(steps):
        out = pipe.train_step(replica_batch(vocab, pipe.replica, step))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss))
        if on_step is not None:
            on_step(step)
    return losses


def save(out_dir: str, name: str, tensors: dict, info: dict | None = None) -> None:
    rank = dist.get_rank()
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, f"{name}-rank{rank}.safetensors"))
    if info is not None:
        with open(os.path.join(out_dir, f"{name}-rank{rank}.json"), "w") as f:
            json.dump(info, f)


def equivalence(out_dir: str, num_stages: str, diloco_schedule: str = "1f1b") -> None:
    """H=1, outer_lr=1, no momentum, inner SGD: DiLoCo (under `diloco_schedule`), then per-step
    averaging (`allreduce`, 1F1B)."""
    stages = int(num_stages)
    suffix = "" if diloco_schedule == "1f1b" else f"-{diloco_schedule}"
    for name, dp_compression, schedule in (
        ("diloco", {"method": "diloco", "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
         diloco_schedule),
        ("allreduce", "allreduce", "1f1b"),
    ):
        model = debug_model("llama", seed=0)
        plan = Plan(num_stages=stages, data_parallel=2, micro_batches=stages, dp_compression=dp_compression,
                    schedule=schedule)
        pipe = hf_actcomp.prepare(model, plan, timeout=60)
        info = {}
        if name == "diloco":  # no inner optimizer attached yet: refused before any work
            try:
                pipe.train_step(replica_batch(model.config.vocab_size, pipe.replica, 0))
            except RuntimeError as err:
                info["unattached_error"] = str(err)
        optimizer = pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        train(pipe, optimizer, 3, model.config.vocab_size)
        save(out_dir, name + (suffix if name == "diloco" else ""), weights(pipe), {**info, **pipe.stats()["categories"].get("data_parallel")})


def mean(out_dir: str, num_stages: str, compression: str) -> None:
    """H=4, outer_lr=1, no momentum, inner AdamW: the weights before each sync (snapshotted by an
    optimizer hook that runs before DiLoCo's) and after it."""
    stages = int(num_stages)
    codec = {"none": None, "quantize8": {"method": "quantize", "bits": 8},
             "hadamard4": {"method": "hadamard", "bits": 4},
             "topk_quantize2": {"method": "topk_quantize", "ratio": 0.02, "bits": 2}}[compression]
    model = debug_model("gpt2", seed=0)
    plan = Plan(num_stages=stages, data_parallel=2, micro_batches=stages,
                dp_compression={"method": "diloco", "sync_every": 4, "outer_lr": 1.0, "outer_momentum": 0.0,
                                "nesterov": False, "compression": codec})
    pipe = hf_actcomp.prepare(model, plan, timeout=60)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    snapshots = {}
    optimizer.register_step_post_hook(lambda *_: snapshots.update(before=weights(pipe)))
    pipe.attach_optimizer(optimizer)
    tensors = {f"start.{n}": t for n, t in weights(pipe).items()}

    def on_step(step: int) -> None:
        if step % 4 == 3:
            tensors.update({f"before{step}.{n}": t for n, t in snapshots["before"].items()})
            tensors.update({f"after{step}.{n}": t for n, t in weights(pipe).items()})
            if pipe.outer.codec is not None:  # what this replica's payload missed (error feedback)
                tensors[f"error{step}"] = pipe.outer.codec.error.clone()

    losses = train(pipe, optimizer, 8, model.config.vocab_size, on_step)
    info = {"dp": pipe.stats()["categories"]["data_parallel"], "losses": losses,
            "numel": sum(p.numel() for _, p in pipe.grads.trainable()),
            "names": [n for n, _ in pipe.outer.named]}  # the order the pseudo-gradient is flattened in
    if pipe.outer.codec is not None:
        info["payload_nbytes"] = pipe.outer.codec.payload_nbytes
    save(out_dir, f"mean-{compression}", tensors, info)


CODECS = {"none": None, "quantize8": {"method": "quantize", "bits": 8}}


def fragment_info(pipe) -> dict:
    """Each fragment's names (as split) and sizes, for the test to check against."""
    outer = pipe.outer
    return {"fragments": [[n for n, _ in f] for f in outer.fragments],
            "numel": [sum(p.numel() for _, p in f) for f in outer.fragments],
            "payload_nbytes": [c.payload_nbytes if c is not None else None for c in outer.codecs]}


def streaming(out_dir: str, compression: str, steps: int = 12, name: str = "", **settings) -> None:
    """Streaming DiLoCo on 1 stage, H=6 in 3 fragments (one syncs every 2 steps), outer lr 1, no
    momentum, inner AdamW: per step, the weights before DiLoCo's hook and after it, which
    fragments synced, the bytes sent so far and each fragment's error feedback."""
    params = {"method": "diloco", "sync_every": 6, "fragments": 3, "outer_lr": 1.0, "outer_momentum": 0.0,
              "nesterov": False, "compression": CODECS[compression], **settings}
    name = name or f"streaming-{compression}"
    model = debug_model("gpt2", seed=0)
    pipe = hf_actcomp.prepare(model, Plan(num_stages=1, data_parallel=2, dp_compression=params), timeout=60)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    snapshots = {}
    optimizer.register_step_post_hook(lambda *_: snapshots.update(before=weights(pipe)))
    pipe.attach_optimizer(optimizer)
    outer = pipe.outer
    tensors = {f"start.{n}": t for n, t in weights(pipe).items()}
    per_step = []

    def on_step(step: int) -> None:
        tensors.update({f"before{step}.{n}": t for n, t in snapshots["before"].items()})
        tensors.update({f"after{step}.{n}": t for n, t in weights(pipe).items()})
        for index, fragment in enumerate(outer.diloco._fragments):
            tensors.update({f"anchor{step}.{n}": t.clone() for n, t in fragment.original_parameters.items()})
            if outer.codecs[index] is not None:
                tensors[f"error{step}.{index}"] = outer.codecs[index].error.clone()
        per_step.append({"fragment_syncs": list(outer.fragment_syncs), "bytes_sent": outer.bytes_sent,
                         "outer_step": outer.manager.current_step()})

    train(pipe, optimizer, steps, model.config.vocab_size, on_step)
    save(out_dir, name, tensors, {"dp": pipe.stats()["categories"]["data_parallel"], "per_step": per_step,
                                  **fragment_info(pipe)})


def resumed(out_dir: str) -> None:
    """Streaming DiLoCo (2 fragments, H=4, a sync delay of 1, int8, Nesterov), inner SGD: 8 steps
    straight, saving the state after step 3 (fragment 1's sync in flight); then a fresh pipeline
    loads it and trains steps 4..8."""
    params = {"method": "diloco", "sync_every": 4, "fragments": 2, "fragment_sync_delay": 1,
              "compression": CODECS["quantize8"]}
    state_dir = os.path.join(out_dir, "resumed-state")
    results = {}
    for run, (first, save_after) in {"straight": (0, 3), "resumed": (3, None)}.items():
        model = debug_model("gpt2", seed=0)
        pipe = hf_actcomp.prepare(model, Plan(num_stages=1, data_parallel=2, dp_compression=params), timeout=60)
        optimizer = pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        if run == "resumed":
            pipe.load_compression_state(state_dir)
        for step in range(first, 8):
            pipe.train_step(replica_batch(model.config.vocab_size, pipe.replica, step))
            optimizer.step()
            optimizer.zero_grad()
            if step + 1 == save_after:
                pipe.save_compression_state(state_dir)
                results["saved_keys"] = sorted({k.split(".")[1] for k in pipe.compression_state_dict()
                                                if k.startswith("data_parallel.")})
        results[run] = pipe.stats()["categories"]["data_parallel"]
        save(out_dir, f"resumed-{run}", weights(pipe))
    save(out_dir, "resumed", {}, results)


def two_d(out_dir: str) -> None:
    """2 stages x 2 replicas, AQ-SGD boundaries, DiLoCo with int8 pseudo-gradients and stagger:
    each stage syncs at its own steps; the replicas agree after each of them."""
    model = debug_model("gpt2", seed=0)
    plan = Plan(num_stages=2, data_parallel=2, micro_batches=2,
                forward=Compression("aqsgd", bits=4), backward=Compression("quantize", bits=8),
                memory=MemoryConfig(num_samples=NUM_SAMPLES),
                dp_compression={"method": "diloco", "sync_every": 4, "stagger": True,
                                "compression": {"method": "quantize", "bits": 8}})
    pipe = hf_actcomp.prepare(model, plan, timeout=60)
    optimizer = pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-2))
    tensors = {}

    def on_step(step: int) -> None:
        tensors.update({f"step{step}.{n}": t for n, t in weights(pipe).items()})

    losses = train(pipe, optimizer, 10, model.config.vocab_size, on_step)
    stats = pipe.stats()["categories"]
    equivalence(out_dir, "2", diloco_schedule="zbh1")  # the same launch: DiLoCo under zero-bubble H1
    streaming_two_d(out_dir)
    save(out_dir, "two_d", tensors, {"dp": stats["data_parallel"], "losses": losses, "stage": pipe.stage_index,
                                     "replica": pipe.replica, "payload_nbytes": pipe.outer.codec.payload_nbytes,
                                     "sample_range": [pipe.sample_range.start, pipe.sample_range.stop]})


def streaming_two_d(out_dir: str) -> None:
    """2 stages x 2 replicas, Streaming DiLoCo (H=4 in 2 fragments) with stagger, fp32: stage 0
    syncs a fragment after steps 2, 4, 6, 8, stage 1 after 3, 5, 7, 9; the weights after each
    step and which fragments synced."""
    model = debug_model("gpt2", seed=0)
    plan = Plan(num_stages=2, data_parallel=2, micro_batches=2,
                dp_compression={"method": "diloco", "sync_every": 4, "fragments": 2, "stagger": True})
    pipe = hf_actcomp.prepare(model, plan, timeout=60)
    optimizer = pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-2))
    tensors, per_step = {}, []

    def on_step(step: int) -> None:
        tensors.update({f"step{step}.{n}": t for n, t in weights(pipe).items()})
        per_step.append({"fragment_syncs": list(pipe.outer.fragment_syncs), "bytes_sent": pipe.outer.bytes_sent})

    train(pipe, optimizer, 9, model.config.vocab_size, on_step)
    save(out_dir, "streaming_two_d", tensors, {"per_step": per_step, "stage": pipe.stage_index, **fragment_info(pipe)})


def fault(out_dir: str, stop_file: str, min_steps: str, max_steps: str, fragments: str = "1") -> None:
    """One replica of 2 launched on its own (REPLICA_GROUP_ID), 1 stage, H=2, min_replicas=1:
    after each sync, its weights, whether the sync was committed and which fragment synced (with
    `fragments` 2, one every step). Trains at least `min_steps` steps, then on until `stop_file`
    exists (while a killed peer restarts and heals), at most `max_steps`."""
    import time

    replica = int(os.environ["REPLICA_GROUP_ID"])
    model = debug_model("gpt2", seed=0)
    plan = Plan(num_stages=1, data_parallel=2, dp_compression={"method": "diloco", "sync_every": 2, "min_replicas": 1,
                                                               "fragments": int(fragments)})
    pipe = hf_actcomp.prepare(model, plan, timeout=30)
    optimizer = pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-2))
    # Both replicas' Managers are up (heartbeating) before either trains: a replica that reached
    # its first sync before its peer existed would form a quorum alone.
    open(os.path.join(out_dir, f"ready{replica}"), "w").close()
    while not os.path.exists(os.path.join(out_dir, f"ready{1 - replica}")):
        time.sleep(0.05)
    records, step = [], 0
    while step < int(min_steps) or (not os.path.exists(stop_file) and step < int(max_steps)):
        pipe.train_step(replica_batch(model.config.vocab_size, replica, step))
        syncs, failed, per_fragment = pipe.outer.syncs, pipe.outer.failed_syncs, list(pipe.outer.fragment_syncs)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if pipe.outer.syncs > syncs:
            name = f"replica{replica}-{os.getpid()}-sync{pipe.outer.syncs}"
            save_file({k: v.contiguous() for k, v in weights(pipe).items()}, os.path.join(out_dir, f"{name}.safetensors"))
            records.append({"name": name, "committed": pipe.outer.failed_syncs == failed,
                            "outer_step": pipe.outer.manager.current_step(),
                            "fragment": [a != b for a, b in zip(pipe.outer.fragment_syncs, per_fragment, strict=True)].index(True)})
        time.sleep(0.05)
    with open(os.path.join(out_dir, f"replica{replica}-{os.getpid()}.json"), "w") as f:
        json.dump({"records": records, "steps": step, "fragments": fragment_info(pipe)["fragments"]}, f)
    pipe.outer.close()


def one_stage(out_dir: str) -> None:
    """Every 1-stage x 2-replica scenario in one launch (a launch costs seconds per process)."""
    equivalence(out_dir, "1")
    for compression in ("none", "quantize8", "hadamard4", "topk_quantize2"):
        mean(out_dir, "1", compression)
    for compression in ("none", "quantize8"):
        streaming(out_dir, compression)
    streaming(out_dir, "none", 8, "delayed", sync_every=4, fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5)
    resumed(out_dir)


def main() -> None:
    scenario, out_dir, *args = sys.argv[1:]
    dist.init_process_group("gloo")
    try:
        globals()[scenario](out_dir, *args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
