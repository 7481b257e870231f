"""One fragment's pseudo-gradient averaged over the replicas: started at once, finished by `wait()`.

Split in two so that Streaming DiLoCo's `fragment_sync_delay` overlaps the transfer with the next
inner steps: torchft starts a fragment's sync (`_average_grads`) `fragment_sync_delay` steps
before it applies it, and calls `wait()` on the fragment's pending work first. gloo runs an
issued collective on its own threads, so the transfer proceeds meanwhile (on CPU too). Without a
delay both halves run back to back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

from .base import ring_allreduce_bytes
from .diloco import PseudoGradientCodec

# What a failed collective raises: gloo/NCCL errors (`torch.distributed.DistError` and the
# RuntimeErrors gloo raises for a closed connection), torchft's timeouts and quorum errors, socket
# errors. Only the collective's own calls are guarded by it.
COMMUNICATION_ERRORS = (RuntimeError, TimeoutError, OSError)


class PseudoGradientExchange:
    """Average `grads` in place over the replicas in the quorum: an exact fp32 all-reduce, or the
    codec's payloads all-gathered and decoded by every replica in the same order (bit-equal
    results). A failed collective (a lost peer) goes to `on_error` and leaves `grads` as they
    were; an error of the codec raises; success
    reports (bytes sent, bytes of an uncompressed fp32 ring all-reduce) to `on_done`.

    Args:
        grads: the fragment's pseudo-gradients, in name order.
        pg: the replicas' process group (torchft's, reconfigured at each quorum).
        codec: the fragment's codec with its error feedback, or None for fp32.
        participating: False while this replica heals: it contributes zeros.
        participants: replicas in the quorum (the divisor).
    """

    def __init__(self, grads: list[torch.Tensor], pg, *, codec: PseudoGradientCodec | None, participating: bool,
                 participants: int, on_error: Callable[[Exception], None],
                 on_done: Callable[[int, int], None]) -> None:
        self.grads, self.codec, self.participants = grads, codec, participants
        self.on_error, self.on_done = on_error, on_done
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        self._work = None
        self._done = False
        # The codec runs outside the `try`s: its errors are bugs and raise; only a failure of the
        # communication itself is a lost peer, whose sync torchft discards.
        if codec is None:
            if not participating:
                self.flat.zero_()
        else:
            self._payload = codec.encode(self.flat) if participating else codec.encode_nothing()
        try:
            self.world = pg.size()
            if codec is None:
                opts = AllreduceOptions()
                opts.reduceOp = ReduceOp.SUM
                self._work = pg.allreduce([self.flat], opts)
            else:
                self._gathered = [torch.empty_like(self._payload) for _ in range(self.world)]
                self._work = pg.allgather([self._gathered], [self._payload], AllgatherOptions())
        except COMMUNICATION_ERRORS as err:
            on_error(err)

    def wait(self) -> None:
        """Finish the exchange (once; torchft and a checkpoint may both ask)."""
        if self._done or self._work is None:
            self._done = True
            return
        self._done = True
        try:
            self._work.wait()
        except COMMUNICATION_ERRORS as err:
            self.on_error(err)
            return
        if self.codec is None:
            flat = self.flat
            sent = ring_allreduce_bytes(flat.numel() * flat.element_size(), self.world)
        else:
            flat = torch.stack([self.codec.decode(p) for p in self._gathered]).sum(0).to(self.flat.dtype)
            sent = self._payload.numel() * (self.world - 1)
        flat /= self.participants
        self.on_done(sent, ring_allreduce_bytes(flat.numel() * 4, self.world))
        for g, part in zip(self.grads, flat.split([g.numel() for g in self.grads]), strict=True):
            g.copy_(part.view_as(g))
