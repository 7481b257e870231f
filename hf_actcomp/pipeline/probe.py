"""What `Plan.auto` measures over the real process group, and how every rank agrees on it.

- Links: for each boundary and direction, the sending rank times round trips of a small message
  and transfers of a probe payload (half a micro-batch's uncompressed payload, at least 64 KiB,
  at most 4 MiB: large enough to get past a shaper's burst, small enough to cost little on a slow
  link), each answered by an 8-byte reply, through the pipeline's own transport (its own message
  tag; bytes counted under `probe`). The round trip is the median small exchange; the bandwidth
  is the probe payload over the median transfer less one round trip. Where that difference is
  under a tenth of the transfer (a fast link: the payload crossed within a round trip's noise),
  the bandwidth is known only to be at least the payload over a tenth of the transfer, and is
  reported as that lower bound (`Link.at_least`).
- Decision: every rank's measurements go to global rank 0 (an all-gather of a few numbers), which
  runs `hf_actcomp.plan.codec_choice.choose` and broadcasts the decision as JSON; every rank applies that.

`HF_ACTCOMP_AUTO_FAKE_LINKS` (a test hook, read on rank 0 only) replaces measured values before
the choice, e.g. `{"1": {"forward": {"bandwidth_mbit_s": 10}}}` to act as if boundary 1's
activations crossed a 10 Mbit/s link (`rtt_ms` too), and `{"compute_ms": 10}` every stage's
compute per micro-batch.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..plan import AutoConfig
from ..plan.codec_choice import Link, Measurements, choose
from ..telemetry import TrafficCounter
from .mesh import PipelineMesh
from .transport import Transport

PROBE_TAG = 4  # the transport's slot for probe messages (0 tie, 1 forward, 2 backward, 3 token ids)
FAKE_LINKS_ENV = "HF_ACTCOMP_AUTO_FAKE_LINKS"
REPLY_BYTES = 8
PROBE_BYTES = (64 * 1024, 4 * 1024 * 1024)  # the probe payload's bounds (half a micro-batch's in between)


def probe_nbytes(payload_nbytes: int) -> int:
    """The size of a bandwidth probe for a micro-batch payload of `payload_nbytes`."""
    low, high = PROBE_BYTES
    return min(payload_nbytes, max(low, min(high, payload_nbytes // 2)))


def _exchange(transport: Transport, peer: int, send_bytes: int, device, counter: TrafficCounter, what: str) -> None:
    transport.send(torch.zeros(send_bytes, dtype=torch.uint8, device=device), peer, tag=PROBE_TAG)
    counter.add(send_bytes, send_bytes)
    transport.recv(REPLY_BYTES, peer, device, what, tag=PROBE_TAG)


def _answer(transport: Transport, peer: int, recv_bytes: int, device, counter: TrafficCounter, what: str) -> None:
    transport.recv(recv_bytes, peer, device, what, tag=PROBE_TAG)
    transport.send(torch.zeros(REPLY_BYTES, dtype=torch.uint8, device=device), peer, tag=PROBE_TAG)
    counter.add(REPLY_BYTES, REPLY_BYTES)


def timed_median(fn, repeats: int, warm_up=None) -> float:
    """The median of `repeats` timed calls, after one untimed call of `warm_up` (default `fn`:
    connection set-up, first-run allocations)."""
    (warm_up or fn)()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def link_from(nbytes: int, transfer: float, rtt: float) -> Link:
    """The link that carried `nbytes` in `transfer` seconds (reply included) with round trip `rtt`:
    a lower bound of its bandwidth when the bytes took under a tenth of the transfer (module docstring)."""
    floor = transfer / 10
    return Link(bandwidth=nbytes / max(transfer - rtt, floor), rtt=rtt, at_least=transfer - rtt < floor)


def measure_links(transport: Transport, mesh: PipelineMesh, device: torch.device, nbytes: int, repeats: int,
                  counter: TrafficCounter) -> dict[tuple[int, str], Link]:
    """The links this rank sends on, measured: {(boundary, direction): Link}. Collective over the
    pipeline: boundary 0 first, then 1, ... (a stage finishes its boundary before the next).
    `nbytes`: one micro-batch's uncompressed payload (the probe sends `probe_nbytes(nbytes)`)."""
    found = {}
    nbytes = probe_nbytes(nbytes)
    s = mesh.stage
    for b in (b for b in range(mesh.num_stages - 1) if s in (b, b + 1)):
        ends = {"forward": (mesh.ranks[b], mesh.ranks[b + 1]), "backward": (mesh.ranks[b + 1], mesh.ranks[b])}
        for direction, (src, dst) in ends.items():
            what = f"a probe of boundary {b} {direction}"
            if mesh.rank == src:
                def exchange(size: int, dst=dst, what=what) -> None:
                    _exchange(transport, dst, size, device, counter, what)

                rtt = timed_median(lambda: exchange(REPLY_BYTES), repeats)
                # the small exchanges set the pair up: no untimed probe payload
                whole = timed_median(lambda: exchange(nbytes), repeats, warm_up=lambda: None)
                found[(b, direction)] = link_from(nbytes, whole, rtt)
            else:
                for size in [REPLY_BYTES] * (repeats + 1) + [nbytes] * repeats:
                    _answer(transport, src, size, device, counter, what)
    transport.flush()
    return found


def agree(config: AutoConfig, mesh: PipelineMesh, compute: float, links: dict[tuple[int, str], Link],
          shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
          counter: TrafficCounter, micro_batches: int, tie_rows: int | None = None) -> dict:
    """Every rank's measurements to global rank 0, which decides (`auto.choose`; `tie_rows`, known
    there, when the tie's codec is to be chosen too) and broadcasts the decision; returns it on
    every rank. Collective over the whole job. With replicas, each stage's slowest compute and each
    link's slowest measurement count."""
    world = dist.get_world_size()
    mine = [float(mesh.stage), compute]
    for key in ((mesh.stage, "forward"), (mesh.stage - 1, "backward")):
        link = links.get(key)
        mine += [link.bandwidth, link.rtt, float(link.at_least)] if link is not None else [-1.0, -1.0, 0.0]
    local = torch.tensor(mine, dtype=torch.float64, device=device)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    counter.add((world - 1) * local.numel() * 8, (world - 1) * local.numel() * 8)  # as a ring all-gather sends
    if dist.get_rank() == 0:
        rows = [p.tolist() for p in parts]
        payload = json.dumps(decide(config, mesh.num_stages, rows, shape, dtype, micro_batches, tie_rows)).encode()
        length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    else:
        length = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(length, src=0)
    data = (torch.tensor(list(payload), dtype=torch.uint8, device=device) if dist.get_rank() == 0
            else torch.empty(int(length), dtype=torch.uint8, device=device))
    dist.broadcast(data, src=0)
    if dist.get_rank() == 0:
        counter.add((world - 1) * (8 + data.numel()), (world - 1) * (8 + data.numel()))  # as a flat broadcast
    return json.loads(bytes(data.cpu().tolist()).decode())


def decide(config: AutoConfig, num_stages: int, rows: list[list[float]], shape, dtype: torch.dtype,
           micro_batches: int, tie_rows: int | None = None) -> dict:
    """Rank 0: the gathered rows (stage, compute, then bandwidth, round trip and lower-bound flag
    of the forward link of its boundary and of the backward link of the one before) as
    `Measurements`, the fake-link hook applied, then `choose`."""
    compute = [0.0] * num_stages
    links: list[dict[str, Link]] = [{} for _ in range(num_stages - 1)]
    for stage, seconds, *ends in rows:
        s = int(stage)
        compute[s] = max(compute[s], seconds)
        for b, direction, (bandwidth, rtt, at_least) in ((s, "forward", ends[:3]), (s - 1, "backward", ends[3:])):
            if bandwidth < 0:
                continue
            old = links[b].get(direction)
            if old is None or bandwidth < old.bandwidth:
                links[b][direction] = Link(bandwidth=bandwidth, rtt=max(rtt, old.rtt if old else 0.0),
                                           at_least=bool(at_least))
    faked = _fake(links, compute)
    measured = Measurements(compute=compute, links=links, payload_shape=tuple(shape), micro_batches=micro_batches,
                            dtype=dtype, tie_rows=tie_rows, extra={"faked": faked} if faked else {})
    return choose(measured, config)


def _fake(links: list[dict[str, Link]], compute: list[float]) -> dict:
    """Apply `HF_ACTCOMP_AUTO_FAKE_LINKS` (test hook) in place; returns what it replaced."""
    text = os.environ.get(FAKE_LINKS_ENV)
    if not text:
        return {}
    fakes = json.loads(text)
    if "compute_ms" in fakes:
        compute[:] = [float(fakes["compute_ms"]) / 1e3] * len(compute)
    for b, directions in fakes.items():
        if b == "compute_ms":
            continue
        for direction, values in directions.items():
            link = links[int(b)][direction]
            if "bandwidth_mbit_s" in values:
                link.bandwidth, link.at_least = float(values["bandwidth_mbit_s"]) * 1e6 / 8, False
            if "rtt_ms" in values:
                link.rtt = float(values["rtt_ms"]) / 1e3
    return fakes
