"""What the benchmarks share, so that each script keeps only what it measures: their common
arguments (`add_arguments`), starting one worker per rank (optionally each in its own network
namespace), the order of the repeated rounds, the machine's busy CPU time, the median and spread
of the rounds, the network namespaces and shaped links the link-bound runs use (a pair, a chain
of stages, a star of replicas; `tc tbf` on veth pairs, addresses in 10.231-10.255.x.x, ours only),
and writing a results file. The peer every benchmark compares with is peer.py's."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

# The arguments several benchmarks take: type (or action / nargs) and a generic help. A benchmark
# passes its own default, and its own help where the generic one does not say enough.
ARGUMENTS: dict[str, tuple[dict, str]] = {
    "batch_size": ({"type": int}, "sequences per optimizer step"),
    "calls": ({"type": int}, "calls per timed window"),
    "epochs": ({"type": int}, "training epochs"),
    "eval_blocks": ({"type": int}, "held-out blocks of the evaluation"),
    "eval_every": ({"type": int}, "optimizer steps between evaluations"),
    "eval_samples": ({"type": int}, "held-out samples of the evaluation"),
    "hidden": ({"type": int}, "hidden size of the model"),
    "large_steps": ({"type": int}, "measured steps of the real-vocabulary models"),
    "large_vocab": ({"type": int}, "vocabulary of the real-vocabulary models"),
    "layers": ({"type": int}, "decoder layers"),
    "layers_per_stage": ({"type": int}, "decoder layers per pipeline stage"),
    "loss_steps": ({"type": int}, "training steps of the loss comparison"),
    "lr": ({"type": float}, "learning rate"),
    "max_epochs": ({"type": int}, "epochs at most"),
    "max_other_cpu": ({"type": float}, "measure again when other processes used more than this share of the CPUs"),
    "merge": ({"action": "store_true"}, "add to the existing results file instead of replacing it"),
    "micro_batch_size": ({"type": int}, "sequences per micro-batch"),
    "micro_batches": ({"type": int}, "micro-batches per step"),
    "n_embd": ({"type": int}, "hidden size of the model"),
    "n_layer": ({"type": int}, "decoder layers"),
    "new_tokens": ({"type": int}, "tokens generated per call"),
    "no_loopback": ({"action": "store_true"}, "skip the loopback (unshaped) runs"),
    "only": ({"nargs": "*"}, "run only these settings"),
    "peer_steps": ({"type": int}, "steps the peer runs (its time to target projected from their pace)"),
    "pings": ({"type": int}, "ping-pongs that measure each link's round trip"),
    "pretrain_epochs": ({"type": int}, "epochs of pre-training"),
    "pretrain_lr": ({"type": float}, "learning rate of pre-training"),
    "quick": ({"action": "store_true"}, "a tiny run that checks the script works"),
    "quiet": ({"type": float}, "the share of the CPUs other processes may use while a round is measured"),
    "quiet_wait": ({"type": float}, "seconds at most to wait for a quiet machine before measuring again"),
    "rate": ({"type": int}, "Mbit/s of the shaped links"),
    "rates": ({"type": int, "nargs": "*"}, "Mbit/s of the shaped links"),
    "repeats": ({"type": int}, "rounds, in alternating order"),
    "replicas": ({"type": int}, "data-parallel replicas"),
    "replot": ({"action": "store_true"}, "only redraw the figure from the .json"),
    "retries": ({"type": int}, "measurements again at most when other processes used the CPUs"),
    "rewrite": ({"action": "store_true"}, "only rewrite the .md from the .json"),
    "rounds": ({"type": int}, "rounds, in alternating order"),
    "seed": ({"type": int}, "random seed"),
    "seeds": ({"type": int, "nargs": "+"}, "random seeds"),
    "seq_len": ({"type": int}, "tokens per sequence"),
    "stdlib_files": ({"type": int}, "CPython stdlib files the data is cut from"),
    "steps": ({"type": int}, "measured steps"),
    "summarize_only": ({"action": "store_true"}, "only summarize the saved rows again"),
    "timeout": ({"type": float}, "seconds per launch"),
    "train_samples": ({"type": int}, "training samples"),
    "vocab": ({"type": int}, "vocabulary size"),
    "warmup": ({"type": int}, "warm-up steps before the measured ones"),
}


def add_arguments(parser: argparse.ArgumentParser, *, required: tuple[str, ...] = (), **defaults) -> None:
    """Add `--NAME` for each keyword (its default; `(default, help)` for a help of its own) from
    ARGUMENTS, and each name in `required` as a required string (a worker's `--out`, `--link`)."""
    for name in required:
        parser.add_argument(f"--{name}", required=True)
    for name, value in defaults.items():
        if name not in ARGUMENTS:
            raise KeyError(f"--{name} is not one of harness.ARGUMENTS: add it there or to the script's parser.")
        spec, text = ARGUMENTS[name]
        default, text = value if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str) \
            else (value, text)
        if spec.get("action") == "store_true" and default is not False:
            raise ValueError(f"--{name} is a flag: its default is False, got {default!r}.")
        parser.add_argument(f"--{name}", **spec, **({} if "action" in spec else {"default": default}), help=text)


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


def loadavg() -> str:
    """The machine's load average over 1, 5 and 15 minutes, as /proc/loadavg gives it."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def write_markdown(results_dir: str, name: str, lines: list[str]) -> None:
    """`{results_dir}/{name}.md` from `lines`, and the same text on stdout."""
    text = "\n".join(lines) + "\n"
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def shape_device(ns: str, dev: str, mbit: int) -> None:
    """`tc tbf` on `dev`'s egress in namespace `ns`: `mbit` Mbit/s, 64 kB burst, 50 ms queue."""
    sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
       "burst", "64kb", "latency", "50ms")


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
            shape_device(ns, dev, mbit)

    def __exit__(self, *exc) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], check=False)


class NamespaceChain(LinkedNamespaces):
    """`n` namespaces in a line, one per pipeline stage: boundary b is a veth pair between
    namespaces b and b+1 (subnet 10.<240+b>.<x>.0/24, ends .1 and .2, ours only). Every namespace
    forwards IP and routes the subnets beyond its neighbours through them, so ranks that are not
    neighbours (the tie's first and last stage, gloo's collectives) reach each other across the
    boundaries between them. `ns`, `dev` and `addr` are per rank: its namespace, and the interface
    and address gloo uses (a rank's end of its forward boundary; the last rank's end of its
    backward one). `shape(mbit, boundaries)` shapes only the given boundaries: the others stay
    unshaped veth (about loopback's speed)."""

    def __init__(self, n: int) -> None:
        tag = os.getpid() % 100000
        subnet = 10 + tag % 200
        self.ns = tuple(f"acC{tag}s{i}" for i in range(n))
        # boundary b: (device in namespace b, device in namespace b + 1), (their addresses)
        self.pairs = [(f"c{tag}b{b}l", f"c{tag}b{b}r") for b in range(n - 1)]
        self.ends = [(f"10.{240 + b}.{subnet}.1", f"10.{240 + b}.{subnet}.2") for b in range(n - 1)]
        self.subnets = [f"10.{240 + b}.{subnet}.0/24" for b in range(n - 1)]
        self.dev = tuple(self.pairs[i][0] if i < n - 1 else self.pairs[-1][1] for i in range(n))
        self.addr = tuple(self.ends[i][0] if i < n - 1 else self.ends[-1][1] for i in range(n))

    def __enter__(self) -> NamespaceChain:
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        for b, (devs, addrs) in enumerate(zip(self.pairs, self.ends, strict=True)):
            sh("ip", "link", "add", devs[0], "type", "veth", "peer", "name", devs[1])
            for ns, dev, addr in zip(self.ns[b:b + 2], devs, addrs, strict=True):
                sh("ip", "link", "set", dev, "netns", ns)
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
        for i, ns in enumerate(self.ns):  # farther subnets through the neighbour on their side
            for b, subnet in enumerate(self.subnets):
                if b < i - 1:
                    sh("ip", "-n", ns, "route", "add", subnet, "via", self.ends[i - 1][0])
                elif b > i:
                    sh("ip", "-n", ns, "route", "add", subnet, "via", self.ends[i][1])
        return self

    def shape(self, mbit: int, boundaries: list[int] | None = None) -> None:
        for b in range(len(self.pairs)) if boundaries is None else boundaries:
            for ns, dev in zip(self.ns[b:b + 2], self.pairs[b], strict=True):
                shape_device(ns, dev, mbit)


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
            shape_device(ns, dev, self.mbit)
        return self

    def __exit__(self, *exc) -> None:
        for ns in [*self.ns, self.hub]:
            subprocess.run(["ip", "netns", "del", ns], check=False)


@contextlib.contextmanager
def namespaces(net):
    """`net` set up, and removed whatever happens (also when setting it up fails half way: its
    namespaces, and any of its veth devices left in the root namespace)."""
    try:
        yield net.__enter__()
    finally:
        net.__exit__(None, None, None)
        pairs = getattr(net, "pairs", None)
        devices = [d for pair in pairs for d in pair] if pairs else [d for d in net.dev if d != "lo"]
        for dev in devices:
            subprocess.run(["ip", "link", "del", dev], check=False, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)


def shaped_star(n: int, mbit: int):
    """A `StarNetwork` of `n` workers at `mbit` Mbit/s, removed whatever happens."""
    return namespaces(StarNetwork(n, mbit))


class LoopbackNamespace:
    """One namespace of our own holding every rank, talking over its loopback 127.0.0.1."""

    def __init__(self, n: int) -> None:
        name = f"acL{os.getpid() % 100000}"
        self.ns, self.dev, self.addr = (name,) * n, ("lo",) * n, ("127.0.0.1",) * n

    def __enter__(self) -> LoopbackNamespace:
        sh("ip", "netns", "add", self.ns[0])
        sh("ip", "-n", self.ns[0], "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "del", self.ns[0]], check=False)
