"""Start one benchmark worker per rank (optionally each in its own network namespace) and
collect the JSON that rank 0 writes. Shared by slow_link.py and dp_hooks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


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
