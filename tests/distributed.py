"""Launch worker scripts as a gloo job on 127.0.0.1: a free port, OMP_NUM_THREADS=1, one overall
deadline, every rank's output drained while it runs, and only our own processes killed when
something hangs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
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
    returncode: int | None  # None: still running at the deadline (killed)
    stdout: str
    stderr: str


def _report(results: list[WorkerResult], headline: str) -> str:
    """Every rank's status and the tail of its stderr: the crashed rank's error shows even when
    another rank hung waiting for it."""
    parts = [headline]
    for r in results:
        status = "hung (killed at the deadline)" if r.returncode is None else f"exit code {r.returncode}"
        parts.append(f"--- rank {r.rank}: {status}\n{r.stderr[-3000:]}")
    return "\n".join(parts)


def run_workers(script: str, world_size: int, args: list[str], timeout: float = 240,
                check: bool = True) -> list[WorkerResult]:
    """Run `tests/workers/<script>` in `world_size` processes with torch.distributed env vars.

    `timeout` bounds the whole job (not each rank in turn). Output goes to temporary files, so a
    chatty rank can never block on a full pipe. With `check`, any rank that failed or hung fails
    the test with every rank's stderr.
    """
    port = free_port()
    procs, files, killed = [], [], set()
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="hf_actcomp_workers_") as logs:
        try:
            for rank in range(world_size):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                           HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
                out = open(os.path.join(logs, f"rank{rank}.out"), "w+")  # noqa: SIM115 - closed below
                err = open(os.path.join(logs, f"rank{rank}.err"), "w+")  # noqa: SIM115
                files.append((out, err))
                procs.append(subprocess.Popen([sys.executable, os.path.join(WORKERS, script), *args], env=env,
                                              stdout=out, stderr=err, text=True))
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            for rank, proc in enumerate(procs):
                if proc.poll() is None:
                    proc.kill()  # only the processes this call started
                    proc.wait()
                    killed.add(rank)
        results = []
        for rank, ((out, err), proc) in enumerate(zip(files, procs, strict=True)):
            out.seek(0)
            err.seek(0)
            results.append(WorkerResult(rank, None if rank in killed else proc.returncode, out.read(), err.read()))
            out.close()
            err.close()
    if check:
        if any(r.returncode is None for r in results):
            raise AssertionError(_report(results, f"{script} {args}: did not finish within {timeout:g}s"))
        failed = [r.rank for r in results if r.returncode != 0]
        if failed:
            raise AssertionError(_report(results, f"{script} {args}: rank(s) {failed} failed"))
    return results
