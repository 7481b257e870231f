"""Pipeline schedules: GPipe, 1F1B and zero-bubble H1 (`Plan(schedule=...)`) vs torch.distributed.pipelining.

For each link (loopback: compute-bound on this CPU; `--rates` Mbit/s: each stage in its own
network namespace, neighbours joined by `tc tbf`-shaped veth pairs, link-bound), each stage
count S (`--stages`), each micro-batch count M = factor x S (`--micro_batch_factors`, default
S and 2S), each codec setting (uncompressed; AQ-SGD fw4/bw8 as recipes/configs/plan_aqsgd_fw4_bw8.yaml
plus tie quantize 8) and each schedule: the steady-state step time (median over the measured
steps), each stage's seconds computing and waiting, bytes per category, and the step time over
the slowest stage's own compute per step (forward + backward + codecs: `seconds_computing` of
`Pipeline.stats(gather=True)["stages"]`, i.e. the stage's step time minus its waiting; the ideal
is 1, the target within 1.05x). Beside them, torch.distributed.pipelining on the same stage modules,
uncompressed (ScheduleGPipe, Schedule1F1B, and on loopback ScheduleInterleaved1F1B), and its fastest.

Default model (small, so that everything runs in about 12 minutes on a quiet 2-CPU machine):
GPT-2 style, hidden 256, 4 heads, 2 layers per stage, byte-level vocabulary of 256 with the head
tied to the input embedding, micro-batches of 2 x 64 tokens (M micro-batches a step), 1 warm-up
step, 3 measured steps per run, 3 rounds. On 10 Mbit/s the uncompressed traffic of the busiest
boundary direction takes several times a stage's compute (link-bound); AQ-SGD brings it to about
the compute.

One launch of S ranks per (link, S) runs every (M, method) back to back (benchmarks/schedules_worker.py),
`--repeats` rounds in alternating order (benchmarks/harness.py `round_order`); tables give the
median and the range over the rounds. Needs root (namespaces, tc); everything the run creates
is named after its pid and removed at the end, and every rank (loopback included) runs inside a
namespace the run made, so it only ever uses addresses there.

    sudo .venv/bin/python benchmarks/schedules.py                  # everything (about 12 minutes)
    sudo .venv/bin/python benchmarks/schedules.py --quick          # loopback, S=2, M=4, 2 steps, 1 round (~30 s)
    sudo .venv/bin/python benchmarks/schedules.py --rates 10 --no_loopback --stages 4 --schedules 1f1b zbh1

Writes benchmarks/results/schedules.{json,md} (`--quick`: schedules_quick.*; `--name` another).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time

import torch
from harness import (
    LinkedNamespaces,
    LoopbackNamespace,
    NamespaceChain,
    add_arguments,
    median,
    namespaces,
    ratio_spread,
    run_workers,
    write_markdown,
)
from schedules_worker import CODECS, PEER, PEER_SCHEDULES, SCHEDULES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKER = os.path.join(ROOT, "benchmarks", "schedules_worker.py")
TARGET = 1.05  # step time / slowest stage's compute


def machine() -> dict:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 2**20
    return dict(cpu=cpu, cpus=os.cpu_count(), memory_gib=round(mem, 1), torch=torch.__version__,
                python=platform.python_version(), kernel=platform.release())


def collapse(r: dict) -> dict:
    """One row from its rounds: median s/step and range; the median round's stage times,
    bytes and compute; the largest other-CPU share of any round."""
    rounds = r["rounds"]
    seconds = [x["seconds_per_step"] for x in rounds]
    mid = sorted(rounds, key=lambda x: x["seconds_per_step"])[(len(rounds) - 1) // 2]
    r.update(seconds_per_step=median(seconds), seconds_min=min(seconds), seconds_max=max(seconds),
             per_stage=mid["per_stage"], slowest_compute_per_step=mid["slowest_compute_per_step"],
             bytes_per_step=mid["bytes_per_step"], byte_ratio=mid["byte_ratio"], categories=mid["categories"],
             busiest_direction_bytes_per_step=mid["busiest_direction_bytes_per_step"],
             other_cpu_share=max(x["other_cpu_share"] for x in rounds),
             attempts=[x.get("attempts", 1) for x in rounds])
    if r["slowest_compute_per_step"] is not None:
        ratios = [x["seconds_per_step"] / x["slowest_compute_per_step"] for x in rounds]
        r.update(over_compute=median(ratios), over_compute_min=min(ratios), over_compute_max=max(ratios))
    return r


def link_mbit(link: str) -> float | None:
    return None if link == "loopback" else float(link.split()[0])


def summarize(rows: list[dict]) -> list[dict]:
    """Per (link, S, M): the fastest peer schedule, and every row's speed-up over it and over
    ours-1f1b of the same codec (ratios of the medians over the rounds, with their range);
    on a shaped link, the busiest boundary direction's seconds at the link's rate vs compute."""
    rows = [collapse(r) for r in rows]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["link"], r["stages"], r["micro_batches"]), []).append(r)
    for group in groups.values():
        peers = [r for r in group if r["method"] == PEER]
        best = min(peers, key=lambda r: r["seconds_per_step"]) if peers else None
        base = {r["codec"]: r for r in group if r["method"] == "ours" and r["schedule"] == "1f1b"}
        for r in group:
            r["fastest_peer"] = r is best
            r["peer_schedule"] = best["schedule"] if best else None
            for key, ref in (("vs_peer", best), ("vs_1f1b", base.get(r["codec"]))):
                value = ratio_spread([x["seconds_per_step"] for x in ref["rounds"]],
                                     [x["seconds_per_step"] for x in r["rounds"]]) if ref else (None, None, None)
                r[key], r[key + "_min"], r[key + "_max"] = value
            mbit = link_mbit(r["link"])
            compute = r["slowest_compute_per_step"] or (base["none"]["slowest_compute_per_step"]
                                                        if "none" in base else None)
            r["link_seconds"] = None if mbit is None else r["busiest_direction_bytes_per_step"] * 8 / (mbit * 1e6)
            floors = [x for x in (r["slowest_compute_per_step"], r["link_seconds"]) if x is not None]
            r["over_floor"] = r["seconds_per_step"] / max(floors) if r["slowest_compute_per_step"] is not None else None
            r["regime"] = ("compute-bound" if mbit is None or compute is None or r["link_seconds"] <= compute
                           else "link-bound")
    return rows


def _spread(r: dict, key: str, unit: str = "x") -> str:
    if r.get(key) is None:
        return ""
    return f"{r[key]:.2f}{unit} [{r[key + '_min']:.2f}-{r[key + '_max']:.2f}]"


def _f(value, fmt: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{fmt}}{suffix}"


def _mb(r: dict, category: str) -> str:
    return f"{r['categories'].get(category, 0) / 1e6:.3f}"


def header(rows: list[dict], args, info: dict) -> list[str]:
    ncpu = info["cpus"]
    lines = [
        "# Pipeline schedules: GPipe, 1F1B, zero-bubble H1 vs torch.distributed.pipelining",
        "",
        f"Machine: {info['cpu']}, {ncpu} CPUs, {info['memory_gib']} GiB, torch {info['torch']}, Linux "
        f"{info['kernel']}; 1 CPU thread per rank, one rank per stage. "
        + (f"**S={max(args.stages)} runs {max(args.stages)} processes on {ncpu} CPUs**: the stages time-share the "
           "cores, so a stage's compute also holds time it was ready but waited for a core, and step / slowest "
           "compute is not comparable across S (with S > CPUs the floor is the stages' total compute / CPUs, not "
           "the slowest stage's). " if max(args.stages) > ncpu else "")
        + f"During the measured steps other processes used at most "
        f"{100 * max(r['other_cpu_share'] for r in rows):.0f}% of the machine's CPUs (/proc/stat minus our ranks' "
        f"CPU time; a window above {100 * args.max_other_cpu:.0f}% was measured again, up to {args.retries} times).",
        "",
        f"Model: GPT-2 style, hidden {args.hidden}, 4 heads, {args.layers_per_stage} layers per stage "
        f"({args.layers_per_stage} x S in all), vocabulary {args.vocab} (byte level) with `lm_head` tied to the "
        f"input embedding (so the tie is exchanged every step); sequences of {args.seq_len} tokens, "
        f"{args.micro_batch_size} sequences per micro-batch (a step of M micro-batches has M x "
        f"{args.micro_batch_size * args.seq_len} tokens); tokens uniform over the vocabulary; SGD. "
        f"Each run starts from a fresh model: {args.warmup} warm-up step(s) (AQ-SGD's uncompressed first visits of "
        f"every sample), then {args.steps} measured steps; a round's s/step is the median over them (a step ends "
        f"when its slowest rank ends it); {args.repeats} round(s), round k starts at run k*n/{args.repeats} and "
        "runs backwards on odd rounds.",
        "",
        "Settings: **uncompressed** (fp32 activations and gradients, exact tie rows); **AQ-SGD fw4/bw8 + tie q8** "
        "(recipes/configs/plan_aqsgd_fw4_bw8.yaml: forward AQ-SGD 4 bits, backward quantize 8 bits, fp16 host "
        "memory; plus `tie_compression=Compression(\"quantize\", bits=8)`). The peer: torch.distributed.pipelining "
        "over the same `build_stage` modules, uncompressed, plus the all-reduce of the tied gradient a user has to "
        "write (benchmarks/slow_link_worker.py; its `build_peer` is the S=2 Schedule1F1B run); interleaved "
        "schedules put 2 stages per rank (loop placement), so every boundary carries 3x the activations of 1F1B; "
        "ZBVZeroBubble puts 2 per rank in a V (rank r holds stages r and 2S-1-r): the tied embedding and head are "
        "both on rank 0 (no tie exchange), and every link carries one activation and one gradient each way; "
        f"peer schedules on loopback: {', '.join(args.peer_schedules) or 'none'}; on the shaped links: "
        f"{', '.join(args.link_peer_schedules) or 'none'}.",
        "",
        "Links and their regime (busiest boundary direction's bytes at the link's rate vs the slowest stage's "
        "compute, median over rows):",
        "",
    ]
    for link in dict.fromkeys(r["link"] for r in rows):
        if link == "loopback":
            lines.append("- **loopback**: all ranks in one namespace of ours, gloo over its 127.0.0.1 (about 4 GB/s): "
                         "compute-bound.")
            continue
        parts = []
        for codec, label in CODECS.items():
            ours = [r for r in rows if r["link"] == link and r["codec"] == codec and r["method"] == "ours"]
            if ours:
                ratio = median([r["link_seconds"] / r["slowest_compute_per_step"] for r in ours])
                parts.append(f"{label}: link / compute {ratio:.1f}x, "
                             f"{'link-bound' if ratio > 1 else 'compute-bound'}")
        lines.append(f"- **{link}**: each stage in its own network namespace, neighbours joined by a veth pair shaped "
                     "by `tc tbf` on both ends (64 kB burst, 50 ms queue; S > 2: a chain of namespaces, "
                     "first-to-last traffic such as the tie routed through the ones between); " + "; ".join(parts) + ".")
    lines += [
        "",
        "Columns: **s/step**: median over rounds [fastest-slowest round]. **vs ours 1f1b**: ours-1f1b's s/step of "
        "the same setting over this row's (>1: faster than 1f1b). **vs fastest peer**: the fastest "
        "torch.distributed.pipelining schedule's s/step (uncompressed) over this row's. Ratios: ratio of the "
        "medians [the other's fastest round over this one's slowest, and the reverse]. **slowest compute**: "
        "the largest per-stage `seconds_computing` per step (stage step minus its waiting on receives and "
        "collectives: forward, backward, codecs), median round. **step / compute**: s/step over it, per "
        f"round, median [range] (1.00 = no bubble, no exposed communication; target {TARGET:.2f}x). **step / max(compute, "
        "link)**: s/step over the larger of the slowest compute and link s (on a link-bound link the link is the "
        "floor; loopback: the same as step / compute). **per stage**: "
        "computing / waiting seconds per step, stage 0 first. **link s**: the busiest boundary direction's bytes per "
        "step (its payloads + tie + loss broadcast) at the link's rate. **MB/step**: bytes sent per step by all "
        "ranks: activations / activation gradients / tie / collectives (the peer: tensor sizes). **other CPU**: "
        "largest share of the CPUs other processes used in a round.",
    ]
    return lines


def synchronous_floor(stages: int, micro_batches: int) -> float:
    """No synchronous schedule's step is shorter than this multiple of the slowest stage's compute
    (unit-time forward, input gradient and weight gradient; balanced stages)."""
    return (3 * micro_batches + stages - 1) / (3 * micro_batches)


def write(rows: list[dict], args, info: dict) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump({"args": vars(args), "machine": info, "rows": rows}, f, indent=1)
    lines = header(rows, args, info)
    columns = ["link", "S", "M", "setting", "schedule", "s/step [min-max]", "vs ours 1f1b", "vs fastest peer",
               "slowest compute s", "step / compute", "step / max(compute, link)", "per stage compute / wait s",
               "link s (regime)",
               "MB/step act / grad / tie / coll", "other CPU"]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        schedule = (f"{r['schedule']}" if r["method"] == "ours" else
                    f"torch Schedule{r['schedule']}" + (" (fastest)" if r["fastest_peer"] else ""))
        per_stage = ("" if not r["per_stage"] else
                     "; ".join(f"{t['computing']:.3f} / {t['waiting']:.3f}"
                               for _, t in sorted(r["per_stage"].items(), key=lambda kv: int(kv[0]))))
        compute = "" if r["slowest_compute_per_step"] is None else f"{r['slowest_compute_per_step']:.3f}"
        link = "" if r["link_seconds"] is None else f"{r['link_seconds']:.3f} ({r['regime']})"
        mb = " / ".join(_mb(r, c) for c in ("activations", "activation_gradients", "tie", "collectives"))
        lines.append(f"| {r['link']} | {r['stages']} | {r['micro_batches']} | {r['codec_label']} | {schedule} | "
                     f"{r['seconds_per_step']:.3f} [{r['seconds_min']:.3f}-{r['seconds_max']:.3f}] | "
                     f"{_spread(r, 'vs_1f1b')} | {_spread(r, 'vs_peer')} | {compute} | {_spread(r, 'over_compute')} | "
                     f"{_f(r['over_floor'], '.2f', 'x')} | {per_stage} | {link} | {mb} | {100 * r['other_cpu_share']:.0f}% |")
    best = [r for r in rows if r["method"] == "ours"]
    if best:
        lines += ["", "Fastest schedule of ours per (link, S, M, setting), and how close it gets to the slowest "
                  f"stage's compute (target {TARGET:.2f}x). **floor**: the shortest step of any synchronous "
                  "schedule over the slowest stage's compute in unit time, (3M + S - 1) / 3M with balanced stages "
                  "(the last stage waits S - 1 forwards, then has 3M units of its own: forward, input gradient, "
                  "weight gradient); zbh1's order reaches it (tests/test_pipeline.py):", "",
                  "| link | S | M | setting | fastest | s/step | step / compute | floor | vs ours 1f1b | "
                  "vs fastest peer (peer schedule) |", "|---|---|---|---|---|---|---|---|---|---|"]
        keys = dict.fromkeys((r["link"], r["stages"], r["micro_batches"], r["codec"]) for r in best)
        for key in keys:
            group = [r for r in best if (r["link"], r["stages"], r["micro_batches"], r["codec"]) == key]
            r = min(group, key=lambda x: x["seconds_per_step"])
            met = "" if r.get("over_compute") is None else (" (met)" if r["over_compute"] <= TARGET else "")
            lines.append(f"| {r['link']} | {r['stages']} | {r['micro_batches']} | {r['codec_label']} | "
                         f"{r['schedule']} | {r['seconds_per_step']:.3f} | {_spread(r, 'over_compute')}{met} | "
                         f"{synchronous_floor(r['stages'], r['micro_batches']):.2f}x | {_spread(r, 'vs_1f1b')} | "
                         f"{_spread(r, 'vs_peer')} ({r['peer_schedule'] or ''}) |")
    write_markdown(RESULTS, args.name, lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, rates=[10], no_loopback=False,
                  steps=(3, "measured steps per run (the median is kept)"),
                  warmup=(1, "steps before measuring (AQ-SGD's first visits)"),
                  repeats=(3, "rounds, each in another order"), micro_batch_size=2, seq_len=64, hidden=256,
                  layers_per_stage=2, vocab=256, retries=1, timeout=1800,
                  max_other_cpu=(0.1, "measure a run again when other processes used more than this share of the CPUs"),
                  quick=(False, "loopback only, S=2, M=4, 2 measured steps, 1 round, no retries (a smoke test)"),
                  summarize_only=(False, "rewrite the table from the saved .json"))
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--micro_batch_factors", type=int, nargs="+", default=[1, 2], help="M = factor x S")
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--peer_schedules", nargs="*", default=["GPipe", "1F1B", "Interleaved1F1B"],
                   choices=list(PEER_SCHEDULES), help="torch.distributed.pipelining schedules on loopback (none: no peer)")
    p.add_argument("--link_peer_schedules", nargs="*", default=["GPipe", "1F1B"], choices=list(PEER_SCHEDULES),
                   help="the same on the shaped links (interleaved ones send 3x the activations over every boundary)")
    p.add_argument("--name", default=None, help="results file name in benchmarks/results/ (default schedules, "
                                                 "schedules_quick with --quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.stages, args.micro_batch_factors = [], [2], [2]
        args.steps, args.repeats, args.retries = 2, 1, 0
    args.name = args.name or ("schedules_quick" if args.quick else "schedules")
    if args.summarize_only:
        with open(os.path.join(RESULTS, f"{args.name}.json")) as f:
            saved = json.load(f)
        vars(args).update({k: v for k, v in saved["args"].items() if k not in ("summarize_only", "name")})
        write(summarize([{k: v for k, v in r.items() if k in RAW} for r in saved["rows"]]), args, saved["machine"])
        return
    if args.repeats < 3 and not args.quick:
        print(f"warning: --repeats {args.repeats}: fewer than 3 rounds give no meaningful spread", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the namespaces are removed
    worker_args = [f"--{k}={getattr(args, k)}" for k in
                   ("steps", "warmup", "micro_batch_size", "seq_len", "hidden", "layers_per_stage", "vocab",
                    "max_other_cpu", "retries", "repeats")]
    worker_args += ["--codecs", *args.codecs, "--schedules", *args.schedules]
    info = machine()
    start = time.monotonic()
    rows = []
    port = 29500
    links = ([] if args.no_loopback else [None]) + list(args.rates)
    for S in args.stages:
        counts = ["--micro_batch_counts", *(str(f * S) for f in args.micro_batch_factors)]
        for rate in links:
            link = "loopback" if rate is None else f"{rate} Mbit/s"
            peers = ["--peer_schedules", *(args.peer_schedules if rate is None else args.link_peer_schedules)]
            if rate is None:
                net = LoopbackNamespace(S)
            else:
                net = LinkedNamespaces() if S == 2 else NamespaceChain(S)
            began = time.monotonic()
            print(f"--- {link}, S={S}" + (f" ({S} processes on {os.cpu_count()} CPUs)" if S > os.cpu_count() else ""),
                  flush=True)
            with namespaces(net):
                if rate is not None:
                    net.shape(rate)
                rows += run_workers(WORKER, S, link, worker_args + counts + peers, net, port, args.timeout)["rows"]
            print(f"--- {link}, S={S}: {time.monotonic() - began:.0f} s", flush=True)
    args.elapsed_seconds = round(time.monotonic() - start)
    write(summarize(rows), args, info)
    print(f"\nwhole run: {args.elapsed_seconds} s", flush=True)


RAW = ("link", "stages", "micro_batches", "method", "codec", "codec_label", "schedule", "tokens_per_step", "rounds")

if __name__ == "__main__":
    main()
