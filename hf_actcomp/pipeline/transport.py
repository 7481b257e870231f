"""Point-to-point transport of payloads between pipeline stages, with a deadline on every wait.

Sends are queued (`isend`) and waited for at the end of the step, so no stage blocks on a send.
Receives block until the payload arrives, and fail after the process group's timeout with an
error that names the peer: a dead or hung rank never makes the others wait forever. The time
spent waiting is counted, so `stats()` can split a step into compute and communication.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class PeerTimeoutError(RuntimeError):
    """A peer stage did not deliver (or accept) a message in time: it is dead, hung or too slow."""


class Transport:
    """Sends and receives flat uint8 payloads over `group` (global ranks), timing every wait."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, timeout: float) -> None:
        self.group = group
        self.rank = rank
        self.timeout = timeout
        self.pending: list[tuple[dist.Work, torch.Tensor, int]] = []
        self.seconds_waiting = 0.0

    def send(self, payload: torch.Tensor, dst: int) -> None:
        """Queue `payload` (contiguous) for `dst`; it must stay alive until `flush()`."""
        payload = payload.contiguous()
        work = dist.isend(payload, dst=dst, group=self.group)
        self.pending.append((work, payload, dst))

    def recv(self, nbytes: int, src: int, device: torch.device, what: str) -> torch.Tensor:
        """Block until `nbytes` arrive from `src`."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        start = time.perf_counter()
        try:
            dist.irecv(buffer, src=src, group=self.group).wait()
        except RuntimeError as err:
            raise self._error(f"receiving {what} ({nbytes} bytes)", src, err) from err
        finally:
            self.seconds_waiting += time.perf_counter() - start
        return buffer

    def flush(self) -> None:
        """Wait until every queued send has been taken by its receiver."""
        start = time.perf_counter()
        try:
            for work, _, dst in self.pending:
                try:
                    work.wait()
                except RuntimeError as err:
                    raise self._error("sending", dst, err) from err
        finally:
            self.pending.clear()
            self.seconds_waiting += time.perf_counter() - start

    def _error(self, doing: str, peer: int, err: Exception) -> PeerTimeoutError:
        return PeerTimeoutError(
            f"Rank {self.rank} failed {doing} with rank {peer} (timeout {self.timeout:g}s): the peer is "
            f"dead, hung or slower than the timeout. Raise `timeout=` in hf_actcomp.prepare() if it is "
            f"only slow. Cause: {err}"
        )
