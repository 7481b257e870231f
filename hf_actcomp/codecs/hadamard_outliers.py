"""Hadamard quantization with a real LLM's outliers sent apart (`hadamard_outliers`).

A pretrained LLM's residual stream is not the Gaussian a plain quantizer expects
(docs/real_model.md, measured on SmolLM2-135M): the first token of every sequence is an attention
sink whose norm is up to 180 times the median token's, a few channels carry values tens of
times the rest in every token, and the channels share a constant offset. On it, `hadamard` at 4
bits costs +4.6% eval loss across 3 boundaries, this codec at 4 bits +0.5-1.1% (tiles of 64 / 96)
and at 6 bits +0.08%. Per message of shape (..., tokens, hidden):

1. each sequence's largest-norm token (its attention sink) is sent whole in bf16;
2. the per-channel mean of the other tokens is sent in fp16 and subtracted;
3. each token's `outliers` largest-magnitude channels are sent apart (bf16 value, int16 index);
4. the rest is rotated by a random-sign Hadamard transform and quantized at `bits` bits per
   element with one max-abs scale (bf16) per tile; tiles never straddle two tokens.

A message of one token per sequence (a generation step) is sent as bf16: there the sink is the
whole message. Stateless and deterministic (unless `rounding="stochastic"`); the payload size
follows from the shape alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from .base import Codec, Param, as_bytes, from_bytes, numel, seeded_generator
from .hadamard import HadamardCodec
from .packing import pack_bits, packed_nbytes, unpack_bits
from .quantize import QuantizeCodec, codes_to_values, values_to_codes

OUTLIERS = Param(integer=True, low=0, high=64)
DEFAULT_OUTLIERS = 4
_SCALE_ROUND_UP = 1 + 2**-7  # a bf16 scale rounded to nearest from s * this is never below s


@lru_cache(maxsize=64)  # asked for at every encode, decode and size of a message
def tile_size(hidden: int, group_size: int) -> int:
    """The largest divisor of `hidden` not above `group_size`: a tile never straddles two tokens."""
    return max(d for d in range(1, min(hidden, group_size) + 1) if hidden % d == 0)


class HadamardOutliersCodec(Codec):
    """Sink token in bf16, channel mean in fp16, `outliers` channels per token apart, the rest
    Hadamard-rotated and quantized per tile (see the module docstring).

    Args:
        bits: bits per quantized element, 1..8.
        group_size: the tile (one bf16 scale each) is the largest divisor of the hidden size not
            above it.
        rounding: `deterministic` (nearest) or `stochastic` (unbiased).
        seed: seed of the random signs (fixed for a codec) and of stochastic rounding.
        outliers: channels per token sent apart, 0..64 (default 4).
    """

    name = "hadamard_outliers"
    sink_and_mean = True  # steps 1-2 of the module docstring (`hadamard_vq` may turn them off)
    params = {**{key: QuantizeCodec.params[key] for key in ("bits", "group_size", "rounding", "seed")},
              "outliers": OUTLIERS}

    def __init__(self, bits: int, group_size: int = 128, rounding: str = "deterministic", seed: int = 0,
                 outliers: int = DEFAULT_OUTLIERS) -> None:
        self.check_params(bits=bits, group_size=group_size, rounding=rounding, outliers=outliers)
        self.bits, self.group_size, self.rounding, self.seed = bits, group_size, rounding, seed
        self.outliers = int(outliers)
        self.calls = 0
        self._rotation = HadamardCodec(bits=8, seed=seed)  # its random signs and transform only

    # -- layout -------------------------------------------------------------------------------
    @staticmethod
    def _dims(shape: Sequence[int]) -> tuple[int, int, int]:
        """(sequences, tokens per sequence, hidden) of a message."""
        hidden = int(shape[-1]) if len(shape) else 1
        tokens = int(shape[-2]) if len(shape) >= 2 else 1
        return numel(shape) // max(1, tokens * hidden), tokens, hidden

    def _sizes(self, shape: Sequence[int]) -> dict[str, int]:
        rows, tokens, hidden = self._dims(shape)
        if tokens <= 1 or numel(shape) == 0:
            return {"bf16": 2 * numel(shape)}
        if hidden > 1 << 15:
            raise ValueError(f"hadamard_outliers sends channel indices as int16: hidden size {hidden} is above {1 << 15}.")
        n = rows * tokens
        k = min(self.outliers, hidden - 1)
        apart = {"sink_index": 4 * rows, "sink": 2 * rows * hidden, "mean": 2 * hidden} if self.sink_and_mean else {}
        return {**apart, "outlier_index": 2 * n * k, "outlier": 2 * n * k,
                **self._tile_sizes(n * hidden, self._tile(hidden))}

    # -- the rotated rest, per tile (a subclass may quantize it otherwise) ---------------------
    def _tile(self, hidden: int) -> int:
        return tile_size(hidden, self.group_size)

    def _tile_sizes(self, count: int, tile: int) -> dict[str, int]:
        """Bytes of each part that carries the `count` rotated elements in tiles of `tile`."""
        return {"scales": 2 * (count // tile), "codes": packed_nbytes(count, self.bits)}

    def _encode_tiles(self, tiles: torch.Tensor) -> list[torch.Tensor]:
        """The byte parts (in `_tile_sizes` order) of the rotated rest, one tile per row."""
        scales = (tiles.abs().amax(dim=1) * _SCALE_ROUND_UP).to(torch.bfloat16)
        generator = None
        if self.rounding == "stochastic":
            generator = seeded_generator(tiles.device, self.seed, self.calls)
            self.calls += 1
        codes = values_to_codes(tiles, scales.float().unsqueeze(1), (1 << self.bits) - 1, generator)
        return [as_bytes(scales), pack_bits(codes, self.bits)]

    def _decode_tiles(self, parts: dict[str, torch.Tensor], count: int, tile: int) -> torch.Tensor:
        """The rotated rest, one tile per row, from the parts `_encode_tiles` made."""
        scales = from_bytes(parts["scales"], torch.bfloat16, count // tile).float().unsqueeze(1)
        codes = unpack_bits(parts["codes"], self.bits, count).view(-1, tile)
        return codes_to_values(codes, scales, (1 << self.bits) - 1)

    def payload_nbytes(self, shape, dtype):
        return sum(self._sizes(shape).values())

    # -- codec --------------------------------------------------------------------------------
    def encode(self, x):
        rows, tokens, hidden = self._dims(x.shape)
        if tokens <= 1 or x.numel() == 0:
            return as_bytes(x.detach().to(torch.bfloat16))
        x = x.detach().float().reshape(rows, tokens, hidden)
        rest, apart = x.clone(), []
        if self.sink_and_mean:
            sink = x.norm(dim=-1).argmax(dim=1)  # (rows,)
            picked = torch.arange(rows, device=x.device)
            sink_values = x[picked, sink].to(torch.bfloat16)
            rest[picked, sink] = 0.0
            mean = (rest.sum(dim=(0, 1)) / (rows * (tokens - 1))).half()
            rest.sub_(mean.float())
            rest[picked, sink] = 0.0
            apart = [as_bytes(sink.to(torch.int32)), as_bytes(sink_values), as_bytes(mean)]
        rest = rest.reshape(-1, hidden)
        k = min(self.outliers, hidden - 1)
        index = rest.abs().topk(k, dim=-1).indices if k else rest.new_zeros(rest.shape[0], 0, dtype=torch.long)
        outlier_values = rest.gather(-1, index).to(torch.bfloat16)
        rest.scatter_(-1, index, 0.0)
        tiles = self._rotation.rotate(rest).reshape(-1, self._tile(hidden))
        return torch.cat([*apart, as_bytes(index.to(torch.int16)), as_bytes(outlier_values),
                          *self._encode_tiles(tiles)])

    def decode(self, payload, shape, dtype):
        rows, tokens, hidden = self._dims(shape)
        if tokens <= 1 or numel(shape) == 0:
            return from_bytes(payload, torch.bfloat16, numel(shape)).reshape(tuple(shape)).to(dtype)
        sizes = self._sizes(shape)
        parts, offset = {}, 0
        for key, nbytes in sizes.items():
            parts[key] = payload[offset:offset + nbytes]
            offset += nbytes
        n, k = rows * tokens, min(self.outliers, hidden - 1)
        out = self._rotation.unrotate(self._decode_tiles(parts, n * hidden, self._tile(hidden)).reshape(n, hidden))
        index = from_bytes(parts["outlier_index"], torch.int16, n * k).reshape(n, k).long()
        out.scatter_(-1, index, from_bytes(parts["outlier"], torch.bfloat16, n * k).reshape(n, k).float())
        if self.sink_and_mean:
            out = (out + from_bytes(parts["mean"], torch.float16, hidden).float()).reshape(rows, tokens, hidden)
            sink = from_bytes(parts["sink_index"], torch.int32, rows).long()
            out[torch.arange(rows, device=out.device), sink] = from_bytes(
                parts["sink"], torch.bfloat16, rows * hidden).reshape(rows, hidden).float()
        return out.reshape(tuple(shape)).to(dtype)

    def state_dict(self):
        return {"calls": self.calls}
