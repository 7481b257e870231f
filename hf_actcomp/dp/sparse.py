"""Sparsifying gradient compressors: TopK and RandomK with error feedback, and DGC.

Sparse payloads travel as values + indices through an all-gather (RandomK sends values only:
every worker draws the same positions from a shared seed, so the values can be summed by an
all-reduce directly).
"""

from __future__ import annotations

import math

import torch

from ..codecs.base import seeded_generator
from ..codecs.sparsify import TopKCodec, keep_count
from .base import GradientCompressor, check_ratio


def _sparse_payload(values: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """k values in the gradient's dtype (half precision under `cast`), then k int32 indices."""
    return torch.cat([values.to(dtype).contiguous().view(torch.uint8),
                      indices.to(torch.int32).contiguous().view(torch.uint8)])


def _sparse_sum(payloads: list[torch.Tensor], k: int, n: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float32, device=like.device)
    width = like.element_size() * k
    for payload in payloads:
        values = payload[:width].clone().view(like.dtype).float()
        indices = payload[width : width + 4 * k].clone().view(torch.int32).long()
        out.index_add_(0, indices, values)
    return out


class TopKCompressor(GradientCompressor):
    """Top-k magnitudes of (gradient + memory); the memory keeps what was not sent
    (`memory = p - sent`, so sent + memory == accumulated gradient exactly)."""

    name = "topk"
    stateful = ("memory",)

    def __init__(self, process_group=None, ratio: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(process_group)
        self.ratio = check_ratio(self.name, ratio)
        self.error_feedback = error_feedback
        self._selector = TopKCodec(self.ratio)

    def _reduce(self, flat, names, sizes):
        n = flat.numel()
        k = keep_count(self.ratio, n)
        p = flat.float() + (self._gather_state("memory", names, sizes, flat) if self.error_feedback else 0)
        indices = self._selector.select(p, k)
        values = p[indices]
        if self.error_feedback:
            p[indices] = 0
            self._scatter_state("memory", names, sizes, p)
        total = _sparse_sum(self.all_gather_bytes(_sparse_payload(values, indices, flat.dtype)), k, n, flat)
        return total.div_(self.world_size).to(flat.dtype)


class RandKCompressor(GradientCompressor):
    """k random positions, the same on every worker (shared seed and call counter), so only
    values are all-reduced. With error feedback the dropped part stays in memory; without it the
    values are scaled by n / k, which makes the estimate unbiased."""

    name = "randk"
    stateful = ("memory",)

    def __init__(self, process_group=None, ratio: float = 0.01, error_feedback: bool = True, seed: int = 0) -> None:
        super().__init__(process_group)
        self.ratio = check_ratio(self.name, ratio)
        self.error_feedback = error_feedback
        self.seed = seed

    def indices(self, n: int, device: torch.device) -> torch.Tensor:
        """This call's positions: one per stratum of n / k elements (O(k), each kept w.p. k/n)."""
        k = keep_count(self.ratio, n)
        g = seeded_generator(device, self.seed, self.calls)
        self.calls += 1
        u = torch.rand(k, generator=g, device=device, dtype=torch.float64)
        return ((torch.arange(k, device=device, dtype=torch.float64) + u) * (n / k)).floor_().long().clamp_(max=n - 1)

    def _reduce(self, flat, names, sizes):
        n = flat.numel()
        p = flat.float() + (self._gather_state("memory", names, sizes, flat) if self.error_feedback else 0)
        indices = self.indices(n, flat.device)
        values = p[indices]
        if self.error_feedback:
            p[indices] = 0
            self._scatter_state("memory", names, sizes, p)
        else:
            values = values * (n / indices.numel())
        values = self.all_reduce_sum(values.to(flat.dtype)).float()
        out = torch.zeros(n, dtype=torch.float32, device=flat.device)
        out[indices] = values / self.world_size
        return out.to(flat.dtype)


class DGCCompressor(GradientCompressor):
    """Deep Gradient Compression (Lin et al., 2018).

    Momentum correction (u = m u + g; v += u; send the largest of v), local gradient clipping
    (each worker clips to `clip_norm / sqrt(W)`), momentum factor masking (u and v are zeroed
    where sent), sparsity warm-up (ratio decays exponentially from `warmup_ratio` to `ratio`
    over `warmup_steps`), and the threshold from a random sample of |v| (`sample_ratio`, at
    least 1024 elements) instead of a full sort. The hook applies momentum itself: pair it with
    plain SGD (no optimizer momentum).
    """

    name = "dgc"
    stateful = ("momentum", "velocity")

    def __init__(self, process_group=None, ratio: float = 0.001, momentum: float = 0.9,
                 clip_norm: float | None = None, warmup_steps: int = 0, warmup_ratio: float = 0.25,
                 sample_ratio: float = 0.01, seed: int = 0) -> None:
        super().__init__(process_group)
        self.ratio = check_ratio(self.name, ratio)
        if not 0 <= momentum < 1:
            raise ValueError(f"The 'dgc' hook needs 0 <= momentum < 1, got momentum={momentum!r}.")
        self.momentum, self.clip_norm = momentum, clip_norm
        self.warmup_steps, self.warmup_ratio = warmup_steps, check_ratio(self.name, warmup_ratio)
        self.sample_ratio, self.seed = check_ratio(self.name, sample_ratio), seed

    def current_ratio(self) -> float:
        if self.step >= self.warmup_steps or self.warmup_ratio <= self.ratio:
            return self.ratio
        return self.warmup_ratio * (self.ratio / self.warmup_ratio) ** (self.step / self.warmup_steps)

    def threshold(self, magnitude: torch.Tensor, ratio: float) -> torch.Tensor:
        """The (1 - ratio) quantile of a random sample of `magnitude`."""
        n = magnitude.numel()
        size = min(n, max(1024, int(self.sample_ratio * n)))
        g = seeded_generator(magnitude.device, self.seed + self.rank, self.calls)
        self.calls += 1
        sample = magnitude[torch.randint(0, n, (size,), generator=g, device=magnitude.device)]
        keep = max(1, math.ceil(ratio * size))
        return torch.topk(sample, keep, sorted=False).values.min()

    def _reduce(self, flat, names, sizes):
        n = flat.numel()
        g = flat.float()
        if self.clip_norm is not None:
            limit = self.clip_norm / math.sqrt(self.world_size)
            g = g * torch.clamp(limit / (g.norm() + 1e-6), max=1.0)
        u = self._gather_state("momentum", names, sizes, flat).mul_(self.momentum).add_(g)
        v = self._gather_state("velocity", names, sizes, flat).add_(u)
        ratio = self.current_ratio()
        k = keep_count(ratio, n)
        magnitude = v.abs()
        candidates = (magnitude >= self.threshold(magnitude, ratio)).nonzero().squeeze(1)
        if candidates.numel() >= k:  # hierarchical selection: exactly k among the candidates
            indices = candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]
        else:  # the sample overestimated the threshold: fall back to the full selection
            indices = torch.topk(magnitude, k, sorted=False).indices
        values = v[indices]
        v[indices] = 0  # momentum factor masking
        u[indices] = 0
        self._scatter_state("momentum", names, sizes, u)
        self._scatter_state("velocity", names, sizes, v)
        total = _sparse_sum(self.all_gather_bytes(_sparse_payload(values, indices, flat.dtype)), k, n, flat)
        return total.div_(self.world_size).to(flat.dtype)
