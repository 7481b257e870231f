"""Top-k per chunk, the kept values quantized to a few bits: SparseLoCo's pseudo-gradient codec.

SparseLoCo (Sarfi et al. 2025) sends, of each chunk of a DiLoCo pseudo-gradient, only the 1-3%
largest magnitudes, quantized to 2 bits, and keeps everything else in its error feedback: the
payload falls to a fraction of a bit per element, and the paper reports losses at or below
full-precision DiLoCo's. `PseudoGradientCodec` supplies the error feedback; this codec is the compressor.

A codec of its own rather than `topk` with `bits`: `topk` ranks the whole tensor and sends
float values with indices as wide as the tensor. Chunks make both cheap: a chunk's indices are
local (one byte each for the default 128 elements), and its kept magnitudes are alike, so one
scale per chunk leaves 2-bit codes meaningful. It takes only existing `Compression` fields:
`ratio`, `bits`, `group_size` (the chunk) and `value_dtype` (the scale's dtype).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import GROUP_SIZE, RATIO, Codec, Param, as_bytes, from_bytes, numel
from .cast import FP16_MAX
from .packing import pack_bits, packed_nbytes, unpack_bits
from .quantize import codes_to_values, values_to_codes
from .sparsify import (
    SPARSIFIER_PARAMS,
    VALUE_DTYPES,
    index_width,
    keep_count,
    pack_indices,
    unpack_indices,
)

# Not required, unlike quantize's: SparseLoCo's 2 bits unless a plan says otherwise.
VALUE_BITS = Param(integer=True, low=1, high=8)
DEFAULT_BITS = 2


class TopKQuantizeCodec(Codec):
    """Per chunk of `group_size` consecutive elements (the last one may be shorter), the
    k = keep_count(ratio, chunk length) largest magnitudes, as local indices and `bits`-bit codes.

    The codes are `quantize`'s symmetric levels over [-s, s], s = the largest kept magnitude of
    the chunk: max-abs rather than the kept values' mean magnitude, because it bounds every kept
    value's error by s / (2**bits - 1) (2 bits: levels +-s/3, +-s), and because its 2**bits levels
    exclude zero, a kept value decodes to zero only in an all-zero chunk. s is sent in `value_dtype`, and the
    codes are computed against the scale as sent (a value above it, the scale rounded down or
    clamped to fp16's range, takes the top level; error feedback carries the rest). Dropped
    entries decode to zero. k is at least 1 per chunk: below 1 / group_size, raise group_size.

    Payload: one scale per chunk (`value_dtype`), then every kept index (`index_width` of the
    chunk length, in whole bytes, little-endian), then every code packed at `bits` bits.
    Bytes: `C * scale_bytes + K * w + packed(K, bits)` with C chunks and K kept values in all.

    Args:
        ratio: fraction of each chunk kept, in (0, 1] (SparseLoCo: 0.01-0.03).
        bits: bits per kept value, 1..8 (default 2).
        group_size: elements per chunk (default 128, the rows DiLoCo's pseudo-gradient is cut into).
        value_dtype: dtype of each chunk's scale: fp16 (default), bf16 or fp32.
    """

    name = "topk_quantize"
    params = {"ratio": RATIO, "bits": VALUE_BITS, "group_size": GROUP_SIZE,
              "value_dtype": SPARSIFIER_PARAMS["value_dtype"]}

    def __init__(self, ratio: float, bits: int = DEFAULT_BITS, group_size: int = 128,
                 value_dtype: str = "fp16") -> None:
        ratio = self.check_params(ratio=ratio, bits=bits, group_size=group_size, value_dtype=value_dtype)["ratio"]
        self.ratio, self.bits, self.group_size, self.value_dtype = ratio, bits, group_size, value_dtype
        self.levels = (1 << bits) - 1

    @classmethod
    def label(cls, params: Mapping[str, Any]) -> str:
        """`topk_quantize0.02-2bit`: the ratio and the bits, which has a default."""
        return f"{cls.name}{params['ratio']:g}-{params.get('bits', DEFAULT_BITS)}bit"

    # -- sizes --------------------------------------------------------------------------------
    def _blocks(self, n: int) -> list[tuple[int, int, int]]:
        """(chunks, chunk length, kept per chunk): the full chunks, then the shorter last one."""
        full, tail = divmod(n, self.group_size)
        blocks = ([(full, self.group_size)] if full else []) + ([(1, tail)] if tail else [])
        return [(rows, length, keep_count(self.ratio, length)) for rows, length in blocks]

    def _counts(self, n: int) -> tuple[int, int, int]:
        """Chunks, kept values in all, and bytes per index."""
        blocks = self._blocks(n)
        return (sum(rows for rows, _, _ in blocks), sum(rows * k for rows, _, k in blocks),
                index_width(min(n, self.group_size)))

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        n = numel(shape)
        if n == 0:
            return 0
        chunks, kept, width = self._counts(n)
        return chunks * VALUE_DTYPES[self.value_dtype].itemsize + kept * width + packed_nbytes(kept, self.bits)

    # -- codec --------------------------------------------------------------------------------
    def _wire_scale(self, scale: torch.Tensor) -> torch.Tensor:
        if self.value_dtype == "fp16":
            scale = scale.clamp(max=FP16_MAX)
        return scale.to(VALUE_DTYPES[self.value_dtype])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        flat = x.detach().reshape(-1).float()
        scales, indices, codes = [], [], []
        start = 0
        for rows, length, k in self._blocks(n):
            chunk = flat[start:start + rows * length].view(rows, length)
            start += rows * length
            index = chunk.abs().topk(k, dim=1, sorted=False).indices
            kept = chunk.gather(1, index)
            scale = self._wire_scale(kept.abs().amax(dim=1, keepdim=True))
            s = scale.float()
            kept = torch.minimum(torch.maximum(kept, -s), s)  # within a scale rounded down to its dtype
            scales.append(scale.reshape(-1))
            indices.append(index.reshape(-1))
            codes.append(values_to_codes(kept, s, self.levels).reshape(-1))
        width = index_width(min(n, self.group_size))
        return torch.cat([as_bytes(torch.cat(scales)), pack_indices(torch.cat(indices), width),
                          pack_bits(torch.cat(codes), self.bits)])

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape)
        out = torch.zeros(n, dtype=torch.float32, device=payload.device)
        if n == 0:
            return out.reshape(tuple(shape)).to(dtype)
        chunks, kept, width = self._counts(n)
        vdtype = VALUE_DTYPES[self.value_dtype]
        scales = from_bytes(payload, vdtype, chunks).float()
        offset = chunks * vdtype.itemsize
        indices = unpack_indices(payload[offset:offset + kept * width], width)
        codes = unpack_bits(payload[offset + kept * width:], self.bits, kept)
        start = row = pos = 0
        for rows, length, k in self._blocks(n):
            values = codes_to_values(codes[pos:pos + rows * k].view(rows, k), scales[row:row + rows].view(rows, 1),
                                     self.levels)
            out[start:start + rows * length].view(rows, length).scatter_(1, indices[pos:pos + rows * k].view(rows, k),
                                                                          values)
            start, row, pos = start + rows * length, row + rows, pos + rows * k
        return out.reshape(tuple(shape)).to(dtype)
