"""One data-parallel worker of benchmarks/dp_hooks.py: every method, one after the other, under DDP.

Two modes. With `--loss_steps N`: each method trains N steps from the same initialisation on this
worker's shard of the offline corpus, in list order, and reports the eval loss. Otherwise:
`--repeats` rounds of `--steps` timed steps per method (after 3 warm-up steps), each round in a
different order (round k starts at method k * n / repeats and runs backwards on odd k), so no
method always runs first or right after the same neighbour. Rank 0 writes the rows.

The peer is DDP with no hook: torch's built-in all-reduce, which overlaps each bucket's
all-reduce with the rest of the backward. Our `allreduce` hook is the same average computed
synchronously inside the hook (as all our hooks do).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from harness import add_arguments, busy_cpu_seconds, round_order, wait_until_quiet
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, GPT2Config

from hf_actcomp import dp
from hf_actcomp.data import build_tokenizer, causal_lm_datasets, offline_corpus

PEER = "DDP built-in all-reduce (no hook)"
# (label, hook or None for the peer, params). Sparsifiers at two levels whose wire bytes are ~50x
# and ~1000x below a ring all-reduce's at 2 workers; the rest at their natural setting.
HOOKS = [
    (PEER, None, {}),
    ("our all-reduce hook (no compression)", "allreduce", {}),
    ("PowerSGD rank 4 (torch)", "powersgd", {"matrix_approximation_rank": 4, "start_powerSGD_iter": 10}),
    ("topk 50x", "topk", {"ratio": 0.01}),
    ("topk 1000x", "topk", {"ratio": 0.0005}),
    ("randk 50x", "randk", {"ratio": 0.02}),
    ("randk 1000x", "randk", {"ratio": 0.001}),
    ("dgc 50x", "dgc", {"ratio": 0.01, "warmup_steps": 20}),
    ("dgc 1000x", "dgc", {"ratio": 0.0005, "warmup_steps": 20}),
    ("qsgd 4 levels", "qsgd", {"levels": 4, "bucket_size": 512}),
    ("ef_sign", "ef_sign", {}),
    ("marsit", "marsit", {}),
]
TIMED_WARMUP = 3  # bucket rebuild after step 1; PowerSGD's 2 uncompressed steps in timed runs


def timed_params(hook: str | None, params: dict) -> dict:
    """Timed runs measure the steady state: no DGC sparsity warm-up, PowerSGD compressing from
    step 3 (torch needs 2 uncompressed steps; the 3 warm-up steps cover them)."""
    if hook == "dgc":
        return {**params, "warmup_steps": 0}
    if hook == "powersgd":
        return {**params, "start_powerSGD_iter": 2}
    return params


class Method:
    """One method's DDP model, optimizer and hook state, ready to step."""

    def __init__(self, hook, params, tokenizer, shard, args) -> None:
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq_len, n_embd=256, n_layer=2, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.model = DDP(AutoModelForCausalLM.from_config(config))
        self.state = dp.register(self.model, hook, **params) if hook is not None else None
        # DGC applies momentum in the hook; the others use SGD with momentum.
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.0 if hook == "dgc" else 0.9)
        self.shard, self.batch_size = shard, args.batch_size
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def step(self, i: int) -> None:
        start = (i * self.batch_size) % (len(self.shard) - self.batch_size)
        batch = self.shard[start : start + self.batch_size]
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def reset_stats(self) -> None:
        if self.state is not None:
            self.state.bytes_sent = self.state.bytes_uncompressed = 0
            self.state.seconds = 0.0

    def stats(self, steps: int, world: int) -> dict:
        """Bytes each worker sends per step (ring formulas), byte ratio, hook seconds per step.
        The peer has no hook: its bytes are a ring all-reduce of every gradient, once per step."""
        if self.state is None:
            return dict(bytes_per_step=float(dp.ring_allreduce_bytes(self.param_bytes, world)), byte_ratio=1.0,
                        hook_seconds_per_step=None)
        s = self.state.stats()
        return dict(bytes_per_step=s["bytes_sent"] / steps, byte_ratio=s["compression_ratio"],
                    hook_seconds_per_step=s["seconds"] / steps)

    def timed(self, first: int, steps: int) -> tuple[float, float]:
        """Seconds per step over `steps` steps between two barriers, and the share of the machine's
        CPUs that other processes used meanwhile (rank 0's busy CPU time minus all our ranks' own;
        every rank computes the same number)."""
        dist.barrier()
        busy, own = busy_cpu_seconds()[0], time.process_time()
        start = time.perf_counter()
        for i in range(first, first + steps):
            self.step(i)
        dist.barrier()
        wall = time.perf_counter() - start
        mine = (busy_cpu_seconds()[0] - busy, time.process_time() - own, wall)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        busy, _, wall = per_rank[0]
        other = max(busy - sum(r[1] for r in per_rank), 0.0) / (os.cpu_count() * wall)
        return wall / steps, other

    def measure(self, first: int, steps: int, args) -> tuple[float, float, int]:
        """`timed`, taken again (after the machine goes quiet, continuing the step sequence) while
        other processes used more than `--max_other_cpu` of the CPUs, at most `--retries` times."""
        for attempt in range(args.retries + 1):
            self.reset_stats()
            seconds, other = self.timed(first + attempt * steps, steps)
            if other <= args.max_other_cpu or attempt == args.retries:
                return seconds, other, attempt + 1
            if dist.get_rank() == 0:
                print(f"other processes used {100 * other:.0f}% of the CPUs: measuring again", flush=True)
                wait_until_quiet(args.max_other_cpu)
            dist.barrier()
        raise AssertionError("unreachable")


def main() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, required=("out", "link"), steps=8, repeats=3, loss_steps=0, batch_size=8, seq_len=64,
                  lr=0.5, only=(None, "labels to run (default: all)"), max_other_cpu=0.1, retries=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    texts = offline_corpus()
    tokenizer = build_tokenizer(texts, vocab_size=1024)
    train, evaluation = causal_lm_datasets(tokenizer, texts, seq_len=args.seq_len)
    shard = train.with_format("torch").shard(world, rank)  # disjoint shards
    eval_rows = evaluation.with_format("torch")[:64]
    methods = [m for m in HOOKS if not args.only or m[0] in args.only]

    def log(row: dict, text: str) -> None:
        if rank == 0:
            print(f"{args.link:>10} W={world} {row['label']:<38} {text}", flush=True)

    rows = []
    if args.loss_steps:
        for label, hook, params in methods:
            method = Method(hook, params, tokenizer, shard, args)
            method.step(0)  # bucket rebuild
            method.reset_stats()
            seconds, other = method.timed(1, args.loss_steps)
            with torch.no_grad():
                loss = method.model.module(input_ids=eval_rows["input_ids"], labels=eval_rows["labels"]).loss.item()
            row = dict(link=args.link, workers=world, label=label, hook=hook, params=params,
                       steps=args.loss_steps + 1, eval_loss=loss, seconds_per_step=seconds, other_cpu_share=other,
                       parameters=method.parameters, **method.stats(args.loss_steps, world))
            rows.append(row)
            log(row, f"eval {loss:.3f}  x{row['byte_ratio']:.0f} over the run  {seconds * 1e3:.0f} ms/step")
    else:
        by_label = {}
        for k in range(args.repeats):
            for index in round_order(len(methods), k, args.repeats):
                label, hook, params = methods[index]
                params = timed_params(hook, params)
                method = Method(hook, params, tokenizer, shard, args)
                for i in range(TIMED_WARMUP):
                    method.step(i)
                seconds, other, attempts = method.measure(TIMED_WARMUP, args.steps, args)
                stats = method.stats(args.steps, world)
                row = by_label.setdefault(label, dict(
                    link=args.link, workers=world, label=label, hook=hook, params=params, steps=args.steps,
                    parameters=method.parameters, seconds_per_step=[], hook_seconds_per_step=[], bytes_per_step=[],
                    byte_ratio=[], other_cpu_share=[], attempts=[], position=[]))
                row["seconds_per_step"].append(seconds)
                row["hook_seconds_per_step"].append(stats["hook_seconds_per_step"])
                row["bytes_per_step"].append(stats["bytes_per_step"])
                row["byte_ratio"].append(stats["byte_ratio"])
                row["other_cpu_share"].append(other)
                row["attempts"].append(attempts)
                row["position"].append(round_order(len(methods), k, args.repeats).index(index))
                log(row, f"round {k}: {seconds * 1e3:7.1f} ms/step {stats['bytes_per_step'] / 1e6:7.3f} MB/step "
                         f"x{stats['byte_ratio']:.0f}  other CPU {100 * other:.0f}%")
        rows = [by_label[label] for label, _, _ in methods]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
