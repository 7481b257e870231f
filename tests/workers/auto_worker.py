"""Worker of the Plan.auto tests: `python auto_worker.py SCENARIO OUT_DIR`.

mixed (3 ranks): Plan.auto(quality="fast"), boundary 0 faked fast, boundary 1 faked slow; 4 SGD steps; losses, stats, plan.
shaped (2 ranks, each in its own network namespace): what Plan.auto measures over a real shaped link.
adapt (2 ranks): a plain `none` run of 2 steps, then Plan.auto(aqsgd, quality="fast", adapt_every=2) for 6 steps
    whose faked link slows down after steps 2 and 4; then a fresh auto pipeline loads the state.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import hf_actcomp
from hf_actcomp import MemoryConfig, Plan
from hf_actcomp.debug import debug_model
from hf_actcomp.pipeline.probe import FAKE_LINKS_ENV

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_cases import NUM_SAMPLES, sgd_losses, training_batches  # noqa: E402


def link(mbit: float) -> dict:
    return {"forward": {"bandwidth_mbit_s": mbit, "rtt_ms": 0}, "backward": {"bandwidth_mbit_s": mbit, "rtt_ms": 0}}


def mixed(out_dir: str) -> None:
    os.environ[FAKE_LINKS_ENV] = json.dumps({"0": link(10_000), "1": link(0.1)})
    pipe = hf_actcomp.prepare(debug_model("gpt2", seed=0), Plan.auto(num_stages=3, micro_batches=4, quality="fast"),
                              timeout=60)
    losses = sgd_losses(pipe, lambda batch: pipe.train_step(batch).loss, 4)
    return {"losses": losses, "stats": pipe.stats(gather=True), "plan": pipe.plan.to_dict()}


def shaped(out_dir: str) -> dict:
    """2 ranks over a shaped link (the test made it; nothing faked): Plan.auto measures it at
    the first step. Micro-batches of 4 x 256 tokens x 64 fp32 (256 KiB: a 128 KiB probe)."""
    model = debug_model("gpt2", seed=0, n_positions=256)
    pipe = hf_actcomp.prepare(model, Plan.auto(num_stages=2, micro_batches=2), timeout=120)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, pipe.config.vocab_size, (8, 256), generator=g)
    pipe.train_step({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return {"decision": pipe.plan.autotune.decision}


def parameters(pipe) -> list[torch.Tensor]:
    return [p.detach().clone() for p in pipe.stage.parameters()]


# Wide enough that AQ-SGD's 2-bit hadamard_outliers deltas are smaller than its 4-bit quantize ones
# (their per-token overhead outweighs 2 bits below ~128 channels).
WIDE = 256


def adapt(out_dir: str) -> dict:
    rank = dist.get_rank()
    os.environ[FAKE_LINKS_ENV] = json.dumps({"compute_ms": 10, "0": link(10_000)})
    plain = hf_actcomp.prepare(debug_model("gpt2", seed=0, n_embd=WIDE), Plan(num_stages=2, micro_batches=2), timeout=60)
    plain_losses = sgd_losses(plain, lambda batch: plain.train_step(batch).loss, 2)
    plain_weights = parameters(plain)

    plan = Plan.auto(num_stages=2, micro_batches=2, aqsgd=True, adapt_every=2, quality="fast", tolerance=0.5,
                     memory=MemoryConfig(num_samples=NUM_SAMPLES, dtype="fp32"))
    pipe = hf_actcomp.prepare(debug_model("gpt2", seed=0, n_embd=WIDE), plan, timeout=60)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses, seen, equal_after_two = [], [], None
    slower = {2: 5.0, 4: 0.5}  # Mbit/s from the step with this index on
    for i, batch in enumerate(training_batches(pipe.config.vocab_size, 6)):
        if i in slower:
            os.environ[FAKE_LINKS_ENV] = json.dumps({"compute_ms": 10, "0": link(slower[i])})
        losses.append(pipe.train_step(batch).loss.item())
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        if i == 1:
            equal_after_two = all(torch.equal(a, b) for a, b in zip(parameters(pipe), plain_weights, strict=True))
        end = pipe.forward_out or pipe.forward_in
        memory = getattr(end.receiver, "memory", None) or getattr(getattr(end.sender, "mirror", None), "memory", None)
        seen.append(int(memory.seen.sum()) if memory is not None else None)
    state = os.path.join(out_dir, "state")
    pipe.save_compression_state(state)
    end = pipe.forward_out or pipe.forward_in
    memory = end.receiver.memory if end.receiver is not None else end.sender.mirror.memory
    checksum = float(memory.read(torch.arange(NUM_SAMPLES), torch.device("cpu"), torch.float64).sum())
    dist.barrier()
    fresh = hf_actcomp.prepare(debug_model("gpt2", seed=0, n_embd=WIDE), plan, timeout=60)
    fresh.load_compression_state(state)
    fresh_end = fresh.forward_out or fresh.forward_in
    fresh_memory = fresh_end.receiver.memory if fresh_end.receiver is not None else fresh_end.sender.mirror.memory
    return {"plain_losses": plain_losses, "losses": losses, "equal_after_two": equal_after_two, "seen": seen,
            "stats": pipe.stats(gather=True), "rank": rank, "checksum": checksum,
            "resumed": [fresh.plan.forward_at(0).describe(), fresh.plan.backward_at(0).describe()],
            "resumed_checksum": float(fresh_memory.read(torch.arange(NUM_SAMPLES), torch.device("cpu"),
                                                        torch.float64).sum())}


def main() -> None:
    scenario, out_dir = sys.argv[1:]
    dist.init_process_group("gloo")
    result = {"mixed": mixed, "adapt": adapt, "shaped": shaped}[scenario](out_dir)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
