"""Point-to-point transport of payloads between pipeline stages, with a deadline on every wait.

Each send is posted together with the receive that follows it in the schedule, in one
`torch.distributed.batch_isend_irecv` (as torch's own 1F1B fuses "send forward" with "receive
backward"): two neighbours whose messages cross then post matching pairs, which NCCL needs to
avoid a deadlock on large messages, and gloo accepts as well. A send with no receive after it is
posted at once. Sends are waited for at the end of the step.

Receives block the host until the payload has arrived, and fail after `timeout` with an error
that names the peer. On CUDA, `Work.wait()` only makes the current stream wait, so the host polls
`Work.is_completed()` against the deadline instead: the time spent waiting is then real, and a
hung peer raises `PeerTimeoutError` on GPU as on CPU.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist


class PeerTimeoutError(RuntimeError):
    """A peer stage did not deliver (or accept) a message in time: it is dead, hung or too slow."""


class Transport:
    """Sends and receives flat uint8 payloads over `group` (global ranks), timing every wait.

    Args:
        group: the pipeline's process group.
        rank: this process's global rank (for error messages).
        timeout: seconds any wait may take.
        poll: wait by polling `Work.is_completed()` (default: when `device` is CUDA).
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, timeout: float,
                 device: torch.device | None = None, poll: bool | None = None) -> None:
        self.group = group
        self.rank = rank
        self.timeout = timeout
        self.poll = poll if poll is not None else (device is not None and device.type == "cuda")
        self.outbox: list[tuple[torch.Tensor, int]] = []  # sends waiting for the next receive
        self.pending: list[tuple[dist.Work, torch.Tensor, int]] = []  # posted sends
        self.seconds_waiting = 0.0

    def send(self, payload: torch.Tensor, dst: int, *, with_next_recv: bool = False) -> None:
        """Queue `payload` for `dst`. With `with_next_recv`, it is posted together with this
        process's next `recv` (the schedule's next action receives); otherwise at once."""
        self.outbox.append((payload.contiguous(), dst))
        if not with_next_recv:
            self._post([])

    def recv(self, nbytes: int, src: int, device: torch.device, what: str) -> torch.Tensor:
        """Post the queued sends and a receive of `nbytes` from `src`; block until it arrives."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        start = time.perf_counter()
        try:
            works = self._post([dist.P2POp(dist.irecv, buffer, peer=src, group=self.group)])
            self._wait(works[-1], start)
        except (RuntimeError, TimeoutError) as err:
            raise self._error(f"receiving {what} ({nbytes} bytes)", src, err) from err
        finally:
            self.seconds_waiting += time.perf_counter() - start
        return buffer

    def flush(self) -> None:
        """Post what is queued and wait until every send has been taken by its receiver."""
        start = time.perf_counter()
        try:
            self._post([])
            for work, _, dst in self.pending:
                try:
                    self._wait(work, start)
                except (RuntimeError, TimeoutError) as err:
                    raise self._error("sending", dst, err) from err
        finally:
            self.pending.clear()
            self.outbox.clear()
            self.seconds_waiting += time.perf_counter() - start

    def _post(self, recvs: list[dist.P2POp]) -> list[dist.Work]:
        """Post the outbox's sends and `recvs` in one batch; keep the sends' works for `flush`.
        Returns the works of the batch (the receive's is last)."""
        sends = [dist.P2POp(dist.isend, payload, peer=dst, group=self.group) for payload, dst in self.outbox]
        ops = sends + recvs
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # one work per op (gloo)
            pairs = zip(works[:len(sends)], self.outbox, strict=True)
        else:  # NCCL may coalesce the batch into one work: every send completes with it
            pairs = ((works[-1], sent) for sent in self.outbox)
        self.pending.extend((w, payload, dst) for w, (payload, dst) in pairs)
        self.outbox.clear()
        return works

    def _wait(self, work: dist.Work, start: float) -> None:
        """Block until `work` completes, at most until `start + timeout`."""
        remaining = max(self.timeout - (time.perf_counter() - start), 0.001)
        if not self.poll:
            work.wait(timeout=datetime.timedelta(seconds=remaining))
            return
        while not work.is_completed():
            if time.perf_counter() - start > self.timeout:
                raise TimeoutError(f"no completion after {self.timeout:g}s")
            time.sleep(0.0002)
        work.wait()

    def _error(self, doing: str, peer: int, err: Exception) -> PeerTimeoutError:
        return PeerTimeoutError(
            f"Rank {self.rank} failed {doing} with rank {peer} (timeout {self.timeout:g}s): the peer is "
            f"dead, hung or slower than the timeout. Raise `timeout=` in hf_actcomp.prepare() if it is "
            f"only slow. Cause: {err}"
        )
