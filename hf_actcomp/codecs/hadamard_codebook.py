"""`hadamard_codebook`: `hadamard_outliers` with a Gaussian codebook of an odd number of levels.

Measured on SmolLM2-135M (docs/real_model.md), `hadamard_outliers` at 4 bits holds within 1% at
4 stages but sends 7.0x fewer bytes than fp32 at best: its 16 uniform levels take 4 bits a value
before any scale or index. Three changes fit as much quality into fewer bits:

- **a codebook, not a grid.** After the Hadamard rotation a tile's values are close to Gaussian;
  scaled by the tile's max-abs they crowd around zero. The levels are the Lloyd-Max quantizer of
  that distribution (`gaussian_codebook`), an odd number of them so that zero is one.
- **joint packing.** A non-power-of-two count of levels packs several values into one word
  (`pack_digits`): 11 levels take 3.5 bits a value, 13 levels 3.71.
- **fitted 8-bit scales.** Each tile's scale is one byte, a power 2^(-q/16) of the message's
  largest scale (fp32), and the encoder tries a few clipped scales per tile (1 down to 0.6 of its
  max-abs) and keeps the one with the least squared error: a Gaussian tile's lone extreme value is
  worth less than resolution for the rest.

The sink token, the channel mean and the per-token outlier channels go apart exactly as in
`hadamard_outliers` (this class inherits them). At 11 levels, tiles of 32 and 3 outlier channels a
SmolLM2 boundary costs 3.99 bits a value, 8.0x fewer than fp32. Deterministic and stateless; the
payload size follows from the shape alone.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .base import SEED, Param, as_bytes, from_bytes
from .hadamard import HadamardCodec
from .hadamard_outliers import OUTLIERS, HadamardOutliersCodec, tile_size
from .packing import pack_digits, packed_digits_nbytes, unpack_digits

LEVELS = Param(required=True, choices=(3, 5, 7, 9, 11, 13, 15))
DEFAULT_TILE = 32
DEFAULT_OUTLIERS = 3
SCALE_STEPS_PER_OCTAVE = 16  # a one-byte scale spans 16 octaves below the message's largest
CLIP_STEPS = (0, 2, 4, 6, 8, 10, 12)  # scales tried per tile: 2^(-j/16) of the max-abs (1 down to 0.59)


@lru_cache(maxsize=32)
def gaussian_codebook(levels: int, tile: int) -> tuple[float, ...]:
    """The Lloyd-Max levels for Gaussian tiles of `tile` values divided by their max-abs, with
    -1 and 1 kept as the outer levels (the max-abs itself is then exact) and symmetric around 0.

    Fitted once per (levels, tile) on 2^20 seeded samples in float64 (sorted, so that each Lloyd
    step is a few searchsorted and cumulative sums); both sides derive the same table."""
    generator = torch.Generator().manual_seed(0)
    rows = max(1, (1 << 20) // tile)
    x = torch.randn(rows, tile, generator=generator, dtype=torch.float64)
    x = (x / x.abs().amax(dim=1, keepdim=True)).reshape(-1).abs().sort().values  # fold: the table is symmetric
    sums = torch.cat([x.new_zeros(1), x.cumsum(0)])
    half = levels // 2  # levels above zero: 0 < c_1 < ... < c_half = 1
    c = torch.linspace(0, 1, half + 1, dtype=torch.float64)
    for _ in range(200):
        edges = torch.searchsorted(x, (c[:-1] + c[1:]) / 2)  # cells [edges[i-1], edges[i]) belong to c[i]
        start = torch.cat([edges.new_zeros(1), edges])
        stop = torch.cat([edges, edges.new_full((1,), x.numel())])
        count = (stop - start).clamp_min(1)
        means = (sums[stop] - sums[start]) / count
        c = torch.cat([c.new_zeros(1), means[1:-1], c.new_ones(1)])  # 0 and 1 stay
    return tuple(float(v) for v in torch.cat([-c.flip(0)[:-1], c]))


class HadamardCodebookCodec(HadamardOutliersCodec):
    """`hadamard_outliers` whose rotated rest goes to an odd-sized Gaussian codebook, packed
    jointly, with one fitted byte of scale per tile (see the module docstring).

    Args:
        levels: codebook size, odd, 3..15 (11: 3.5 bits a value; 13: 3.71; 15: 4).
        outliers: channels per token sent apart, 0..64 (default 3).
        tile: values per scale, the largest divisor of the hidden size not above it (default 32).
    """

    name = "hadamard_codebook"
    params = {"levels": LEVELS, "outliers": OUTLIERS, "seed": SEED}

    def __init__(self, levels: int, outliers: int = DEFAULT_OUTLIERS, seed: int = 0, tile: int = DEFAULT_TILE) -> None:
        self.check_params(levels=levels, outliers=outliers)
        if not isinstance(tile, int) or tile < 1:
            raise ValueError(f"hadamard_codebook tile={tile!r} must be a positive integer.")
        self.levels, self.outliers, self.seed, self.group_size = int(levels), int(outliers), seed, tile
        self._rotation = HadamardCodec(bits=8, seed=seed)  # its random signs and transform only
        self._best_trials = best_trials  # `fuse` swaps in a compiled one

    def _tile_sizes(self, count: int, tile: int) -> dict[str, int]:
        return {"top_scale": 4, "scales": count // tile, "codes": packed_digits_nbytes(count, self.levels)}

    def _table(self, tile: int, device: torch.device) -> torch.Tensor:
        return torch.tensor(gaussian_codebook(self.levels, tile), dtype=torch.float32, device=device)

    def _encode_tiles(self, tiles: torch.Tensor) -> list[torch.Tensor]:
        table = self._table(tiles.shape[1], tiles.device)
        half = self.levels // 2
        amax = tiles.abs().amax(dim=1)
        top = amax.max().reshape(1)
        ratio = torch.where(top > 0, amax / top, torch.zeros_like(amax)).clamp_min(2.0**-17)
        # The smallest step q whose scale top * 2^(-q/16) is not below the tile's max-abs.
        first = torch.floor(-torch.log2(ratio) * SCALE_STEPS_PER_OCTAVE).clamp_(0, 255)
        first = first - (_scale(top, first) < amax).float()  # float rounding: never clip by accident
        unit = _scale(top, first).unsqueeze(1)  # the first scale, as the decoder computes it
        values = torch.where(unit > 0, tiles / unit, 0.0)  # |values| <= 1: the tile in units of its first scale
        magnitude = values.abs()
        # The table is symmetric, so a value's code is its sign and the count of positive cell
        # edges below its magnitude: a few vectorised compares (`torch.bucketize`, a binary search
        # per value on CPU, made the encoder 2-3x slower). Trial j shrinks levels and edges by 2^(-j/16).
        positive = table[half:]  # 0 = c_0 < c_1 < ... < c_half = 1
        trial_steps = torch.tensor(CLIP_STEPS, dtype=torch.float32, device=tiles.device)
        shrink = torch.exp2(-trial_steps / SCALE_STEPS_PER_OCTAVE)
        levels = positive.unsqueeze(0) * shrink.unsqueeze(1)  # (trials, half + 1)
        edges = (positive[1:] + positive[:-1]).unsqueeze(0) / 2 * shrink.unsqueeze(1)  # (trials, half)
        best = self._best_trials(magnitude, levels, edges)
        count = torch.zeros_like(magnitude, dtype=torch.uint8)
        for e in range(half):  # each tile's count at its own chosen scale
            count += magnitude > edges[best, e].unsqueeze(1)
        codes = torch.where(values < 0, half - count, count + half)  # uint8: count <= half
        q = (first + trial_steps[best]).clamp_(0, 255).to(torch.uint8)
        return [as_bytes(top.float()), q, pack_digits(codes, self.levels)]

    def _decode_tiles(self, parts: dict[str, torch.Tensor], count: int, tile: int) -> torch.Tensor:
        top = from_bytes(parts["top_scale"], torch.float32, 1)
        scale = _scale(top, parts["scales"].float()).unsqueeze(1)
        codes = unpack_digits(parts["codes"], self.levels, count).view(-1, tile).long()
        return self._table(tile, scale.device)[codes] * scale

    def state_dict(self):
        return {}  # no random stream: nothing to resume


def best_trials(magnitude: torch.Tensor, levels: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Per tile (row), the trial j of least squared error (the first, widest, on ties) when each
    magnitude is sent as its nearest level of trial j, `levels[j]` (ascending, from 0), whose cells
    meet at `edges[j]`.

    Pure tensor arithmetic, so that `fuse` can compile it (hf_actcomp/codecs/fused.py). Eager, each
    value's level is a count of compares and a lookup; compiled, a chain of selects, which inductor
    fuses into one pass (the lookup compiles to a gather slower than eager). Both pick the same
    floats, so the sums are the same arithmetic."""
    compiling = torch.compiler.is_compiling()
    errors = []
    for j in range(levels.shape[0]):
        if compiling:
            sent = torch.zeros_like(magnitude)
            for e in range(edges.shape[1]):
                sent = torch.where(magnitude > edges[j, e], levels[j, e + 1], sent)
        else:
            count = torch.zeros_like(magnitude, dtype=torch.uint8)
            for e in range(edges.shape[1]):
                count += magnitude > edges[j, e]
            sent = levels[j][count.long()]
        errors.append(sent.sub_(magnitude).square_().sum(dim=1))
    return torch.stack(errors, dim=1).argmin(dim=1)


def _scale(top: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The scale that byte q stands for: top * 2^(-q/16), the same float on both sides."""
    return top * torch.exp2(-q / SCALE_STEPS_PER_OCTAVE)


__all__ = ["HadamardCodebookCodec", "best_trials", "gaussian_codebook", "tile_size"]
