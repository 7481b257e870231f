"""What the multi-process benchmarks (slow_link.py, dp_hooks.py and their workers) share:
starting one worker per rank (optionally each in its own network namespace), the order of the
repeated rounds, the machine's busy CPU time, and the median and spread of the rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def run_workers(worker: str, workers: int, link: str, worker_args: list[str], net, port: int, timeout: float):
    """Run `worker` on `workers` gloo ranks. `net` (or None for loopback) has per-rank lists
    `ns`, `dev` and `addr`; rank 0's address is the rendezvous. Our processes are killed on error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        procs = []
        for rank in range(workers):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(workers), OMP_NUM_THREADS="1",
                       MASTER_ADDR=net.addr[0] if net else "127.0.0.1", MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME=net.dev[rank] if net else "lo")
            cmd = [sys.executable, worker, "--out", out, "--link", link, *worker_args]
            if net:
                cmd = ["ip", "netns", "exec", net.ns[rank], *cmd]
            procs.append(subprocess.Popen(cmd, env=env))
        try:
            for proc in procs:
                if proc.wait(timeout=timeout) != 0:
                    raise RuntimeError(f"a worker failed ({workers} workers, {link})")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        with open(out) as f:
            return json.load(f)


def round_order(n: int, k: int, repeats: int) -> list[int]:
    """The order of `n` methods in round `k` of `repeats`: starting at method k*n/repeats,
    backwards on odd rounds, so no method always runs first or after the same neighbour."""
    start = k * n // repeats
    order = [(start + i) % n for i in range(n)]
    return order[::-1] if k % 2 else order


def busy_cpu_seconds() -> tuple[float, float]:
    """CPU seconds the whole machine has spent busy, and stolen by the hypervisor (/proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, steal / hz


def other_cpu_share(busy: float, own: list[float], wall: float) -> float:
    """Share of the machine's CPUs that other processes used over `wall` seconds: the machine's
    busy CPU seconds minus our ranks' own."""
    return max(busy - sum(own), 0.0) / (os.cpu_count() * wall)


def wait_until_quiet(limit: float, period: float = 3.0, longest: float = 600.0) -> None:
    """Sleep until the machine's CPUs were busy at most `limit` over `period` seconds (our own
    ranks are idle meanwhile), or `longest` seconds have passed."""
    deadline = time.monotonic() + longest
    while time.monotonic() < deadline:
        busy, _ = busy_cpu_seconds()
        time.sleep(period)
        if (busy_cpu_seconds()[0] - busy) / (os.cpu_count() * period) <= limit:
            return


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def ratio_spread(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """median(numerator) / median(denominator), and its range over the rounds: the smallest
    numerator over the largest denominator, and the reverse."""
    return (median(numerator) / median(denominator), min(numerator) / max(denominator),
            max(numerator) / min(denominator))


def write_markdown(results_dir: str, name: str, lines: list[str]) -> None:
    """`{results_dir}/{name}.md` from `lines`, and the same text on stdout."""
    text = "\n".join(lines) + "\n"
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)
