"""Quantizing gradient compressors: QSGD and scaled sign with error feedback (EF-signSGD).

Payloads are fixed-size byte strings exchanged by an all-gather; every worker decodes all of
them and averages.
"""

from __future__ import annotations

import math

import torch

from ..codecs.base import seeded_generator
from ..codecs.packing import pack_bits, unpack_bits
from .base import GradientCompressor


def qsgd_encode(x: torch.Tensor, levels: int, bucket_size: int, generator: torch.Generator) -> torch.Tensor:
    """QSGD (Alistarh et al., 2017): per bucket of `bucket_size` elements, the L2 norm (fp32) and
    for each element sign and a level in 0..s drawn by stochastic rounding of |x| / norm * s,
    so that E[decode] = x. Codes (level * 2 + sign) are bit-packed."""
    n = x.numel()
    pad = (-n) % bucket_size
    flat = torch.nn.functional.pad(x.float().reshape(-1), (0, pad)).view(-1, bucket_size)
    norms = flat.norm(dim=1, keepdim=True)
    scaled = flat.abs() / norms.clamp_min(1e-30) * levels
    lower = scaled.floor()
    level = lower + (torch.rand(scaled.shape, generator=generator, device=x.device) < scaled - lower)
    codes = (level.to(torch.uint8) << 1) | (flat < 0).to(torch.uint8)
    bits = qsgd_bits(levels)
    return torch.cat([norms.reshape(-1).contiguous().view(torch.uint8), pack_bits(codes.reshape(-1)[:n], bits)])


def qsgd_decode(payload: torch.Tensor, n: int, levels: int, bucket_size: int) -> torch.Tensor:
    buckets = -(-n // bucket_size)
    norms = payload[: 4 * buckets].clone().view(torch.float32)
    codes = unpack_bits(payload[4 * buckets :], qsgd_bits(levels), n).long()
    pad = (-n) % bucket_size
    codes = torch.nn.functional.pad(codes, (0, pad)).view(-1, bucket_size)
    values = (codes >> 1).float() / levels * (1 - 2 * (codes & 1)).float()
    return (values * norms.view(-1, 1)).reshape(-1)[:n]


def qsgd_bits(levels: int) -> int:
    return max(1, math.ceil(math.log2(levels + 1))) + 1


class QSGDCompressor(GradientCompressor):
    """QSGD with `levels` quantization levels per sign and buckets of `bucket_size` elements."""

    name = "qsgd"

    def __init__(self, process_group=None, levels: int = 15, bucket_size: int = 512, seed: int = 0) -> None:
        super().__init__(process_group)
        if not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"The 'qsgd' hook needs an integer 1 <= levels <= 127, got levels={levels!r}.")
        if not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"The 'qsgd' hook needs an integer bucket_size >= 1, got {bucket_size!r}.")
        self.levels, self.bucket_size, self.seed = levels, bucket_size, seed

    def _reduce(self, flat, names, sizes):
        n = flat.numel()
        g = seeded_generator(flat.device, self.seed * 7919 + self.rank, self.calls)
        self.calls += 1
        payload = qsgd_encode(flat, self.levels, self.bucket_size, g)
        total = sum(qsgd_decode(p, n, self.levels, self.bucket_size) for p in self.all_gather_bytes(payload))
        return (total / self.world_size).to(flat.dtype)


def sign_encode(p: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 scale, then one bit per element (1 = non-negative)."""
    return torch.cat([scale.float().reshape(1).view(torch.uint8), pack_bits((p >= 0).to(torch.uint8), 1)])


def sign_decode(payload: torch.Tensor, n: int) -> torch.Tensor:
    scale = payload[:4].clone().view(torch.float32)
    bits = unpack_bits(payload[4:], 1, n).float()
    return (bits * 2 - 1) * scale


class EFSignCompressor(GradientCompressor):
    """EF-signSGD (Karimireddy et al., 2019): p = g + memory; send ||p||_1 / d * sign(p) at one
    bit per element; memory = p - sent."""

    name = "ef_sign"
    hub_tag = "ef-signsgd"
    stateful = ("memory",)

    def _reduce(self, flat, names, sizes):
        n = flat.numel()
        p = flat.float() + self._gather_state("memory", names, sizes, flat)
        scale = p.abs().mean()
        sent = torch.where(p >= 0, scale, -scale)
        self._scatter_state("memory", names, sizes, p - sent)
        total = sum(sign_decode(q, n) for q in self.all_gather_bytes(sign_encode(p, scale)))
        return (total / self.world_size).to(flat.dtype)


