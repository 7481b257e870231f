"""Data-parallel gradient hooks side by side: bytes, hook time, step time and loss.

For 2 and 4 workers: (1) on loopback, every hook trains the same small GPT-2 (2 layers x 256,
vocabulary 1024) from the same initialisation for `--loss_steps` steps on disjoint shards of the
offline corpus, and reports the eval loss with its step time and bytes; (2) on a star network of
network namespaces whose links `tc` shapes to `--rate` Mbit/s, every hook runs `--steps` timed
steps. Plain all-reduce and torch's PowerSGD are the baselines, measured in the same runs.
Needs root (namespaces, tc); everything created is named after the pid and removed at the end.

    sudo .venv/bin/python benchmarks/dp_hooks.py                 # 2 and 4 workers, 100 Mbit/s

Writes benchmarks/results/dp_hooks.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from launch import run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKER = os.path.join(ROOT, "benchmarks", "dp_hooks_worker.py")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


class StarNetwork:
    """`n` worker namespaces, each joined by a shaped veth to a bridge in a hub namespace."""

    def __init__(self, n: int, mbit: int) -> None:
        tag = os.getpid() % 10000
        self.n, self.mbit = n, mbit
        self.hub = f"acH{tag}"
        self.ns = [f"acW{tag}x{i}" for i in range(n)]
        self.dev = [f"vw{tag}x{i}" for i in range(n)]
        subnet = 10 + tag % 200
        self.addr = [f"10.232.{subnet}.{i + 1}" for i in range(n)]

    def __enter__(self) -> StarNetwork:
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, (ns, dev, addr) in enumerate(zip(self.ns, self.dev, self.addr, strict=True)):
            hub_end = f"vh{i}x{os.getpid() % 10000}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", dev, "type", "veth", "peer", "name", hub_end)
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "link", "set", hub_end, "netns", self.hub)
            sh("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", hub_end, "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.mbit}mbit",
               "burst", "64kb", "latency", "50ms")
        return self

    def __exit__(self, *exc) -> None:
        for ns in [*self.ns, self.hub]:
            subprocess.run(["ip", "netns", "del", ns], check=False)


def write(rows: list[dict], args) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "dp_hooks.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    lines = [f"GPT-2 style, 2 layers x 256, vocabulary 1024 ({rows[0]['parameters'] / 1e6:.1f} M parameters); "
             f"batch {args.batch_size} x {args.seq_len} tokens per worker; SGD lr {args.lr} (momentum 0.9; DGC: its "
             f"own momentum); 1 CPU thread per worker. Eval loss after {args.loss_steps} steps on loopback; step "
             f"times: mean of {args.steps} steps. Bytes: what each worker sends per step (ring formulas).", ""]
    for workers in args.workers:
        lines += [f"### {workers} workers", "",
                  "| hook | byte ratio | MB/step/worker | hook ms/step | step ms, loopback | step ms, "
                  f"{args.rate} Mbit/s | speed-up vs all-reduce, {args.rate} Mbit/s | eval loss |",
                  "|---|---|---|---|---|---|---|---|"]
        loss = {r["label"]: r for r in rows if r["workers"] == workers and r["link"] == "loss"}
        slow = {r["label"]: r for r in rows if r["workers"] == workers and r["link"] != "loss"}
        base = slow["all-reduce (no compression)"]["seconds_per_step"]
        for label, r in loss.items():
            s = slow[label]
            lines.append(f"| {label} | {r['byte_ratio']:.0f}x | {r['bytes_per_step'] / 1e6:.3f} | "
                         f"{1e3 * r['hook_seconds_per_step']:.1f} | {1e3 * r['seconds_per_step']:.0f} | "
                         f"{1e3 * s['seconds_per_step']:.0f} | {base / s['seconds_per_step']:.2f}x | {r['eval_loss']:.3f} |")
        lines.append("")
    with open(os.path.join(RESULTS, "dp_hooks.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rate", type=int, default=100)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--loss_steps", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    common = [f"--batch_size={args.batch_size}", f"--seq_len={args.seq_len}", f"--lr={args.lr}"]
    rows = []
    port = 29700 + os.getpid() % 1000
    for i, workers in enumerate(args.workers):
        rows += run_workers(WORKER, workers, "loss", [*common, f"--loss_steps={args.loss_steps}"], None,
                            port + 2 * i, args.timeout)
        with StarNetwork(workers, args.rate) as net:
            rows += run_workers(WORKER, workers, f"{args.rate} Mbit/s", [*common, f"--steps={args.steps}"], net,
                                port + 2 * i + 1, args.timeout)
    write(rows, args)


if __name__ == "__main__":
    main()
