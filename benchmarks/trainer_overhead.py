"""What `ActCompTrainer` costs per optimizer step over a plain loop over `Pipeline.train_step`.

The same plan (AQ-SGD fw4/bw8, 2 stages, 2 micro-batches, 1F1B: recipes/configs/plan_aqsgd_fw4_bw8.yaml),
the same small random GPT-2 (recipes' `offline-gpt2`: 4 layers, hidden 128), the same data (CPython's
reference docs in blocks of 128 tokens, a tokenizer built locally), the same optimizer (fused AdamW,
TrainingArguments' default), linear schedule, clipping at 1.0 and number of steps; 2 processes on
127.0.0.1 (gloo, one CPU thread each), no evaluation, no saving. The Trainer runs as users run it:
its defaults (progress bar on) and a log every `--logging_steps` steps, whose `comm/*` entries
ActCompTrainer adds. Both methods run in the same two processes (benchmarks/trainer_overhead_worker.py),
in `--rounds` rounds of alternating order, in two modes:

- `interleaved`: one Trainer run whose callback runs `--block` steps of the loop after every
  `--block` Trainer steps (the loop's block first in odd rounds), each method's clock paused while
  the other runs: both see the same machine load, to within seconds;
- `separate`: a whole run of each, one after the other (the loop first in even rounds).

Every step's end is marked on every rank: the wall clock, the process's CPU time, and the seconds
spent so far inside `Pipeline.train_step` + `clip_grad_norm_` (the shared work) and in each part of
the rest (data, optimizer, schedule, zero_grad; the Trainer's logging, `comm/*` statistics,
callbacks and flop count). Steady state: from the end of step `--warmup` (AQ-SGD's first epoch
sends uncompressed first visits) to the last step. Per round: rank 0's mean wall seconds per step
(logging steps included), the median step, both ranks' CPU seconds per step, and each rank's own
overhead (its wall clock minus the shared work); ratios are taken within each round.

    .venv/bin/python benchmarks/trainer_overhead.py                 # both modes, 3 rounds, ~12 minutes
    .venv/bin/python benchmarks/trainer_overhead.py --profile --rounds 1 --modes interleaved --name trainer_overhead_profile
    .venv/bin/python benchmarks/trainer_overhead.py --rewrite --before trainer_overhead_before   # the .md again

Writes benchmarks/results/trainer_overhead.{md,json} (`--name` for another file; `--before NAME`
shows an earlier run of other code beside this one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import time

import torch
import yaml
from harness import add_arguments, busy_cpu_seconds, loadavg, median, run_workers, write_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKER = os.path.join(ROOT, "benchmarks", "trainer_overhead_worker.py")
PLAN = os.path.join(ROOT, "recipes", "configs", "plan_aqsgd_fw4_bw8.yaml")
TARGET = 1.05
METHODS = ("loop", "trainer")
MODES = ("interleaved", "separate")
PARTS = ("data", "optimizer", "scheduler", "zero_grad", "logging", "comm_logs", "callbacks", "flops")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, rounds=3, steps=(160, "optimizer steps per run"),
                  warmup=(32, "steps left out of the steady state"), batch_size=8, seq_len=128, hidden=128,
                  layers=4, quiet_wait=(120.0, "the longest such wait, seconds"), timeout=3600.0,
                  train_samples=(128, "rows of 128 tokens (an epoch: rows / batch steps)"),
                  quiet=(0.25, "before each run, wait until the machine's CPUs were at most this busy over 3 s (0: never)"),
                  rewrite=(False, "rewrite the .md from the saved .json, running nothing"))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--block", type=int, default=4, help="interleaved: steps of one method between the other's")
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--no_tqdm", action="store_true", help="the Trainer without its progress bar")
    p.add_argument("--plan", default=PLAN)
    p.add_argument("--profile", action="store_true", help="cProfile rank 0 (not for timings: it slows Python)")
    p.add_argument("--name", default="trainer_overhead")
    p.add_argument("--note", default="", help="a line for the results file (e.g. which code was measured)")
    p.add_argument("--before", default=None, help="the name of an earlier run's results (other code) to show beside")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steady(row: dict, warmup: int) -> dict:
    """Per step from the end of step `warmup` to the last: rank 0's wall-clock seconds (mean, and
    the median interval); per rank the CPU seconds, the own overhead (wall clock minus the time
    inside train_step and clip_grad_norm_) and its timed parts, `other` being the rest of it."""
    wall = row["ranks"][0]["wall"]
    steps = len(wall) - warmup
    intervals = [b - a for a, b in zip(wall[warmup - 1:], wall[warmup:], strict=False)]

    def per_step(values: list[float]) -> float:
        return (values[-1] - values[warmup - 1]) / steps

    out = {"steps": steps, "mean": per_step(wall), "median": median(intervals),
           "cpu": [per_step(r["cpu"]) for r in row["ranks"]], "own": [], "parts": []}
    # Process-wide (both methods' when interleaved): system CPU seconds, page faults, garbage collection.
    out.update({name: [per_step(r["process"][name]) for r in row["ranks"]] for name in ("system", "faults", "gc")})
    for r in row["ranks"]:
        own = per_step(r["wall"]) - per_step(r["parts"]["shared"])
        parts = {name: per_step(r["parts"][name]) for name in PARTS if name in r["parts"]}
        parts["other"] = own - sum(parts.values())
        out["own"].append(own)
        out["parts"].append(parts)
    return out


def spread(values: list[float]) -> tuple[float, float, float]:
    return median(values), min(values), max(values)


def summarize(rows: list[dict], warmup: int) -> dict:
    """Per round and method the steady state; the Trainer / loop ratios within each round (median
    and range over the rounds); per method the median and range of each figure."""
    per_round: dict = {}
    for row in rows:
        per_round.setdefault(row["round"], {})[row["method"]] = steady(row, warmup)
    rounds = list(per_round.values())
    out: dict = {"rounds": per_round}
    for name, figure in (("ratio", lambda r: r["mean"]), ("median_step_ratio", lambda r: r["median"]),
                         ("cpu_ratio", lambda r: sum(r["cpu"]))):
        out[name] = spread([figure(r["trainer"]) / figure(r["loop"]) for r in rounds])
    ranks = len(rows[0]["ranks"])
    for method in METHODS:
        figures = {"mean": lambda r: r["mean"], "median": lambda r: r["median"], "cpu": lambda r: sum(r["cpu"]),
                   "system": lambda r: sum(r["system"]), "faults": lambda r: sum(r["faults"]),
                   "gc": lambda r: sum(r["gc"])}
        for k in range(ranks):
            figures[f"own{k}"] = lambda r, k=k: r["own"][k]
            for part in (*PARTS, "other"):
                figures[f"{part}{k}"] = lambda r, k=k, part=part: r["parts"][k].get(part)
        for key, figure in figures.items():
            values = [figure(r[method]) for r in rounds]
            out[f"{method}_{key}"] = spread(values) if None not in values else None
    # The Trainer's extra own time (rank 0), alone and as a share of the loop's step.
    extra = [r["trainer"]["own"][0] - r["loop"]["own"][0] for r in rounds]
    out["extra_own"] = spread(extra)
    out["extra_own_share"] = spread([e / r["loop"]["mean"] for e, r in zip(extra, rounds, strict=True)])
    return out


def summaries(saved: dict) -> dict:
    warmup = saved["meta"]["args"]["warmup"]
    modes = dict.fromkeys(row["mode"] for row in saved["rows"])
    return {mode: summarize([r for r in saved["rows"] if r["mode"] == mode], warmup) for mode in modes}


def ms(value: tuple | None) -> str:
    return "" if value is None else f"{value[0] * 1e3:.1f} [{value[1] * 1e3:.1f}-{value[2] * 1e3:.1f}]"


def times(value: tuple) -> str:
    return f"{value[0]:.3f}x [{value[1]:.3f}-{value[2]:.3f}]"


def mode_lines(mode: str, s: dict, block: int) -> list[str]:
    title = {"interleaved": f"Interleaved (blocks of {block} steps, the same load for both)",
             "separate": "Separate runs (one whole run of each per round)"}[mode]
    lines = [f"### {title}", "",
             "| method | wall ms/step | median step ms | CPU ms/step (both ranks) | own overhead ms/step, rank 0 / 1 |",
             "|---|---|---|---|---|"]
    for method, label in (("loop", "plain loop"), ("trainer", "ActCompTrainer")):
        lines.append(f"| {label} | {ms(s[f'{method}_mean'])} | {ms(s[f'{method}_median'])} | "
                     f"{ms(s[f'{method}_cpu'])} | {ms(s[f'{method}_own0'])} / {ms(s[f'{method}_own1'])} |")
    share = s["extra_own_share"]
    lines += ["", f"**Trainer / loop, wall clock per step: {times(s['ratio'])}** (target <= {TARGET:.2f}x); median "
              f"step {times(s['median_step_ratio'])}; CPU time {times(s['cpu_ratio'])}. The Trainer's own overhead "
              f"exceeds the loop's by {ms(s['extra_own'])} ms per step on rank 0, {100 * share[0]:.1f}% "
              f"[{100 * share[1]:.1f}-{100 * share[2]:.1f}%] of the loop's step.", "",
              "| round | first | loop wall ms/step | Trainer wall ms/step | ratio | CPU ratio |",
              "|---|---|---|---|---|---|"]
    for k, r in sorted(s["rounds"].items(), key=lambda kv: int(kv[0])):
        first = ("loop" if int(k) % 2 == 0 else "Trainer") if mode == "separate" else \
            ("Trainer" if int(k) % 2 == 0 else "loop")
        lines.append(f"| {k} | {first} | {r['loop']['mean'] * 1e3:.1f} | {r['trainer']['mean'] * 1e3:.1f} | "
                     f"{r['trainer']['mean'] / r['loop']['mean']:.3f}x | "
                     f"{sum(r['trainer']['cpu']) / sum(r['loop']['cpu']):.3f}x |")
    if mode == "separate":
        lines += ["", "Per run, both ranks together: system CPU time and minor page faults per step, " + ", ".join(
                      f"{label} {ms(s[f'{m}_system'])} ms with {s[f'{m}_faults'][1]:.0f}-"
                      f"{s[f'{m}_faults'][2]:.0f} faults" for m, label in
                      (("loop", "loop"), ("trainer", "Trainer"))) + f"; garbage collection "
                  f"{s['loop_gc'][0] * 1e3:.2f} / {s['trainer_gc'][0] * 1e3:.2f} ms. Each method runs in its own process "
                  "state and minute here; in the interleaved rounds both share one process state and one machine "
                  "load, so those carry the headline figure."]
    return lines + [""]


def write(results: dict, meta: dict, name: str, before: dict | None = None) -> list[str]:
    """The results file; `before`: an earlier run's saved JSON (other code), shown beside this one."""
    a = meta["args"]
    lines = [
        "# ActCompTrainer against a plain loop over `Pipeline.train_step`", "",
        f"benchmarks/trainer_overhead.py: GPT-2 {a['layers']} layers, hidden {a['hidden']}, vocabulary "
        f"{meta['vocab']} (random init), {a['train_samples']} rows of {a['seq_len']} tokens of CPython's docs, batch "
        f"{a['batch_size']}, plan {meta['plan_text']}; fused AdamW (Trainer's default), linear schedule, clipping at "
        f"1.0; {a['steps']} steps per run, the steady state from step {a['warmup']} on "
        f"({a['steps'] - a['warmup']} steps); the Trainer logs every {a['logging_steps']} steps (with its comm/* "
        f"entries), progress bar {'off' if a['no_tqdm'] else 'on'}, no evaluation, no saving. 2 processes on "
        f"127.0.0.1 (gloo, 1 CPU thread each), {a['rounds']} rounds per mode in alternating order"
        + (f", each run (or round) started once the machine's CPUs were at most {100 * a['quiet']:.0f}% busy over "
           f"3 s, or after {a['quiet_wait']:.0f} s" if a.get("quiet") else "")
        + ". Milliseconds per optimizer step: median [range] over the rounds; ratios within each round. Wall: "
        "rank 0's clock between step ends, all steady-state steps (logging steps included); CPU: both ranks' "
        "process CPU time; own overhead: each rank's wall clock minus its time inside `train_step` and "
        "`clip_grad_norm_`.", "",
    ]
    for mode, s in results.items():
        lines += mode_lines(mode, s, a.get("block", 0))
    mode = next(iter(results))
    s, b = results[mode], (before or {}).get("summaries", {}).get(mode)
    lines += [
        f"### Where the own time goes ({mode})", "",
        "ms per step, median over the rounds, rank 0 / rank 1. data: fetching and collating a batch (the "
        "Trainer's with its `num_items_in_batch` count); logging: Trainer's `_maybe_log_save_evaluate` (loss "
        "gather, flops gather, the log) less what is timed inside it: comm_logs, ActCompTrainer's `comm/*` "
        "statistics gathered over the pipeline, and callbacks, every callback event (the progress bar included); "
        "flops: `floating_point_ops`; other: the rest of the own time (the loops' own code).", "",
        "| part | plain loop | ActCompTrainer |" + (" ActCompTrainer before |" if b else ""),
        "|---|---|---|" + ("---|" if b else ""),
    ]
    columns = [(s, "loop"), (s, "trainer")] + ([(b, "trainer")] if b else [])

    def cell(summary: dict, key: str) -> str:
        values = [summary.get(f"{key}{k}") for k in range(2)]
        return " / ".join(f"{v[0] * 1e3:.2f}" for v in values) if None not in values else ""

    for part in (*PARTS, "other", "own"):
        label = "**own overhead**" if part == "own" else part
        lines.append(f"| {label} | " + " | ".join(cell(summary, f"{m}_{part}") for summary, m in columns) + " |")
    if before:
        lines += ["", f"Before: {before['meta']['args']['name']}.md ({before['meta']['args'].get('note', '')}):"]
        for m, bs in before["summaries"].items():
            lines.append(f"- {m}: Trainer / loop {times(bs['ratio'])} wall clock per step; the Trainer's own "
                         f"overhead {ms(bs['extra_own'])} ms per step above the loop's "
                         f"({100 * bs['extra_own_share'][0]:.1f}% of its step).")
    lines += ["", (f"{a['note']}. " if a.get("note") else "") + f"Package measured: {meta['package']}. Machine: "
              f"{meta['machine']}. Load (/proc/loadavg, 1/5/15 min) before: {meta['loadavg_before']}; after: "
              f"{meta['loadavg_after']}. Other processes used {100 * meta['other_cpu_share']:.0f}% of the "
              f"{meta['cpus']} CPUs over the run (the machine's busy CPU time minus ours)."]
    write_markdown(RESULTS, name, lines)
    return lines


def load(name: str | None) -> dict | None:
    """A saved run, with its summaries computed by this version of the script."""
    if name is None:
        return None
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        saved = json.load(f)
    saved["summaries"] = summaries(saved)
    return saved


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rewrite:
        saved = load(args.name)
        write(saved["summaries"], saved["meta"], args.name, load(args.before))
        return
    with open(args.plan, encoding="utf-8") as f:
        plan = yaml.safe_load(f)
    spec = {"plan": plan, "steps": args.steps, "train_samples": args.train_samples, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "hidden": args.hidden, "layers": args.layers, "vocab": 1024, "seed": 0,
            "lr": 1e-3, "warmup_steps": 10, "max_grad_norm": 1.0, "logging_steps": args.logging_steps,
            "tqdm": not args.no_tqdm, "rounds": args.rounds, "modes": args.modes, "block": args.block,
            "profile": args.profile, "timeout": 300.0, "quiet": args.quiet, "quiet_wait": args.quiet_wait}
    before, busy = loadavg(), busy_cpu_seconds()[0]
    start, cpu_start = time.monotonic(), _children_cpu()
    out = run_workers(WORKER, 2, "loopback", ["--spec", json.dumps(spec)], None, free_port(), args.timeout)
    wall = time.monotonic() - start
    other = max(busy_cpu_seconds()[0] - busy - (_children_cpu() - cpu_start), 0.0) / (os.cpu_count() * wall)
    meta = {"args": vars(args), "vocab": spec["vocab"], "loadavg_before": before, "loadavg_after": loadavg(),
            "other_cpu_share": other, "wall_seconds": wall, "cpus": os.cpu_count(), "torch": torch.__version__,
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
            "plan_text": _plan_text(plan), "package": out["package"]}
    for name, text in out["profiles"].items():
        path = os.path.join(RESULTS, f"{args.name}_{name}.prof.txt")
        with open(path, "w") as f:
            f.write(text)
        print(f"profile of {name}: {path}")
    saved = {"meta": meta, "rows": compact(out["rows"])}
    results = summaries(saved)
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump({**saved, "summaries": results}, f)
    write(results, meta, args.name, load(args.before))


def compact(rows: list[dict]) -> list[dict]:
    """The marks with clocks counted from each run's first mark, to 10 microseconds (every
    figure is a difference of marks)."""
    def rounded(values: list[float], origin: float = 0.0) -> list[float]:
        return [round(v - origin, 5) for v in values]

    for row in rows:
        for r in row["ranks"]:
            r["wall"], r["cpu"] = rounded(r["wall"], r["wall"][0]), rounded(r["cpu"], r["cpu"][0])
            for group in ("parts", "process"):
                r[group] = {name: rounded(values) for name, values in r.get(group, {}).items()}
    return rows


def _children_cpu() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


def _plan_text(plan: dict) -> str:
    f, b = plan["forward"], plan["backward"]
    return (f"{plan['num_stages']} stages, {plan.get('micro_batches', 1)} micro-batches, {plan.get('schedule')}, "
            f"forward {f['method']} {f.get('bits', '')} bits, backward {b['method']} {b.get('bits', '')} bits")


if __name__ == "__main__":
    main()
