"""Launch worker scripts as a gloo job on 127.0.0.1: a free port, OMP_NUM_THREADS=1, a timeout,
and only our own processes killed when something hangs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass

TESTS = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(TESTS, "workers")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def run_workers(script: str, world_size: int, args: list[str], timeout: float = 240,
                check: bool = True) -> list[WorkerResult]:
    """Run `tests/workers/<script>` in `world_size` processes with torch.distributed env vars."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        procs.append(subprocess.Popen([sys.executable, os.path.join(WORKERS, script), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            results.append(WorkerResult(rank, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if check:
        for r in results:
            assert r.returncode == 0, f"rank {r.rank} failed ({r.returncode}):\n{r.stderr[-4000:]}"
    return results
