"""One rank of the schedules benchmark (started by benchmarks/schedules.py, S ranks per launch).

For one link and one stage count S, runs every (micro-batch count, method) pair one after the
other in the same process group, so all of them see the same link in the same minute:

- ours: `Plan(schedule=...)` for every schedule (`gpipe`, `1f1b`, `zbh1`) and every codec
  setting (`none`: uncompressed, exact tie; `aqsgd`: recipes/configs/plan_aqsgd_fw4_bw8.yaml,
  i.e. AQ-SGD forward 4 bits, backward quantize 8 bits, plus `tie_compression` quantize 8 bits);
- the peer: torch.distributed.pipelining over the same stage modules, uncompressed, with the
  all-reduce of the tied weight's gradient a user has to add (see slow_link_worker.py). With
  S = 2 and Schedule1F1B this is slow_link_worker's own `build_peer`; the other schedules
  (ScheduleGPipe, ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble with two stages per
  rank in loop placement, ScheduleZBVZeroBubble with two per rank in V placement) and S > 2 are
  built the same way here.

Every run starts from a fresh model, runs `--warmup` steps (AQ-SGD: every sample's uncompressed
first visit happens there; the measured steps revisit them), then `--steps` measured steps.
A step's time is the global one: from the moment the first rank leaves the barrier (or the end
of the previous step on the slowest rank) to the end of the step on the slowest rank; one
round's value is the median over the measured steps. The window's other-CPU share and its
retries are slow_link_worker's `measure`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from harness import add_arguments, round_order
from peer import TIE, build_peer
from slow_link_worker import batches, make_model, measure

import hf_actcomp
from hf_actcomp import Compression, Plan
from hf_actcomp.models import get_adapter
from hf_actcomp.models.split import stage_ranges

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AQSGD_RECIPE = os.path.join(ROOT, "recipes", "configs", "plan_aqsgd_fw4_bw8.yaml")
CODECS = {"none": "uncompressed", "aqsgd": "AQ-SGD fw4/bw8 + tie q8"}
SCHEDULES = ("gpipe", "1f1b", "zbh1")
PEER = "torch.distributed.pipelining"
# torch.distributed.pipelining schedules (class name without "Schedule") and stages per rank.
PEER_SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2}
# Schedules whose rank r holds stages r and 2S - 1 - r (a V) instead of r, r + S, ... (a loop).
V_SHAPED = ("ZBVZeroBubble",)


def peer_stage_indices(name: str, rank: int, num_ranks: int) -> list[int]:
    """The stages rank `rank` holds under peer schedule `name`."""
    if name in V_SHAPED:
        return [rank, 2 * num_ranks - 1 - rank]
    return [rank + v * num_ranks for v in range(PEER_SCHEDULES[name])]


def make_plan(codec: str, schedule: str, args) -> Plan:
    if codec == "none":
        return Plan(num_stages=args.stages, micro_batches=args.micro_batches, schedule=schedule,
                    forward=Compression("none"), backward=Compression("none"))
    plan = Plan.from_file(AQSGD_RECIPE)
    return dataclasses.replace(plan, num_stages=args.stages, micro_batches=args.micro_batches, schedule=schedule,
                               tie_compression=Compression("quantize", bits=8),
                               memory=dataclasses.replace(plan.memory, num_samples=args.num_samples))


class StepClock:
    """A step function that also records when this rank began the first step and ended each."""

    def __init__(self, step) -> None:
        self.step = step
        self.reset()

    def reset(self) -> None:
        self.begin, self.ends = None, []

    def __call__(self) -> None:
        if self.begin is None:
            self.begin = time.perf_counter()
        self.step()
        self.ends.append(time.perf_counter())

    def global_steps(self) -> list[float]:
        """Seconds of each step over all ranks (CLOCK_MONOTONIC is one clock for the machine):
        step i ends when its slowest rank ends it."""
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.begin, self.ends))
        previous = min(begin for begin, _ in every)
        out = []
        for i in range(len(self.ends)):
            end = max(ends[i] for _, ends in every)
            out.append(end - previous)
            previous = end
        return out


def spec_of(args) -> dict:
    return dict(model=f"vocab {args.vocab}, tied", vocab=args.vocab, tied=True)


def model_args(args) -> SimpleNamespace:
    """What slow_link_worker's `make_model` and `batches` read."""
    return SimpleNamespace(seq_len=args.seq_len, hidden=args.hidden, layers=args.layers_per_stage * args.stages,
                           num_samples=args.num_samples, batch_size=args.batch_size)


def timed_run(step, reset, args, began: float) -> tuple[list[float], dict]:
    """Warm-up, then the measured steps; the window (slow_link_worker's `measure`) also holds
    the seconds this rank spent building the run, warming up and measuring."""
    clock = StepClock(step)
    built = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warm = time.perf_counter()

    def reset_all() -> None:
        clock.reset()
        if reset is not None:
            reset()

    mean, window = measure(clock, args.steps, args, reset=reset_all)
    window["mean_seconds_per_step"] = mean
    window["phase_seconds"] = dict(build=built - began, warmup=warm - built, measure=time.perf_counter() - warm)
    return clock.global_steps(), window


def run_ours(codec: str, schedule: str, args) -> dict:
    began = time.perf_counter()
    plan = make_plan(codec, schedule, args)
    model = make_model(spec_of(args), model_args(args))
    pipe = hf_actcomp.prepare(model, plan, timeout=600, track_error=False)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    data = batches(spec_of(args), model_args(args))

    def step():
        pipe.train_step(next(data))
        optimizer.step()
        optimizer.zero_grad()

    seconds, window = timed_run(step, pipe.reset_stats, args, began)
    steps = args.steps
    stats = pipe.stats(gather=True)
    local = pipe.stats()["categories"]
    per_rank: list = [None] * dist.get_world_size()  # (tie, collectives) bytes each rank sent
    dist.all_gather_object(per_rank, (local.get("tie", {}).get("bytes_sent", 0),
                                      local.get("collectives", {}).get("bytes_sent", 0)))
    S = args.stages
    channels = {n: c["bytes_sent"] for n, c in stats["channels"].items()}
    # The busiest direction of any boundary: its own payloads, plus the tie (first -> last stage
    # forward, last -> first backward) and the loss broadcast, which cross every boundary.
    directions = {}
    for b in range(S - 1):
        directions[f"boundary{b}.forward"] = channels.get(f"boundary{b}.forward", 0) + per_rank[0][0]
        directions[f"boundary{b}.backward"] = (channels.get(f"boundary{b}.backward", 0) + per_rank[S - 1][0]
                                               + per_rank[S - 1][1])
    stages = {int(s): dict(computing=t["seconds_computing"] / t["steps"], waiting=t["seconds_waiting"] / t["steps"],
                           step=t["seconds_step"] / t["steps"]) for s, t in stats["stages"].items()}
    categories = {k: c["bytes_sent"] / steps for k, c in stats["categories"].items()}
    return dict(seconds_per_step=statistics.median(seconds), step_seconds=seconds, per_stage=stages,
                slowest_compute_per_step=max(t["computing"] for t in stages.values()),
                bytes_per_step=stats["bytes_sent"] / steps, byte_ratio=stats["compression_ratio"],
                categories=categories, busiest_direction_bytes_per_step=max(directions.values()) / steps,
                blocks=[[r.start, r.stop] for r in pipe.ranges], **window)


def build_peer_schedule(model, name: str, args, tie_group):
    """`model` cut into `S x stages-per-rank` stages as a torch.distributed.pipelining user would
    (the same `build_stage` modules as ours; two per rank, loop placement, for the interleaved
    schedules; a V for ZBVZeroBubble), a `step(batch)` running `Schedule<name>` over them, then
    the all-reduce of the tied weight's gradient between the rank holding the input embedding
    and the one holding the head. In a V both are on rank 0, where the two stage modules share
    the tied parameter (autograd sums both uses into it): nothing to exchange (torch's
    `scale_grads` then divides that one gradient once per stage holding it: a timing peer, its
    numbers are not compared). Returns (modules, step)."""
    from torch.distributed import pipelining

    rank, S, M = dist.get_rank(), args.stages, args.micro_batches
    per_rank = PEER_SCHEDULES[name]
    n = S * per_rank
    adapter = get_adapter(model)
    ranges = stage_ranges(adapter, Plan(num_stages=n, micro_batches=M, schedule="gpipe"))
    indices = peer_stage_indices(name, rank, S)
    modules = [adapter.build_stage(ranges[i].start, ranges[i].stop, first=i == 0, last=i == n - 1) for i in indices]
    stages = [pipelining.PipelineStage(m, stage_index=i, num_stages=n, device=torch.device("cpu"))
              for m, i in zip(modules, indices, strict=True)]
    copies = [] if name in V_SHAPED else [dict(m.named_parameters())[TIE[1] if i == 0 else TIE[0]]
                                          for m, i in zip(modules, indices, strict=True) if i in (0, n - 1)]

    def loss_fn(logits, labels):
        return model.loss_function(logits, labels, vocab_size=model.config.vocab_size)

    schedule = getattr(pipelining, f"Schedule{name}")(stages if per_rank > 1 else stages[0], n_microbatches=M,
                                                      loss_fn=loss_fn)

    def step(batch: dict) -> None:
        kwargs = dict(attention_mask=batch["attention_mask"])
        if n - 1 in indices:  # the rank holding the last stage (rank 0 in a V)
            kwargs["target"] = batch["labels"]
        if rank == 0:
            schedule.step(batch["input_ids"], **kwargs)
        else:
            schedule.step(**kwargs)
        for copy in copies:  # both copies get the summed gradient, so they stay equal
            dist.all_reduce(copy.grad, group=tie_group)

    return modules, step


def run_peer(name: str, args, tie_group) -> dict:
    began = time.perf_counter()
    model = make_model(spec_of(args), model_args(args))
    if args.stages == 2 and name == "1F1B":  # the slow-link benchmark's peer, as it is
        module, peer_step, _ = build_peer(model, args.micro_batches, tied=True)
        modules = [module]
    else:
        modules, peer_step = build_peer_schedule(model, name, args, tie_group)
    params = {id(p): p for m in modules for p in m.parameters()}  # a V's two stages share the tie
    optimizer = torch.optim.SGD(list(params.values()), lr=1e-3)
    data = batches(spec_of(args), model_args(args))

    def step():
        peer_step(next(data))
        optimizer.step()
        optimizer.zero_grad()

    seconds, window = timed_run(step, None, args, began)
    S, per_rank = args.stages, PEER_SCHEDULES[name]
    activation = args.batch_size * args.seq_len * args.hidden * 4
    v_shaped = name in V_SHAPED
    # Stage-to-stage sends per micro-batch, each way (a V's turn, stage S-1 to S, stays on its rank).
    crossings = S * per_rank - 1 - (1 if v_shaped else 0)
    # The tied gradient; each of the two ranks sends all of it (ring of 2). A V holds both ends on rank 0.
    tie = 0 if v_shaped else args.vocab * args.hidden * 4
    categories = {"activations": crossings * activation, "activation_gradients": crossings * activation,
                  "tie": 2 * tie}
    # Interleaved (loop placement): every boundary carries two stage-to-stage sends each way, plus
    # the wrap from the last rank back to the first (activations one way, gradients the other).
    # V: each link carries the way down and the way back, one activation and one gradient each way.
    busiest = (1 if per_rank == 1 else 2 if v_shaped else 3) * activation + tie
    return dict(seconds_per_step=statistics.median(seconds), step_seconds=seconds, per_stage=None,
                slowest_compute_per_step=None, bytes_per_step=sum(categories.values()), byte_ratio=1.0,
                categories=categories, busiest_direction_bytes_per_step=busiest, **window)


def main() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, required=("out", "link"), steps=3, warmup=1, micro_batch_size=2, seq_len=64,
                  hidden=256, layers_per_stage=2, vocab=256, max_other_cpu=0.1, retries=1, repeats=3)
    p.add_argument("--micro_batch_counts", type=int, nargs="+", required=True)
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--peer_schedules", nargs="*", default=["GPipe", "1F1B", "Interleaved1F1B"],
                   choices=list(PEER_SCHEDULES))
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    args.stages = dist.get_world_size()
    tie_group = dist.new_group([0, args.stages - 1])  # the peer's tied-gradient all-reduce
    runs = [("peer", name) for name in args.peer_schedules]
    runs += [(codec, schedule) for codec in args.codecs for schedule in args.schedules]
    rows = {}
    for k in range(args.repeats):
        for M in args.micro_batch_counts:
            args.micro_batches = M
            args.batch_size = M * args.micro_batch_size
            args.num_samples = args.batch_size * max(args.warmup, 1)
            order = round_order(len(runs), k, args.repeats)
            for index in order:
                kind, name = runs[index]
                began = time.perf_counter()
                if kind == "peer":
                    result = run_peer(name, args, tie_group)
                else:
                    result = run_ours(kind, name, args)
                result["run_seconds"] = time.perf_counter() - began
                row = rows.setdefault((M, kind, name), dict(
                    link=args.link, stages=args.stages, micro_batches=M,
                    method=PEER if kind == "peer" else "ours", codec="none" if kind == "peer" else kind,
                    codec_label=CODECS["none" if kind == "peer" else kind], schedule=name,
                    tokens_per_step=args.batch_size * args.seq_len, rounds=[]))
                row["rounds"].append(dict(result, position=order.index(index)))
                if dist.get_rank() == 0:
                    label = f"{PEER} {name}" if kind == "peer" else f"ours {name}, {CODECS[kind]}"
                    extra = ("" if result["slowest_compute_per_step"] is None else
                             f"  slowest stage computes {result['slowest_compute_per_step']:.3f} s "
                             f"({result['seconds_per_step'] / result['slowest_compute_per_step']:.2f}x)")
                    print(f"{args.link:>10} S={args.stages} M={M} round {k} {label:<52} "
                          f"{result['seconds_per_step']:.3f} s/step {result['bytes_per_step'] / 1e6:6.2f} MB/step"
                          f"{extra}  other CPU {100 * result['other_cpu_share']:.0f}%", flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": list(rows.values())}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
