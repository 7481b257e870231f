"""A link that stalls for 20 s mid-run: how much slower the pipeline gets, and that nothing is lost.

Two pipeline stages (2 processes, 1 CPU thread each), each in its own network namespace, joined
by a veth pair shaped to 10 Mbit/s with `tc tbf` (tests/distributed.py `linked_namespaces`).
Both train a small tied GPT-2 (2 x 128, vocabulary 1024; AQ-SGD fw4/bw8, AdamW) for 40 steps
twice in the same processes, from the same seed over the same batches (tests/workers/
link_stall_worker.py, the worker tests/test_link_stall.py runs at a smaller scale); three
rounds of this, each in new processes on a new link, since what a stall costs beyond its length
varies (it is TCP's recovery, also sampled with `ss -tin`):

  (a) undisturbed;
  (b) after step 10 the parent shapes both veth ends to near zero (tbf 1 kbit/s, 2 KB burst)
      for 20 s, then back to 10 Mbit/s (tests/stall.py), with prepare(timeout=300).

  (d) as (a) then (b), with TCP's largest retransmission timeout capped at 1 s in both
      namespaces (sysctl net.ipv4.tcp_rto_max_ms, Linux 6.15 or later; `--rto_max_ms 0` skips it)
      and `--tcp_retries2` retransmissions before TCP gives up (15 by default, ~14 s at a 1 s cap:
      shorter than the stall, and a re-run on 2026-11-27 lost a connection to it):
      packets held in the link's queue through the stall come out with round trips as long as
      the stall, and TCP's timeout grows with them, which is most of what a stall costs beyond
      its length.

It records every step's time, checks that one step spans the whole stall (so the link really
stopped), and compares (b)'s per-step losses and final weights with (a)'s, bit for bit. Then
(c), new processes: the same stall with prepare(timeout=10), shorter than the stall; it records
the PeerTimeoutError each rank raised, when, and whether the processes ended by themselves.

    sudo .venv/bin/python benchmarks/link_stall.py                   # 40 steps, 20 s stall
    sudo .venv/bin/python benchmarks/link_stall.py --steps 12 --stall 8 --short_timeout 3 --repeats 1

Needs root (namespaces, tc). Writes benchmarks/results/link_stall.{json,md} (`--name` another).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

from harness import add_arguments, busy_cpu_seconds, other_cpu_share, write_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from distributed import linked_namespaces, run_workers  # noqa: E402
from stall import STALL_BURST, STALL_RATE, stall_on_marker  # noqa: E402

WORKER = "link_stall_worker.py"  # in tests/workers
TCP_AFTER = 10.0  # seconds after the restore that TCP is sampled
MODEL_ARGS = ("compression", "vocab", "hidden", "layers", "seq_len", "batch_size", "micro_batches", "num_batches")


def tcp_state(ns: str, dev: str) -> dict:
    """In namespace `ns`: the largest retransmission timeout (ms) among TCP connections with
    unacknowledged data, how many segments they have unacknowledged (ss -tin), and the bytes
    waiting in `dev`'s tbf queue (tc -s qdisc)."""
    ss = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tin"], capture_output=True, text=True, timeout=10).stdout
    pending = [dict(re.findall(r"\b(rto|unacked):(\d+)", line)) for line in ss.splitlines()]
    pending = [c for c in pending if "unacked" in c]
    tc = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True,
                        timeout=10).stdout
    backlog = re.search(r"backlog (\d+)b", tc)
    return dict(rto_ms=max((int(c["rto"]) for c in pending), default=None),
                unacked=sum(int(c["unacked"]) for c in pending), queued_bytes=int(backlog.group(1)) if backlog else None)


@contextlib.contextmanager
def sample_tcp(ends: list[tuple[str, str, str]], marker: str, stall, after: float = TCP_AFTER,
               period: float = 0.25) -> Iterator[list[dict]]:
    """`tcp_state` of both sides every `period` s, from the marker (the stall's start) until
    `after` s past the restore or the block's end: what the stall leaves behind in TCP. Starts
    only at the marker, so that the undisturbed run is not measured while sampling."""
    samples: list[dict] = []
    stop = threading.Event()

    def run() -> None:
        while not os.path.exists(marker):
            if stop.wait(0.01):
                return
        while not stop.is_set() and (stall.end is None or time.time() < stall.end + after):
            now = time.time()
            samples.extend(dict(t=now, rank=rank, **tcp_state(ns, dev)) for rank, (ns, _, dev) in enumerate(ends))
            stop.wait(period)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def tcp_summary(samples: list[dict], window: dict) -> dict:
    """From `sample_tcp`: per side, the bytes queued at the link at the stall's first sample,
    and the largest retransmission timeout while stalled and after the restore."""
    out = {}
    for rank in (0, 1):
        mine = [x for x in samples if x["rank"] == rank]
        during = [x for x in mine if x["t"] < window["end"]]
        after = [x for x in mine if x["t"] >= window["end"]]
        out[rank] = dict(
            queued_bytes_at_stall=during[0]["queued_bytes"] if during else None,
            max_rto_seconds_stalled=max((x["rto_ms"] / 1000 for x in during if x["rto_ms"]), default=None),
            max_rto_seconds_after=max((x["rto_ms"] / 1000 for x in after if x["rto_ms"]), default=None))
    return out


def launch(args, out: str, runs: list[str], timeout: float,
           rto_max_ms: int | None = None) -> tuple[list[dict], dict, list, float]:
    """One pair of workers on a fresh shaped link that stalls after `--stall_after` of the run
    `stalled` (with `rto_max_ms`: TCP's largest retransmission timeout, net.ipv4.tcp_rto_max_ms,
    set in both namespaces). Returns each rank's results, the stall's window, the workers' exit
    codes (None: killed at the deadline) and the share of the CPUs other processes used meanwhile."""
    worker_args = [out, "--runs", *runs, "--timeout", str(timeout), "--steps", str(args.steps),
                   "--stall_after", str(args.stall_after), *(f"--{k}={getattr(args, k)}" for k in MODEL_ARGS)]
    busy, own = busy_cpu_seconds()[0], resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    marker = os.path.join(out, "stall.marker")
    retries = args.tcp_retries2 if rto_max_ms is not None else None
    with linked_namespaces(args.mbit, rto_max_ms=rto_max_ms, tcp_retries2=retries) as ends, \
            stall_on_marker(ends, marker, args.stall, args.mbit) as stall, sample_tcp(ends, marker, stall) as samples:
        workers = run_workers(WORKER, 2, worker_args, timeout=args.deadline, check="plain" in runs, namespaces=ends)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = (after.ru_utime - own.ru_utime) + (after.ru_stime - own.ru_stime)
    ranks = []
    for rank in range(2):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    window = dict(start=stall.start, end=stall.end)
    window.update(tcp=tcp_summary(samples, window),
                  tcp_samples=[dict(x, t=x["t"] - stall.start) for x in samples])
    return ranks, window, [w.returncode for w in workers], other_cpu_share(busy_cpu_seconds()[0] - busy, [children], wall)


def step_row(label: str, run: dict, plain: dict | None, window: dict, rank: int) -> dict:
    """A run's row from `rank`'s view: steps, their times, the steps overlapping the stall, the
    one spanning it, and (against `plain`) its weights and losses."""
    steps = run["steps"]
    seconds = [end - start for start, end in steps]
    during = [i for i, (start, end) in enumerate(steps) if window["start"] and start < window["end"]
              and end > window["start"]]
    spanning = [i for i, (start, end) in enumerate(steps) if window["start"] and start <= window["start"]
                and end >= window["end"]]
    row = dict(run=label, rank=rank, steps=len(steps), seconds_per_step=seconds,
               total_seconds=steps[-1][1] - steps[0][0] if steps else 0.0,
               slowest_step_seconds=max(seconds, default=None), steps_during_stall=during,
               step_spanning_stall=spanning[0] if spanning else None,
               spanning_seconds=seconds[spanning[0]] if spanning else None, losses=run["losses"],
               error=run.get("error"))
    if plain is not None and run["error"] is None:
        row.update(weights_equal=run["weights_equal"], weights_max_abs_diff=run["weights_max_abs_diff"],
                   losses_equal=run["losses"] == plain["losses"])
    if run.get("error"):
        row.update(error_step=run["error_step"], error_after_stall_seconds=run["error_at"] - window["start"])
    return row


def regime(plain: list[dict], args) -> dict:
    """Compute (the busier stage's seconds not waiting, per step) vs link (the busier direction's
    bytes at the link's rate, per step), from the undisturbed run."""
    compute = max((r["seconds_step"] - r["seconds_waiting"]) / args.steps for r in plain)
    link = max(r["bytes_sent"] for r in plain) / args.steps * 8 / (args.mbit * 1e6)
    return dict(compute_seconds_per_step=compute, link_seconds_per_step=link,
                bytes_per_step_per_rank=[r["bytes_sent"] / args.steps for r in plain],
                regime="link-bound" if link > compute else "compute-bound")


def _rto(seconds: float | None) -> str:
    return "- (nothing unacknowledged)" if seconds is None else f"{seconds:.2f} s"


def _f(value, fmt: str) -> str:
    return "" if value is None else f"{value:{fmt}}"


def write(result: dict, args) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    g = result["regime"]
    lines = [
        f"Tied GPT-2 ({args.layers} layers x hidden {args.hidden}, vocabulary {args.vocab}), 2 stages, 1F1B, "
        f"{args.micro_batches} micro-batches of batch {args.batch_size} x {args.seq_len} tokens, "
        f"{'AQ-SGD fw4/bw8' if args.compression == 'aqsgd' else 'uncompressed'}, AdamW, {args.steps} steps; "
        f"1 CPU thread per stage; each stage in its own network namespace, the veth pair shaped to {args.mbit:g} "
        f"Mbit/s (tc tbf, 16 KB burst). Stall: after step {args.stall_after} (from 0) of rank 0, the parent "
        f"shapes both ends to {STALL_RATE}/s ({STALL_BURST} burst) for {args.stall:g} s, then back. "
        f"Regime of the undisturbed run: {g['regime']} (per step: compute {g['compute_seconds_per_step']:.3f} s, "
        f"the busier direction's bytes at the link's rate {g['link_seconds_per_step']:.3f} s). Other processes "
        f"used at most {100 * result['other_cpu_share']:.0f}% of the CPUs meanwhile.",
        "",
        f"{args.repeats} rounds of (a) then (b) in the same processes, each round in new processes on a new link"
        + (f"; as many of (a) then (d), with net.ipv4.tcp_rto_max_ms={args.rto_max_ms} and tcp_retries2="
           f"{getattr(args, 'tcp_retries2', 15)} in both namespaces. "
           if args.rto_max_ms else ". ") +
        "Rank 0's view (rank 1's is in link_stall.json). Steps during the stall: those that overlap it (from 0); "
        "the spanning step started before the stall and ended after it, so it took at least the stall. Weights: "
        "each rank's final stage weights against the undisturbed run's; losses: every step's, exactly equal.",
        "",
        "| run | steps | total s | slowest step s | steps during the stall | spanning step s | "
        "final weights max abs diff vs undisturbed | losses equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if row["rank"] != 0:
            continue
        steps = f"{row['steps']}" + (f" (then PeerTimeoutError in step {row['error_step']})" if row["error"] else "")
        diff = row.get("weights_max_abs_diff")
        diff = "" if diff is None else f"{diff:g}" + (" (bit-equal)" if row["weights_equal"] else "")
        equal = row.get("losses_equal")
        lines.append(f"| {row['run']} | {steps} | {row['total_seconds']:.1f} | {_f(row['slowest_step_seconds'], '.2f')} "
                     f"| {', '.join(map(str, row['steps_during_stall'])) or '-'} | "
                     f"{_f(row['spanning_seconds'], '.2f')} | {diff} | {'' if equal is None else 'yes' if equal else 'NO'} |")
    k = args.stall_after
    around = range(max(k - 1, 0), min(k + 4, args.steps))
    lines += ["", "Seconds per step around the stall (rank 0):", "",
              "| run | " + " | ".join(f"step {i}" for i in around) + " |", "|---|" + "---|" * len(around)]
    for row in result["rows"]:
        if row["rank"] == 0 and not row["error"]:
            lines.append(f"| {row['run']} | " + " | ".join(f"{row['seconds_per_step'][i]:.2f}" for i in around) + " |")
    lines += ["", "(b) and (d) beyond the stall. What TCP showed on each side (`ss -tin` and `tc -s qdisc` in each namespace "
              "every 0.25 s from the stall's start, over the connections with unacknowledged data):", ""]
    for window in result["stall_windows"]:
        stalled = next(r for r in result["rows"] if r["rank"] == 0 and r["run"] == window["run"])
        lines.append(f"- {window['run']}: the spanning step took {stalled['spanning_seconds'] - args.stall:.1f} s more "
                     "than the stall.")
        for rank, t in sorted(window["tcp"].items()):
            lines.append(f"  rank {rank}'s side: {_f(t['queued_bytes_at_stall'], 'd')} bytes queued in its tbf when "
                         f"the stall began; largest retransmission timeout while stalled {_rto(t['max_rto_seconds_stalled'])}, "
                         f"in the {TCP_AFTER:g} s after the restore {_rto(t['max_rto_seconds_after'])}.")
    lines += ["", f"(c), timeout {args.short_timeout:g} s < stall {args.stall:g} s: the processes "
              + ("ended by themselves" if result["short_timeout_ended_by_themselves"] else "HUNG (killed at the deadline)")
              + f", exit codes {result['short_timeout_exit_codes']}. Each rank's error, seconds after the stall began:", ""]
    for row in result["rows"]:
        if row["error"]:
            lines.append(f"- rank {row['rank']}, step {row['error_step']}, {row['error_after_stall_seconds']:.1f} s: "
                         f"`{row['error']}`")
    write_markdown(RESULTS, args.name, lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, steps=40, timeout=(300.0, "prepare(timeout=) of run (b)"), vocab=1024, hidden=128,
                  layers=2, seq_len=128, batch_size=8, micro_batches=4,
                  repeats=(3, "rounds of (a) and (b) (and (d)), each in new processes"))
    p.add_argument("--stall_after", type=int, default=10, help="the stall starts after this step (from 0)")
    p.add_argument("--stall", type=float, default=20.0, help="seconds the link stays near zero")
    p.add_argument("--short_timeout", type=float, default=10.0, help="prepare(timeout=) of run (c)")
    p.add_argument("--mbit", type=float, default=10.0)
    p.add_argument("--compression", default="aqsgd", choices=["aqsgd", "none"])
    p.add_argument("--num_batches", type=int, default=4, help="distinct batches, cycled (AQ-SGD's samples)")
    p.add_argument("--rto_max_ms", type=int, default=1000,
                   help="(d): the rounds again with net.ipv4.tcp_rto_max_ms set in both namespaces (0: none)")
    p.add_argument("--tcp_retries2", type=int, default=60,
                   help="net.ipv4.tcp_retries2 in both namespaces of (d), beside --rto_max_ms")
    p.add_argument("--deadline", type=float, default=900.0, help="seconds before the workers are killed")
    p.add_argument("--name", default="link_stall", help="results file name in benchmarks/results/")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the namespaces are removed
    rows, windows, plains, others = [], [], [], []
    for letter, cap in [("b", None)] + ([("d", args.rto_max_ms)] if args.rto_max_ms else []):
        capped = f", tcp_rto_max_ms={cap}" if cap else ""
        for n in range(1, args.repeats + 1):
            label = f"({letter}{n}) stall {args.stall:g} s, timeout {args.timeout:g} s{capped}"
            print(f"round {n}: undisturbed, then {label}: {args.steps} steps each", flush=True)
            with tempfile.TemporaryDirectory() as out:
                ranks, window, _, other = launch(args, out, ["plain", "stalled"], args.timeout, cap)
            for rank, r in enumerate(ranks):
                rows.append(step_row(f"(a{n}) undisturbed{capped}", r["plain"], None, window, rank))
                rows.append(step_row(label, r["stalled"], r["plain"], window, rank))
            windows.append(dict(window, run=label))
            plains.append([r["plain"] for r in ranks])
            others.append(other)
    print(f"(c) stalled {args.stall:g} s, timeout {args.short_timeout:g} s", flush=True)
    with tempfile.TemporaryDirectory() as out:
        short, short_window, codes, other = launch(args, out, ["stalled"], args.short_timeout)
    for rank, r in enumerate(short):
        rows.append(step_row(f"(c) stall {args.stall:g} s, timeout {args.short_timeout:g} s", r["stalled"], None,
                             short_window, rank))
    result = dict(args=vars(args), stall_windows=windows, short_stall_window=short_window, rows=rows,
                  regime=regime(plains[0], args), other_cpu_share=max(*others, other),
                  short_timeout_exit_codes=codes, short_timeout_ended_by_themselves=None not in codes)
    for row in rows:
        if row["run"].startswith(("(b", "(d")) and row["rank"] == 0 and (row["spanning_seconds"] or 0) < args.stall:
            print(f"WARNING: {row['run']}: no step of rank 0 spans the whole stall: the link may not have stalled")
    write(result, args)


if __name__ == "__main__":
    main()
