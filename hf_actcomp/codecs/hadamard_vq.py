"""`hadamard_vq`: `hadamard_outliers` whose rotated rest is vector-quantized, under one bit a value.

A scalar code spends at least one bit a value (two levels), plus its scales: at SmolLM2's width a
1-bit code with a byte of scale per token sends 31.6x fewer bytes than fp32 (less with the sink
token apart), never 32x. Below one bit only two things go: dropping values (`topk_quantize`: every value
it drops is lost) or coding several values together. This codec does the second. After the random
Hadamard rotation each token's values are close to Gaussian with one variance, so:

- each token (its rotated rest) gets one byte of scale, its RMS as a power 2^(-q/16) of the
  message's largest (fp32, as in `hadamard_codebook`);
- its values, divided by the scale, go in consecutive groups of 8 (`DIM`) to the nearest of
  `levels` 8-dimensional codewords: the k-means codebook of a standard Gaussian
  (`gaussian_vq_codebook`, fitted once from a fixed seed, so both sides derive it);
- each group sends log2(levels) bits: 128 codewords are 0.875 bits a value, 64 are 0.75.

Each codeword is the mean of the Gaussian vectors nearest to it, so the decoded value is the
least-squares estimate given the index: small on average (a 128-word codebook keeps 63% of a
Gaussian's energy, relative error 0.61), never amplified. Measured in training on SmolLM2 in
docs/real_model.md. The sink token, the channel mean and `outliers` channels per token go apart as
in `hadamard_outliers` (default 0 here: at 3 a token they alone cost 0.17 bits a value).
`sink_and_mean=False` codes the sink token and the channel mean with the rest (each token at its own
scale, the sink's too): 0.2 bits a value fewer at SmolLM2's 2 x 128-token micro-batches (the sink in
bf16 and the fp16 mean are 21% of a 64-word message), meant for AQ-SGD's deltas, which a later visit
corrects, not for activations (a sink at the codebook's relative error). On SmolLM2 the sink and the
mean carry most of a delta's energy at some boundaries, and across 3 boundaries it cost more than
the bytes it saved bought (docs/real_model.md).
Deterministic and stateless; the payload size follows from the shape alone.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .base import SEED, Param, as_bytes, from_bytes
from .hadamard import HadamardCodec
from .hadamard_codebook import SCALE_STEPS_PER_OCTAVE, _scale
from .hadamard_outliers import OUTLIERS, HadamardOutliersCodec
from .packing import pack_bits, packed_nbytes, unpack_bits

DIM = 8  # values per codeword
VQ_LEVELS = Param(required=True, choices=(16, 32, 64, 128, 256))
SINK_AND_MEAN = Param(choices=(True, False))
DEFAULT_OUTLIERS = 0
_FIT_SAMPLES = 1 << 16
_FIT_STEPS = 40


@lru_cache(maxsize=8)
def gaussian_vq_codebook(levels: int, dim: int = DIM) -> torch.Tensor:
    """`levels` codewords (rows) of `dim` values: Lloyd's k-means of 2^16 seeded standard
    Gaussian vectors in float64 (40 steps), started from the first `levels` of them. Deterministic
    on a machine; two machines may differ in the last bits of a codeword, which moves a decoded
    value by ~1e-16 of its scale, never the index an encoder picks for the other's decoder."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_FIT_SAMPLES, dim, generator=generator, dtype=torch.float64)
    words = x[:levels].clone()
    for _ in range(_FIT_STEPS):
        nearest = _nearest(x, words)
        sums = torch.zeros_like(words).index_add_(0, nearest, x)
        count = torch.bincount(nearest, minlength=levels).unsqueeze(1)
        words = torch.where(count > 0, sums / count.clamp_min(1), words)  # an empty cell keeps its word
    return words.float()


def _words_per_token(hidden: int) -> int:
    """Codewords a token takes: its values in groups of `DIM`, the last padded with zeros."""
    return -(-hidden // DIM)


def _nearest(x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Index of each row's nearest codeword: argmax of x.c - |c|^2 / 2, one matrix product."""
    return (x @ words.T - 0.5 * words.square().sum(dim=1)).argmax(dim=1)


class HadamardVQCodec(HadamardOutliersCodec):
    """`hadamard_outliers` whose rotated rest goes, 8 values at a time, to a Gaussian k-means
    codebook of `levels` words, with one byte of scale per token (see the module docstring).

    Args:
        levels: codewords, 16..256, a power of two (128: 0.875 bits a value; 64: 0.75).
        outliers: channels per token sent apart, 0..64 (default 0).
        seed: seed of the random signs of the rotation.
        sink_and_mean: send each sequence's sink token (bf16) and the channel mean (fp16) apart
            (default); False codes them with the rest, for AQ-SGD's deltas (module docstring).
    """

    name = "hadamard_vq"
    params = {"levels": VQ_LEVELS, "outliers": OUTLIERS, "seed": SEED, "sink_and_mean": SINK_AND_MEAN}

    def __init__(self, levels: int, outliers: int = DEFAULT_OUTLIERS, seed: int = 0, sink_and_mean: bool = True) -> None:
        self.check_params(levels=levels, outliers=outliers, sink_and_mean=sink_and_mean)
        self.levels, self.outliers, self.seed = int(levels), int(outliers), seed
        self.sink_and_mean = bool(sink_and_mean)
        self._rotation = HadamardCodec(bits=8, seed=seed)  # its random signs and transform only

    @classmethod
    def label(cls, params) -> str:
        """`hadamard_vq64`; `-o1` with an outlier channel a token apart, `-nosink` with the sink
        and mean coded with the rest."""
        outliers = params.get("outliers") or 0
        return (super().label(params) + (f"-o{outliers}" if outliers else "")
                + ("" if params.get("sink_and_mean", True) else "-nosink"))

    @property
    def index_bits(self) -> int:
        """Bits a codeword's index takes: log2(levels)."""
        return self.levels.bit_length() - 1

    def _tile(self, hidden: int) -> int:
        return hidden  # one scale per token

    def _tile_sizes(self, count: int, tile: int) -> dict[str, int]:
        words = (count // tile) * _words_per_token(tile)
        return {"top_scale": 4, "scales": count // tile, "codes": packed_nbytes(words, self.index_bits)}

    def _encode_tiles(self, tiles: torch.Tensor) -> list[torch.Tensor]:
        rms = tiles.square().mean(dim=1).sqrt()
        top = rms.max().reshape(1)
        ratio = torch.where(top > 0, rms / top, torch.zeros_like(rms)).clamp_min(2.0**-17)
        q = torch.round(-torch.log2(ratio) * SCALE_STEPS_PER_OCTAVE).clamp_(0, 255)  # the nearest byte, in log scale
        scale = _scale(top, q).unsqueeze(1)
        values = torch.where(scale > 0, tiles / scale, 0.0)
        pad = _words_per_token(tiles.shape[1]) * DIM - tiles.shape[1]  # a hidden size not a multiple of 8: zeros
        vectors = torch.nn.functional.pad(values, (0, pad)).reshape(-1, DIM)
        codes = _nearest(vectors, gaussian_vq_codebook(self.levels).to(tiles.device)).to(torch.uint8)
        return [as_bytes(top.float()), q.to(torch.uint8), pack_bits(codes, self.index_bits)]

    def _decode_tiles(self, parts: dict[str, torch.Tensor], count: int, tile: int) -> torch.Tensor:
        top = from_bytes(parts["top_scale"], torch.float32, 1)
        scale = _scale(top, parts["scales"].float()).unsqueeze(1)
        words_per_token = _words_per_token(tile)
        codes = unpack_bits(parts["codes"], self.index_bits, (count // tile) * words_per_token).long()
        words = gaussian_vq_codebook(self.levels).to(scale.device)
        return words[codes].reshape(-1, words_per_token * DIM)[:, :tile] * scale

    def state_dict(self):
        return {}  # no random stream: nothing to resume


__all__ = ["DIM", "HadamardVQCodec", "gaussian_vq_codebook"]
