"""Launch worker scripts as a gloo job on 127.0.0.1: a free port, OMP_NUM_THREADS=1, one overall
deadline, every rank's output drained while it runs, and only our own processes killed when
something hangs.

Every worker imports torch, transformers and hf_actcomp: 6-9 s of CPU per process on a 2-core
machine, most of a short multi-process test. So the workers fork from one interpreter that has
imported them already (multiprocessing's forkserver with those modules preloaded), each with the
environment, argv, `sys.path[0]` and stdout/stderr that `python tests/workers/SCRIPT` would
give it. A run inside network namespaces still starts a fresh Python under `ip netns exec`. The
recipes' tests (tests/scripts.py) always start fresh interpreters: they test the launchers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

TESTS = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(TESTS, "workers")
# What the workers import; a module that is not installed (trl) is skipped by the forkserver.
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "safetensors.torch", "transformers",
           "transformers.trainer", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
           "transformers.models.opt.modeling_opt", "hf_actcomp", "hf_actcomp.debug", "hf_actcomp.pipeline", "trl"]
# Read when those modules are imported, so the forkserver is started with them.
IMPORT_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
_FORKSERVER = multiprocessing.get_context("forkserver")
_warm: list[bool] = []


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


def _start_forkserver() -> None:
    """Start the forkserver once, with PRELOAD imported under IMPORT_ENV (this process's own
    environment is left as it was)."""
    _FORKSERVER.set_forkserver_preload(PRELOAD)
    saved = {key: os.environ.get(key) for key in IMPORT_ENV}
    os.environ.update(IMPORT_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
        if not _warm:  # the first fork waits for the imports: not inside any test's deadline
            warm_up = _FORKSERVER.Process(target=int)
            warm_up.start()
            warm_up.join()
            _warm.append(True)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def _run_script(path: str, argv: list[str], env: dict[str, str], out_path: str, err_path: str) -> None:
    """In a forked worker: what `python path *argv` with `env` would have, then the script as
    `__main__`. Its exit code is the process's (multiprocessing reports an exception as 1)."""
    os.environ.clear()
    os.environ.update(env)
    for fd, name in ((1, out_path), (2, err_path)):
        handle = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


class _ForkedWorker:
    """A worker forked from the forkserver, with `subprocess.Popen`'s poll / kill / wait /
    returncode (a signal's death as minus its number, as Popen reports it)."""

    def __init__(self, path: str, argv: list[str], env: dict[str, str], out_path: str, err_path: str) -> None:
        self.process = _FORKSERVER.Process(target=_run_script, args=(path, argv, env, out_path, err_path))
        self.process.start()
        self.pid = self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self) -> int | None:
        self.process.join()
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode


def run_workers(script: str, world_size: int, args: list[str], timeout: float = 240,
                check: bool = True, namespaces: list[tuple[str, str, str]] | None = None,
                env: dict[str, str] | None = None) -> list[WorkerResult]:
    """Run `tests/workers/<script>` in `world_size` processes with torch.distributed env vars.

    `timeout` bounds the whole job (not each rank in turn). Output goes to temporary files, so a
    chatty rank can never block on a full pipe. With `check`, any rank that failed or hung fails
    the test with every rank's stderr. `namespaces`: per rank (network namespace, its address,
    its interface), made by the test (`linked_namespaces`); rank 0's address is the rendezvous.
    `env`: variables added to every rank's environment.
    """
    port = free_port()
    if not namespaces:
        _start_forkserver()
    procs, files, killed = [], [], set()
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="hf_actcomp_workers_") as logs:
        try:
            for rank in range(world_size):
                rank_env = dict(os.environ, **(env or {}), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                           HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
                prefix = []
                if namespaces:
                    rank_env.update(MASTER_ADDR=namespaces[0][1], GLOO_SOCKET_IFNAME=namespaces[rank][2])
                    prefix = ["ip", "netns", "exec", namespaces[rank][0]]
                out = open(os.path.join(logs, f"rank{rank}.out"), "w+")  # noqa: SIM115 - closed below
                err = open(os.path.join(logs, f"rank{rank}.err"), "w+")  # noqa: SIM115
                files.append((out, err))
                path = os.path.join(WORKERS, script)
                if namespaces:
                    procs.append(subprocess.Popen([*prefix, sys.executable, path, *args], env=rank_env,
                                                  stdout=out, stderr=err, text=True))
                else:
                    procs.append(_ForkedWorker(path, list(args), rank_env, out.name, err.name))
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


RTO_MAX_SYSCTL = "/proc/sys/net/ipv4/tcp_rto_max_ms"  # where this kernel has it


def shape(ns: str, dev: str, rate: str, burst: str, latency: str = "100ms") -> None:
    """`tc tbf` on the egress of `dev` in namespace `ns`, replacing its qdisc (also to change
    the rate of a link while processes use it: tests/stall.py)."""
    subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                    "latency", latency], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def linked_namespaces(mbit: float, burst: str = "16kb",
                      rto_max_ms: int | None = None,
                      tcp_retries2: int | None = None) -> Iterator[list[tuple[str, str, str]]]:
    """Two network namespaces made for this test, joined by a veth pair whose ends are each
    shaped to `mbit` Mbit/s (tc tbf): yields [(namespace, address, interface)] for ranks 0 and 1,
    and removes both namespaces afterwards. Skips, saying why, where namespaces cannot be made
    (not root, or no iproute2). `rto_max_ms`: TCP's largest retransmission timeout in both
    namespaces (net.ipv4.tcp_rto_max_ms, Linux 6.15+; see RTO_MAX_SYSCTL). `tcp_retries2`: how
    many retransmissions TCP makes before it closes a connection (default 15: with a 1 s cap on
    the timeout that is ~14 s, shorter than a 20 s stall, so a lower cap needs more retries)."""
    import pytest

    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("a shaped link needs root and iproute2 (ip, tc) to make network namespaces")
    tag = f"{os.getpid() % 100000}"
    ends = [(f"hfacA{tag}", f"10.232.{os.getpid() % 250}.1", f"hvA{tag}"),
            (f"hfacB{tag}", f"10.232.{os.getpid() % 250}.2", f"hvB{tag}")]
    made = []

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    try:
        for ns, _, _ in ends:
            try:
                sh("ip", "netns", "add", ns)
            except subprocess.CalledProcessError as err:  # e.g. a container without the capability
                pytest.skip(f"cannot make a network namespace here: {err.stderr.strip()}")
            made.append(ns)
        sh("ip", "link", "add", ends[0][2], "type", "veth", "peer", "name", ends[1][2])
        for ns, addr, dev in ends:
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            shape(ns, dev, f"{mbit}mbit", burst)
            if rto_max_ms is not None:
                sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.tcp_rto_max_ms={rto_max_ms}")
            if tcp_retries2 is not None:
                sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.tcp_retries2={tcp_retries2}")
        yield ends
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
