"""Sparsifiers: TopK (values + narrowest indices) and RandomK (values only, shared-seed indices)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from .base import RATIO, SEED, Codec, Param, as_bytes, from_bytes, numel, seeded_generator
from .cast import FP16_MAX

VALUE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# The plan fields both sparsifiers take: the fraction kept, the dtype of the values sent, the seed.
SPARSIFIER_PARAMS = {"ratio": RATIO, "value_dtype": Param(choices=tuple(VALUE_DTYPES)), "seed": SEED}


def index_width(n: int) -> int:
    """Bytes per index for a tensor of n elements: the fewest whole bytes that hold n - 1."""
    return max(1, -(-max(n - 1, 1).bit_length() // 8))


def keep_count(ratio: float, n: int) -> int:
    """k = round(ratio * n), at least 1 and at most n (0 for an empty tensor)."""
    return 0 if n == 0 else min(n, max(1, round(ratio * n)))


def _values_to_bytes(values: torch.Tensor, value_dtype: str) -> torch.Tensor:
    if value_dtype == "fp16":
        values = values.clamp(-FP16_MAX, FP16_MAX)
    return as_bytes(values.to(VALUE_DTYPES[value_dtype]))


def pack_indices(indices: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian `width`-byte indices: the low bytes of an int32 (or int64) view."""
    wide = torch.int32 if width <= 4 else torch.int64
    raw = indices.to(wide).contiguous().view(torch.uint8).view(-1, wide.itemsize)
    if sys.byteorder != "little":  # keep the wire format little-endian everywhere
        raw = raw.flip(1)
    return raw[:, :width].reshape(-1)


def unpack_indices(data: torch.Tensor, width: int) -> torch.Tensor:
    """The int64 indices that `pack_indices` wrote at `width` bytes each."""
    wide = torch.int32 if width <= 4 else torch.int64
    raw = torch.zeros(data.numel() // width, wide.itemsize, dtype=torch.uint8, device=data.device)
    raw[:, :width] = data.view(-1, width)
    if sys.byteorder != "little":
        raw = raw.flip(1).contiguous()
    return raw.view(wide).reshape(-1).to(torch.int64)


def _scatter(values: torch.Tensor, indices: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(numel(shape), dtype=dtype, device=values.device)
    out[indices] = values.to(dtype)
    return out.reshape(tuple(shape))


class TopKCodec(Codec):
    """The k = ratio * n largest magnitudes of the flattened tensor.

    Selection is exact but avoids a full `torch.topk`: thresholds estimated from a random
    sample bracket the k-th largest magnitude, and `topk` ranks only the elements between them
    (falling back to the full tensor if the estimate missed).
    Payload: k values in `value_dtype`, then k indices of `index_width(n)` bytes each.
    """

    name = "topk"
    params = SPARSIFIER_PARAMS
    sample_size = 4096

    def __init__(self, ratio: float, value_dtype: str = "fp16", seed: int = 0) -> None:
        ratio = self.check_params(ratio=ratio, value_dtype=value_dtype)["ratio"]
        self.ratio, self.value_dtype, self.seed = ratio, value_dtype, seed
        self.calls = 0

    def payload_nbytes(self, shape, dtype):
        n = numel(shape)
        return keep_count(self.ratio, n) * (VALUE_DTYPES[self.value_dtype].itemsize + index_width(n))

    def select(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the k largest |flat| (the same set torch.topk returns).

        Two thresholds from a sorted random sample bracket the k-th magnitude: everything above
        `high` is kept outright, and `topk` only ranks the thin band between `low` and `high`.
        """
        n = flat.numel()
        magnitude = flat.abs()
        if n > 4 * self.sample_size:
            g = seeded_generator(flat.device, self.seed, self.calls)
            self.calls += 1
            sample = magnitude[torch.randint(0, n, (self.sample_size,), generator=g, device=flat.device)]
            sample = sample.sort(descending=True).values
            rank = self.sample_size * k / n  # expected rank of the k-th magnitude in the sample
            spread = 4.0 * math.sqrt(rank * (1 - k / n)) + 2  # ~4 standard deviations
            high = sample[min(self.sample_size - 1, int(rank - spread))] if rank - spread >= 0 else None
            low = sample[int(rank + spread)] if rank + spread < self.sample_size else None
            above = magnitude > high if high is not None else None
            num_above = int(above.sum()) if above is not None else 0
            band = (magnitude >= low) if low is not None else torch.ones_like(magnitude, dtype=torch.bool)
            if above is not None:
                band &= ~above
            band_idx = band.nonzero().squeeze(1)
            needed = k - num_above
            if 0 <= needed <= band_idx.numel():
                best = band_idx[torch.topk(magnitude[band_idx], needed, sorted=False).indices]
                if above is None:
                    return best
                return torch.cat([above.nonzero().squeeze(1), best])
        return torch.topk(magnitude, k, sorted=False).indices

    def encode(self, x):
        n = x.numel()
        k = keep_count(self.ratio, n)
        if k == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        flat = x.detach().reshape(-1)
        indices = self.select(flat, k)
        return torch.cat([_values_to_bytes(flat[indices], self.value_dtype), pack_indices(indices, index_width(n))])

    def decode(self, payload, shape, dtype):
        n = numel(shape)
        k = keep_count(self.ratio, n)
        vdtype = VALUE_DTYPES[self.value_dtype]
        values = from_bytes(payload, vdtype, k)
        indices = unpack_indices(payload[k * vdtype.itemsize :], index_width(n)) if k else payload.new_zeros(0, dtype=torch.int64)
        return _scatter(values, indices, shape, dtype)

    def state_dict(self):
        return {"calls": self.calls}


class RandKCodec(Codec):
    """k = ratio * n values at random positions; both sides draw the positions from the shared
    seed and their own call counter, so only the values are sent. Positions are stratified (one
    per n/k elements), which is O(k) and keeps each element with probability k / n. Values are not rescaled by
    n / k: meant for use with error feedback, which returns what was dropped later."""

    name = "randk"
    params = SPARSIFIER_PARAMS

    def __init__(self, ratio: float, value_dtype: str = "fp16", seed: int = 0) -> None:
        ratio = self.check_params(ratio=ratio, value_dtype=value_dtype)["ratio"]
        self.ratio, self.value_dtype, self.seed = ratio, value_dtype, seed
        self.calls = 0

    def payload_nbytes(self, shape, dtype):
        return keep_count(self.ratio, numel(shape)) * VALUE_DTYPES[self.value_dtype].itemsize

    def _indices(self, n: int, device: torch.device) -> torch.Tensor:
        """One random position in each of k equal strata of [0, n): O(k), no full permutation,
        and every element is kept with probability k / n."""
        k = keep_count(self.ratio, n)
        g = seeded_generator(device, self.seed, self.calls)
        self.calls += 1
        u = torch.rand(k, generator=g, device=device, dtype=torch.float64)
        positions = (torch.arange(k, device=device, dtype=torch.float64) + u) * (n / k)
        return positions.floor_().to(torch.int64).clamp_(max=n - 1)

    def encode(self, x):
        n = x.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        indices = self._indices(n, x.device)
        return _values_to_bytes(x.detach().reshape(-1)[indices], self.value_dtype)

    def decode(self, payload, shape, dtype):
        n = numel(shape)
        if n == 0:
            return torch.zeros(tuple(shape), dtype=dtype, device=payload.device)
        indices = self._indices(n, payload.device)
        values = from_bytes(payload, VALUE_DTYPES[self.value_dtype], indices.numel())
        return _scatter(values, indices, shape, dtype)

    def state_dict(self):
        return {"calls": self.calls}
