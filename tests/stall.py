"""Stall a shaped link from the parent process while the workers train on it.

A link that stops for a while (a congested uplink, a Wi-Fi hand-over) is not a dead peer: the
run should wait and go on. `stall_on_marker` waits in a thread until a worker writes its marker
file (tests/workers/link_stall_worker.py writes one after a chosen step), shapes both veth ends
of `linked_namespaces` to near zero for `seconds`, then back to `mbit`. Used by
tests/test_link_stall.py and benchmarks/link_stall.py.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from distributed import shape

# Near zero as tbf takes it: 125 bytes/s, so after the 2 KB burst one full-size packet every 12 s.
STALL_RATE, STALL_BURST = "1kbit", "2kb"


@dataclass
class Stall:
    """When the link was stalled (time.time(), as the workers stamp their steps): `start` once
    both ends were shaped to near zero, `end` when the restore began. None: it never stalled."""

    seconds: float
    start: float | None = None
    end: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _stall(stall: Stall, ends: list[tuple[str, str, str]], marker: str, mbit: float, burst: str) -> None:
    try:
        while not os.path.exists(marker):
            if stall.cancel.wait(0.005):
                return
        try:
            for ns, _, dev in ends:
                shape(ns, dev, STALL_RATE, STALL_BURST)
            stall.start = time.time()
            stall.cancel.wait(stall.seconds)  # cut short only when the workers ended meanwhile
            stall.end = time.time()
        finally:
            for ns, _, dev in ends:
                shape(ns, dev, f"{mbit}mbit", burst)
    except BaseException as err:  # reported by stall_on_marker
        stall.error = err


@contextlib.contextmanager
def stall_on_marker(ends: list[tuple[str, str, str]], marker: str, seconds: float, mbit: float,
                    burst: str = "16kb") -> Iterator[Stall]:
    """While the block runs: once `marker` exists, stall the link of `ends` (from
    `linked_namespaces`) for `seconds`, then shape it back to `mbit` Mbit/s with `burst`. On
    leaving, the stall is cut short if still on (the link is always restored), and a failure
    of `tc` is raised."""
    stall = Stall(seconds)
    thread = threading.Thread(target=_stall, args=(stall, ends, marker, mbit, burst), daemon=True)
    thread.start()
    try:
        yield stall
    finally:
        stall.cancel.set()
        thread.join()
    if stall.error is not None:
        raise RuntimeError("stalling the link failed") from stall.error
