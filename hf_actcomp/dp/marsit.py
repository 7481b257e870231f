"""Marsit-style 1-bit aggregation through a ring (after Wu et al., 2022; details are our design).

Each worker holds sign bits of p = g + e (e: the compensation carried from the last step). The
bits travel a chunked ring: in the reduce phase a chunk visits every worker once, and a worker
that receives an aggregate already covering t workers keeps each aggregate bit with probability
t / (t + 1) and otherwise puts its own bit in. Every coordinate therefore ends as the sign of a
uniformly chosen worker: an unbiased estimate of the mean sign, at one bit per element per hop,
without re-compressing a sum. A second ring pass hands every worker every final chunk. The update
is that agreed sign times the workers' mean ||p||_1 / d (one scalar all-reduce); the global
compensation e = p - update carries what the agreed update missed into the next step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..codecs.base import seeded_generator
from ..codecs.packing import pack_bits, unpack_bits
from .base import GradientCompressor


def merge_signs(aggregate: torch.Tensor, own: torch.Tensor, covered: int, generator: torch.Generator) -> torch.Tensor:
    """Merge bool sign bits: keep `aggregate` (covering `covered` workers) with probability
    covered / (covered + 1), else take `own`. The result covers covered + 1 workers uniformly."""
    keep = torch.rand(own.shape, generator=generator, device=own.device) < covered / (covered + 1)
    return torch.where(keep, aggregate, own)


class MarsitCompressor(GradientCompressor):
    """1-bit signs through a ring with random-mask merging and global compensation."""

    name = "marsit"
    stateful = ("compensation",)

    def __init__(self, process_group=None, compensation: bool = True, seed: int = 0) -> None:
        super().__init__(process_group)
        self.compensation, self.seed = compensation, seed
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else list(
            range(self.world_size))
        self.next_rank = ranks[(self.rank + 1) % self.world_size]
        self.prev_rank = ranks[(self.rank - 1) % self.world_size]

    def _exchange(self, send_bits: torch.Tensor, recv_count: int) -> torch.Tensor:
        payload = pack_bits(send_bits.to(torch.uint8), 1)
        buffer = torch.empty(-(-recv_count // 8), dtype=torch.uint8, device=send_bits.device)
        ops = [dist.P2POp(dist.isend, payload, self.next_rank, self.group),
               dist.P2POp(dist.irecv, buffer, self.prev_rank, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.bytes_sent += payload.numel()
        return unpack_bits(buffer, 1, recv_count).bool()

    def aggregate_signs(self, signs: torch.Tensor) -> torch.Tensor:
        """The ring: every worker returns the same agreed sign bits for all `signs`."""
        w, r = self.world_size, self.rank
        chunks = list(torch.tensor_split(signs, w))
        g = seeded_generator(signs.device, self.seed * 104729 + r, self.calls)
        self.calls += 1
        aggregate = chunks[r]
        for t in range(1, w):  # reduce: chunk (r - t) arrives covering t workers
            c = (r - t) % w
            incoming = self._exchange(aggregate, chunks[c].numel())
            aggregate = merge_signs(incoming, chunks[c], t, g)
        final = [None] * w
        final[(r + 1) % w] = aggregate
        for t in range(w - 1):  # gather: pass the final chunks around
            send = final[(r + 1 - t) % w]
            c = (r - t) % w
            final[c] = self._exchange(send, chunks[c].numel())
        return torch.cat(final)

    def _reduce(self, flat, names, sizes):
        p = flat.float()
        if self.compensation:
            p = p + self._gather_state("compensation", names, sizes, flat)
        scale = p.abs().mean().reshape(1)
        self.all_reduce_sum(scale)
        scale /= self.world_size
        agreed = self.aggregate_signs(p >= 0)
        update = torch.where(agreed, scale, -scale)
        if self.compensation:
            self._scatter_state("compensation", names, sizes, p - update)
        return update.to(flat.dtype)
