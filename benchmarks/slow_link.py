"""Two pipeline stages joined by a slow link: tokens/s of torch.distributed.pipelining vs hf-actcomp.

Each stage runs in its own network namespace; a veth pair joins them and `tc tbf` shapes both
ends to the given rate (plus one unshaped run on 127.0.0.1). For every link, ONE pair of
processes runs every method back to back (benchmarks/slow_link_worker.py), so the ratios compare
runs made on the same link in the same minute. Needs root (namespaces, tc); everything the run
creates is named after its pid and removed at the end.

    sudo .venv/bin/python benchmarks/slow_link.py                    # 50, 100, 500 Mbit/s + loopback
    sudo .venv/bin/python benchmarks/slow_link.py --rates 100 --steps 3

Writes benchmarks/results/slow_link.{json,md}. "Allowed" speed-up: the best a method could do
given its byte ratio and its own compute floor (its loopback step); see summarize().
"Waiting" is the share of the uncompressed step a stage spends blocked on its peer (the link,
and also pipeline bubbles, which is why it is 35% even on loopback).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from launch import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKER = os.path.join(ROOT, "benchmarks", "slow_link_worker.py")
PEER = "torch.distributed.pipelining"
BASE = "ours, uncompressed"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


class LinkedNamespaces:
    """Two namespaces joined by a veth pair with addresses 10.231.<x>.1 and .2 (ours only)."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.ns = (f"acA{tag}", f"acB{tag}")
        self.dev = (f"vA{tag}", f"vB{tag}")
        subnet = 10 + tag % 200
        self.addr = (f"10.231.{subnet}.1", f"10.231.{subnet}.2")

    def __enter__(self) -> LinkedNamespaces:
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, self.addr, strict=True):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def shape(self, mbit: int) -> None:
        for ns, dev in zip(self.ns, self.dev, strict=True):
            sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
               "burst", "64kb", "latency", "50ms")

    def __exit__(self, *exc) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], check=False)


def run_pair(link: str, worker_args: list[str], namespaces: LinkedNamespaces | None, port: int,
             timeout: float) -> list[dict]:
    return run_workers(WORKER, 2, link, worker_args, namespaces, port, timeout)["rows"]


def summarize(rows: list[dict]) -> list[dict]:
    """Speed-ups over the peer, and the share of the speed-up the byte ratio allows.

    Allowed speed-up of a method on a link, with perfect overlap of compute and communication:
    its step cannot take less than the uncompressed step's time divided by the byte ratio (the
    link carries 1/ratio of the bytes), nor less than the same method's step on unshaped
    loopback (its compute and encoding floor). So `allowed = T_base / max(T_base / ratio,
    T_loopback(method))`, and the share is achieved / allowed speed-up over ours-uncompressed.
    """
    by_link: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_link.setdefault(r["link"], {})[r["method"]] = r
    loopback = by_link.get("loopback", {})
    for methods in by_link.values():
        peer, base = methods[PEER], methods[BASE]
        t_base = base["seconds_per_step"]
        t_loop_base = loopback[BASE]["seconds_per_step"] if BASE in loopback else 0.0
        for name, r in methods.items():
            r["speedup_vs_peer"] = peer["seconds_per_step"] / r["seconds_per_step"]
            r["speedup_vs_uncompressed"] = t_base / r["seconds_per_step"]
            floor = loopback[name]["seconds_per_step"] if name in loopback else 0.0
            r["allowed_speedup"] = max(t_base / max(t_base / r["byte_ratio"], floor), 1.0)
            r["share_of_allowed"] = (r["speedup_vs_uncompressed"] / r["allowed_speedup"]
                                     if r["allowed_speedup"] > 1.01 else None)
            r["link_fraction"] = max(t_base - t_loop_base, 0.0) / t_base
            r["uncompressed_waiting_fraction"] = max(base["waiting_fraction"].values())
    return rows


def write(rows: list[dict], args) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "slow_link.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    lines = [
        f"GPT-2 style, {args.layers} layers x hidden {args.hidden}, vocab {args.vocab}; 2 stages in 2 network "
        f"namespaces; batch {args.batch_size} x {args.seq_len} tokens in {args.micro_batches} micro-batches, 1F1B; "
        f"1 CPU thread per stage; mean of {args.steps} steps after {args.warmup} warm-up steps "
        "(AQ-SGD's uncompressed first visits happen in the warm-up).",
        "",
        "| link | method | tokens/s | MB/step | byte ratio | speed-up vs peer | vs ours uncompressed | "
        "allowed by bytes | share of allowed | uncompressed step: waiting / added by the link |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = "" if r["share_of_allowed"] is None else f"{100 * r['share_of_allowed']:.0f}%"
        lines.append(
            f"| {r['link']} | {r['method']} | {r['tokens_per_s']:.0f} | {r['bytes_per_step'] / 1e6:.2f} | "
            f"{r['byte_ratio']:.1f}x | {r['speedup_vs_peer']:.2f}x | {r['speedup_vs_uncompressed']:.2f}x | "
            f"{r['allowed_speedup']:.2f}x | {share} | {100 * r['uncompressed_waiting_fraction']:.0f}% / "
            f"{100 * r['link_fraction']:.0f}% |")
    with open(os.path.join(RESULTS, "slow_link.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=int, nargs="*", default=[50, 100, 500], help="Mbit/s of the shaped links")
    p.add_argument("--no_loopback", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--micro_batches", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--summarize_only", action="store_true",
                   help="recompute the table from benchmarks/results/slow_link.json without running")
    args = p.parse_args(argv)
    if args.summarize_only:
        with open(os.path.join(RESULTS, "slow_link.json")) as f:
            saved = json.load(f)
        vars(args).update({k: v for k, v in saved["args"].items() if k != "summarize_only"})
        write(summarize(saved["rows"]), args)
        return
    worker_args = [f"--{k}={getattr(args, k)}" for k in
                   ("steps", "warmup", "batch_size", "micro_batches", "seq_len", "hidden", "layers", "vocab")]
    rows = []
    port = 29600 + os.getpid() % 1000
    if not args.no_loopback:
        rows += run_pair("loopback", worker_args, None, port, args.timeout)
    if args.rates:
        with LinkedNamespaces() as namespaces:
            for i, rate in enumerate(args.rates):
                namespaces.shape(rate)
                rows += run_pair(f"{rate} Mbit/s", worker_args, namespaces, port + 1 + i, args.timeout)
    write(summarize(rows), args)


if __name__ == "__main__":
    main()
