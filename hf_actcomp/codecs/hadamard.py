"""Randomized Hadamard rotation, then tile-wise quantization with per-tile bit widths.

Stateless, so it needs no AQ-SGD memory and works in a single pass over a data set too large to
revisit (after TAH-Quant, arXiv 2506.01352). Real LLM activations have a few outlier channels:
one scale per group then spends nearly all its levels on them. Rotating each token's hidden
vector by a random-sign Hadamard matrix (orthogonal) spreads every outlier over the
whole block, so a max-abs scale fits the rotated values far better; the receiver rotates back
exactly. Optionally (`boost_fraction`), the tiles whose values spread widest get one bit more and
as many of the narrowest one bit less, so the bits per element stay `bits` on average and the
payload size depends on the shape alone. Off by default: after the rotation the tiles spread
alike, and moving bits then raised the error on every tensor of
benchmarks/results/codecs_outliers.md (a bit pays only where one tile spreads over 2x another).

Payload: 2-bit width index per tile (packed), fp32 max-abs scale per tile, then the codes of the
narrow, middle and wide tiles, each group packed at its width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Codec, Param, as_bytes, from_bytes, numel, seeded_generator
from .packing import pack_bits, packed_nbytes, unpack_bits
from .quantize import QuantizeCodec, codes_to_values, values_to_codes

BOOST_FRACTION = Param(low=0.0, high=0.5, bounds="[)")  # a constructor argument only, not a plan field


def hadamard_block(hidden: int) -> int:
    """The Hadamard block size for a hidden size: its largest power-of-two divisor (768 -> 256),
    so that hidden sizes that are not a power of two rotate in equal blocks."""
    if hidden < 1:
        raise ValueError(f"hidden size must be positive, got {hidden}.")
    return hidden & -hidden


def sylvester_hadamard(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The n x n Hadamard matrix of Sylvester's construction (n a power of two), entries +-1."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}.")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


_FACTORS: dict[tuple[int, torch.dtype, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _factors(block: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """H_a and H_b / sqrt(block), with a * b = block and a, b as equal as powers of two allow
    (cached; the normalisation rides on H_b, which saves a pass over the tensor)."""
    key = (block, dtype, str(device))
    if key not in _FACTORS:
        k = block.bit_length() - 1
        _FACTORS[key] = (sylvester_hadamard(1 << (k - k // 2), dtype, device),
                         sylvester_hadamard(1 << (k // 2), dtype, device) * block**-0.5)
    return _FACTORS[key]


def hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform (Sylvester order) of each `block` consecutive elements
    of the last dimension (its size a multiple of `block`, a power of two). Its own inverse.

    H_block = H_a (x) H_b, so each block, read row-major as an a x b matrix X, maps to H_a X H_b:
    two matrix products of sqrt(block) multiply-adds per element, which run as large GEMMs
    (faster on CPU than log2(block) butterfly passes that each copy the tensor)."""
    shape = x.shape
    h_a, h_b = _factors(block, x.dtype, x.device)
    a, b = h_a.shape[0], h_b.shape[0]
    y = x.reshape(-1, b) @ h_b  # every row of X times H_b (H is symmetric)
    y = (h_a @ y.view(-1, a, b)) if a > 1 else y  # H_a times every X
    return y.reshape(shape)


def _tiles_at(widths: torch.Tensor, index: int, size: int) -> torch.Tensor | slice:
    """The tiles at width `index`: all of them (a slice, no gather) when every tile is."""
    return slice(None) if size == widths.numel() else (widths == index).nonzero().flatten()


class HadamardCodec(Codec):
    """Random-sign Hadamard rotation of each token, then max-abs quantization per tile of
    `group_size` elements at `bits - 1`, `bits` or `bits + 1` bits by the tile's spread.

    Args:
        bits: average bits per element, 1..8 (widths adapt only for 2..7).
        group_size: elements per tile (one fp32 scale and one width each).
        rounding: `deterministic` (nearest) or `stochastic` (unbiased).
        seed: seed of the random signs (fixed for a codec) and of stochastic rounding.
        boost_fraction: fraction of tiles given one bit more (and as many one bit less), in
            [0, 0.5); 0 = every tile at `bits`.
    """

    name = "hadamard"
    params = {key: QuantizeCodec.params[key] for key in ("bits", "group_size", "rounding", "seed")}  # no granularity

    def __init__(self, bits: int, group_size: int = 128, rounding: str = "deterministic", seed: int = 0,
                 boost_fraction: float = 0.0) -> None:
        self.check_params(bits=bits, group_size=group_size, rounding=rounding)
        self.bits, self.group_size, self.rounding, self.seed = bits, group_size, rounding, seed
        self.boost_fraction = BOOST_FRACTION.check("hadamard boost_fraction", boost_fraction)
        self.calls = 0
        self._signs: dict[tuple[int, str], torch.Tensor] = {}

    # -- sizes --------------------------------------------------------------------------------
    def _tiles(self, shape: Sequence[int]) -> int:
        return -(-numel(shape) // self.group_size)

    def _group_sizes(self, tiles: int) -> tuple[int, int, int]:
        """Tiles at bits - 1, bits, bits + 1: fixed by the tile count, so sizes need no data."""
        boosted = int(tiles * self.boost_fraction) if 2 <= self.bits <= 7 else 0
        return boosted, tiles - 2 * boosted, boosted

    def _widths(self) -> tuple[int, int, int]:
        return self.bits - 1, self.bits, self.bits + 1

    def payload_nbytes(self, shape, dtype):
        tiles = self._tiles(shape)
        if tiles == 0:
            return 0
        codes = sum(packed_nbytes(count * self.group_size, width)
                    for count, width in zip(self._group_sizes(tiles), self._widths(), strict=True) if count)
        return packed_nbytes(tiles, 2) + 4 * tiles + codes

    # -- rotation -----------------------------------------------------------------------------
    def _random_signs(self, hidden: int, device: torch.device) -> torch.Tensor:
        key = (hidden, str(device))
        if key not in self._signs:
            g = torch.Generator().manual_seed(int(self.seed) + 7919)
            signs = torch.randint(0, 2, (hidden,), generator=g).float().mul_(2).sub_(1)
            self._signs[key] = signs.to(device)
        return self._signs[key]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """H (D x) per token: random signs D, then the orthonormal Hadamard blocks H."""
        hidden = x.shape[-1]
        return hadamard_transform(x * self._random_signs(hidden, x.device), hadamard_block(hidden))

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """D H y: the exact inverse of `rotate` (H is symmetric and orthonormal, D its own inverse)."""
        hidden = y.shape[-1]
        return hadamard_transform(y, hadamard_block(hidden)) * self._random_signs(hidden, y.device)

    # -- codec --------------------------------------------------------------------------------
    def encode(self, x):
        n = x.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        flat = self.rotate(x.detach().float().reshape(-1, x.shape[-1] if x.dim() else 1)).reshape(-1)
        pad = (-n) % self.group_size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        tiles = flat.view(-1, self.group_size)
        scales = tiles.abs().amax(dim=1)
        sizes = self._group_sizes(tiles.shape[0])
        widths = torch.ones(tiles.shape[0], dtype=torch.uint8, device=x.device)
        if sizes[0]:
            order = torch.argsort(scales, stable=True)  # widest spread last
            widths[order[:sizes[0]]] = 0
            widths[order[order.numel() - sizes[2]:]] = 2
        generator = None
        if self.rounding == "stochastic":
            generator = seeded_generator(x.device, self.seed, self.calls)
            self.calls += 1
        parts = [pack_bits(widths, 2), as_bytes(scales)]
        for index, (size, width) in enumerate(zip(sizes, self._widths(), strict=True)):
            if size:
                chosen = _tiles_at(widths, index, size)
                codes = values_to_codes(tiles[chosen], scales[chosen].unsqueeze(1), (1 << width) - 1, generator)
                parts.append(pack_bits(codes, width))
        return torch.cat(parts)

    def decode(self, payload, shape, dtype):
        n = numel(shape)
        if n == 0:
            return torch.empty(tuple(shape), dtype=dtype, device=payload.device)
        count = self._tiles(shape)
        offset = packed_nbytes(count, 2)
        widths = unpack_bits(payload[:offset], 2, count)
        scales = from_bytes(payload[offset:], torch.float32, count)
        offset += 4 * count
        tiles = torch.empty(count, self.group_size, dtype=torch.float32, device=payload.device)
        for index, (size, width) in enumerate(zip(self._group_sizes(count), self._widths(), strict=True)):
            if not size:
                continue
            nbytes = packed_nbytes(size * self.group_size, width)
            codes = unpack_bits(payload[offset:offset + nbytes], width, size * self.group_size)
            offset += nbytes
            chosen = _tiles_at(widths, index, size)
            tiles[chosen] = codes_to_values(codes.view(size, self.group_size), scales[chosen].unsqueeze(1),
                                            (1 << width) - 1)
        hidden = int(shape[-1]) if len(shape) else 1
        rotated = tiles.reshape(-1)[:n].reshape(-1, hidden)
        return self.unrotate(rotated).reshape(tuple(shape)).to(dtype)

    def state_dict(self):
        return {"calls": self.calls}

