"""Symmetric max-abs quantization to 1-8 bits, bit-packed, deterministic or stochastic rounding."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import (
    BITS,
    GROUP_SIZE,
    ROUNDING,
    SEED,
    Codec,
    Param,
    as_bytes,
    from_bytes,
    numel,
    seeded_generator,
)
from .packing import pack_bits, packed_nbytes, unpack_bits


def values_to_codes(values: torch.Tensor, scales: torch.Tensor, levels: int,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 codes round((v / s + 1) / 2 * levels) of `values` against broadcastable max-abs
    `scales`; with a `generator`, stochastic rounding (E[decoded] = v)."""
    inv = torch.where(scales > 0, (levels / 2) / scales, torch.zeros_like(scales))
    if generator is not None:
        v = torch.rand(values.shape, generator=generator, device=values.device).add_(levels / 2)
        v = torch.addcmul(v, values, inv).clamp_(0, levels)  # floor(v + U) by truncation below
    else:
        # round(v) == trunc(v + 0.5) for v >= 0; max-abs scaling keeps v + 0.5 in [0, L + 1).
        v = torch.addcmul(torch.tensor(levels / 2 + 0.5, device=values.device), values, inv)
    return v.to(torch.uint8)


def codes_to_values(codes: torch.Tensor, scales: torch.Tensor, levels: int) -> torch.Tensor:
    """The inverse of `values_to_codes`: (2 c / levels - 1) s, in fp32."""
    return torch.addcmul(-scales, codes.float(), scales * (2.0 / levels))


class QuantizeCodec(Codec):
    """2**bits uniform levels spanning [-s, s], s = max |x| of each group (or hidden channel).

    code = round((x / s + 1) / 2 * L), L = 2**bits - 1; x_hat = (2 * code / L - 1) * s. With
    stochastic rounding E[x_hat] = x (the unbiased quantizer AQ-SGD's theory assumes).
    Payload: fp32 scales, then the codes packed at `bits` bits each.

    Args:
        bits: 1..8.
        granularity: `group` (one scale per `group_size` consecutive elements) or `channel`
            (one scale per index of the last dimension, as in the AQ-SGD reference code).
        group_size: elements per scale for `group`.
        rounding: `deterministic` (nearest) or `stochastic` (unbiased).
        seed: seed of the stochastic rounding stream.
    """

    name = "quantize"
    hub_tag = "quantization"
    params = {"bits": BITS, "granularity": Param(choices=("group", "channel")), "group_size": GROUP_SIZE,
              "rounding": ROUNDING, "seed": SEED}

    def __init__(self, bits: int, granularity: str = "group", group_size: int = 128,
                 rounding: str = "deterministic", seed: int = 0) -> None:
        self.check_params(bits=bits, granularity=granularity, group_size=group_size, rounding=rounding)
        self.bits, self.granularity, self.group_size = bits, granularity, group_size
        self.rounding, self.seed = rounding, seed
        self.calls = 0
        self.levels = (1 << bits) - 1

    def _num_scales(self, shape: Sequence[int]) -> int:
        n = numel(shape)
        if n == 0:
            return 0
        if self.granularity == "channel":
            return int(shape[-1]) if len(shape) else 1
        return -(-n // self.group_size)

    def payload_nbytes(self, shape, dtype):
        return 4 * self._num_scales(shape) + packed_nbytes(numel(shape), self.bits)

    def _rows(self, flat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """View the data as rows that share a scale (group) or columns that do (channel)."""
        if self.granularity == "channel":
            width = int(shape[-1]) if len(shape) else 1
            return flat.view(-1, width)
        pad = (-flat.numel()) % self.group_size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.group_size)

    def encode(self, x):
        n = x.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        rows = self._rows(x.detach().reshape(-1).float(), x.shape)
        dim = 0 if self.granularity == "channel" else 1
        scales = rows.abs().amax(dim=dim, keepdim=True)
        generator = None
        if self.rounding == "stochastic":
            generator = seeded_generator(x.device, self.seed, self.calls)
            self.calls += 1
        codes = values_to_codes(rows, scales, self.levels, generator).reshape(-1)[:n]
        return torch.cat([as_bytes(scales.reshape(-1)), pack_bits(codes, self.bits)])

    def decode(self, payload, shape, dtype):
        n = numel(shape)
        if n == 0:
            return torch.empty(tuple(shape), dtype=dtype, device=payload.device)
        num_scales = self._num_scales(shape)
        scales = from_bytes(payload, torch.float32, num_scales)
        codes = unpack_bits(payload[4 * num_scales :], self.bits, n)
        if self.granularity == "group":
            pad = (-n) % self.group_size
            if pad:
                codes = torch.cat([codes, codes.new_zeros(pad)])
            rows = codes.view(-1, self.group_size)
            scales = scales.view(-1, 1)
        else:
            rows = codes.view(-1, num_scales)
            scales = scales.view(1, -1)
        out = codes_to_values(rows, scales, self.levels)
        return out.reshape(-1)[:n].reshape(tuple(shape)).to(dtype)

    def state_dict(self):
        return {"calls": self.calls}
