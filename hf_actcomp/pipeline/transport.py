"""Point-to-point transport of payloads between pipeline stages, with a deadline on every wait.

Two ways to post, chosen by the backend (`early`):

* **Early receives (gloo).** gloo puts a payload on the wire only once the receiver has posted
  the matching receive. `post_recv` posts it at once (the engine posts all of a step's receives
  at its start, their sizes being known without data), so a payload travels while this stage
  still computes, and every send is posted at once. Each kind of message has its own tag (gloo's
  slot): messages of one tag match in order, and kinds never wait for each other.
* **Paired (NCCL).** NCCL runs a pair's sends and receives in posting order on one stream, so a
  receive posted ahead of a send the peer waits for would deadlock. There each send is posted
  together with the receive that follows it in the schedule, in one
  `torch.distributed.batch_isend_irecv` (as torch's own 1F1B fuses "send forward" with "receive
  backward"), and `post_recv` only records the receive until it is needed. A send with no
  receive after it is posted at once.

Sends are waited for at the end of the step (`flush`).

Receives block the host until the payload has arrived, and fail after `timeout` with an error
that names the peer. On CUDA, `Work.wait()` only makes the current stream wait, so the host polls
`Work.is_completed()` against the deadline instead: the time spent waiting is then real, and a
hung peer raises `PeerTimeoutError` on GPU as on CPU.

gloo moves host memory: with CUDA stages on gloo (several processes sharing one GPU, or a link
NCCL cannot cross) payloads are staged through the host, a copy of the compressed bytes each way.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


class PeerTimeoutError(RuntimeError):
    """A peer stage did not deliver (or accept) a message in time: it is dead, hung or too slow."""


@dataclass(eq=False)
class PostedRecv:
    """A receive of one message: its buffer, and its work once posted."""

    buffer: torch.Tensor
    src: int
    tag: int
    what: str
    device: torch.device | None = None  # where the payload is wanted (the buffer may be on the host)
    work: dist.Work | None = None


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "gloo"


class Transport:
    """Sends and receives flat uint8 payloads over `group` (global ranks), timing every wait.

    Args:
        group: the pipeline's process group.
        rank: this process's global rank (for error messages).
        timeout: seconds any wait may take.
        poll: wait by polling `Work.is_completed()` (default: CUDA buffers, i.e. a CUDA `device` not on gloo).
        early: post receives when `post_recv` is called and sends at once (default: on gloo);
            otherwise pair each send with the next receive (NCCL).
        via_host: stage payloads through host memory (default: a CUDA `device` on gloo).
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, timeout: float,
                 device: torch.device | None = None, poll: bool | None = None, early: bool | None = None,
                 via_host: bool | None = None) -> None:
        self.group = group
        self.rank = rank
        self.timeout = timeout
        self.early = early if early is not None else _is_gloo(group)
        on_cuda = device is not None and device.type == "cuda"
        self.via_host = via_host if via_host is not None else (on_cuda and _is_gloo(group))
        # gloo's point-to-point works report completion only from wait(): poll CUDA buffers alone.
        self.poll = poll if poll is not None else (on_cuda and not self.via_host)
        self.outbox: list[tuple[torch.Tensor, int, int]] = []  # sends waiting for the next receive
        self.pending: list[tuple[dist.Work, torch.Tensor, int]] = []  # posted sends
        self.posted: list[PostedRecv] = []  # receives posted early, not yet taken
        self.seconds_waiting = 0.0

    def reset_stats(self) -> None:
        self.seconds_waiting = 0.0

    def send(self, payload: torch.Tensor, dst: int, *, tag: int = 0, with_next_recv: bool = False) -> None:
        """Queue `payload` for `dst`. With `with_next_recv` (and not `early`), it is posted
        together with this process's next receive (the schedule's next action receives);
        otherwise at once. An empty payload does not travel: its receiver knows it is empty
        (AQ-SGD's revisits that reuse the memory send nothing)."""
        if payload.numel() == 0:
            return
        self.outbox.append((payload.to("cpu") if self.via_host else payload.contiguous(), dst, tag))
        if self.early or not with_next_recv:
            self._post([])

    def post_recv(self, nbytes: int, src: int, device: torch.device, what: str, *, tag: int = 0) -> PostedRecv:
        """A receive of `nbytes` from `src`, posted now when `early` (else when taken); take its
        payload with `wait_recv`. Receives of one tag from one peer match its sends in order; a
        receive of 0 bytes is complete at once (`send` sends no empty payload)."""
        where = torch.device("cpu") if self.via_host else device
        posted = PostedRecv(torch.empty(nbytes, dtype=torch.uint8, device=where), src, tag, what, device)
        if self.early and nbytes:
            try:
                posted.work = self._post([self._irecv(posted)])[-1]
            except RuntimeError as err:
                raise self._error(f"posting the receive of {what} ({nbytes} bytes)", src, err) from err
            self.posted.append(posted)
        return posted

    def wait_recv(self, posted: PostedRecv) -> torch.Tensor:
        """Block until `posted` has arrived (posting it first, with the queued sends, if it was
        not posted early); its payload, or `PeerTimeoutError` after `timeout` seconds."""
        if posted.buffer.numel() == 0:
            return posted.buffer.to(posted.device)
        start = time.perf_counter()
        try:
            if posted.work is None:
                posted.work = self._post([self._irecv(posted)])[-1]
            self._wait(posted.work, start)
        except (RuntimeError, TimeoutError) as err:
            raise self._error(f"receiving {posted.what} ({posted.buffer.numel()} bytes)", posted.src, err) from err
        finally:
            self.seconds_waiting += time.perf_counter() - start
            if posted in self.posted:
                self.posted.remove(posted)
        return posted.buffer.to(posted.device) if self.via_host else posted.buffer

    def recv(self, nbytes: int, src: int, device: torch.device, what: str, *, tag: int = 0) -> torch.Tensor:
        """Receive `nbytes` from `src` now (with the queued sends posted first); block until it arrives."""
        return self.wait_recv(self.post_recv(nbytes, src, device, what, tag=tag))

    def _irecv(self, posted: PostedRecv) -> dist.P2POp:
        return dist.P2POp(dist.irecv, posted.buffer, peer=posted.src, group=self.group, tag=posted.tag)

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
        if self.posted:
            left = ", ".join(p.what for p in self.posted)
            self.posted.clear()
            raise RuntimeError(f"Rank {self.rank} ended a step with receives posted but never taken: {left}.")

    def _post(self, recvs: list[dist.P2POp]) -> list[dist.Work]:
        """Post the outbox's sends and `recvs` in one batch; keep the sends' works for `flush`.
        Returns the works of the batch (the receive's is last)."""
        sends = [dist.P2POp(dist.isend, payload, peer=dst, group=self.group, tag=tag)
                 for payload, dst, tag in self.outbox]
        ops = sends + recvs
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # one work per op (gloo)
            pairs = zip(works[:len(sends)], self.outbox, strict=True)
        else:  # NCCL may coalesce the batch into one work: every send completes with it
            pairs = ((works[-1], sent) for sent in self.outbox)
        self.pending.extend((w, payload, dst) for w, (payload, dst, _) in pairs)
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
