"""Sparsifiers: TopK (values + narrowest indices) and RandomK (values only, shared-seed indices)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Codec, as_bytes, from_bytes, numel, seeded_generator
from .cast import FP16_MAX

VALUE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def index_width(n: int) -> int:
    """Bytes per index for a tensor of n elements: the fewest whole bytes that hold n - 1."""
    return max(1, -(-max(n - 1, 1).bit_length() // 8))


def keep_count(ratio: float, n: int) -> int:
    """k = round(ratio * n), at least 1 and at most n (0 for an empty tensor)."""
    return 0 if n == 0 else min(n, max(1, round(ratio * n)))


def _check(ratio: float, value_dtype: str, codec: str) -> None:
    if not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
        raise ValueError(f"{codec} ratio={ratio!r} is outside the allowed range (0, 1].")
    if value_dtype not in VALUE_DTYPES:
        raise ValueError(f"{codec} value_dtype={value_dtype!r} is not valid. Allowed values: {', '.join(VALUE_DTYPES)}.")


def _values_to_bytes(values: torch.Tensor, value_dtype: str) -> torch.Tensor:
    if value_dtype == "fp16":
        values = values.clamp(-FP16_MAX, FP16_MAX)
    return as_bytes(values.to(VALUE_DTYPES[value_dtype]))


def _pack_indices(indices: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(width, device=indices.device, dtype=torch.int64) * 8
    return ((indices.unsqueeze(1) >> shifts) & 0xFF).to(torch.uint8).reshape(-1)


def _unpack_indices(data: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(width, device=data.device, dtype=torch.int64) * 8
    return (data.view(-1, width).to(torch.int64) << shifts).sum(dim=1)


def _scatter(values: torch.Tensor, indices: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros(numel(shape), dtype=dtype, device=values.device)
    out[indices] = values.to(dtype)
    return out.reshape(tuple(shape))


class TopKCodec(Codec):
    """The k = ratio * n largest magnitudes of the flattened tensor.

    Selection is exact but avoids a full `torch.topk`: a threshold estimated from a random
    sample keeps a candidate set a little larger than k in one pass, and `topk` runs on the
    candidates only (falling back to the full tensor if the estimate kept too few).
    Payload: k values in `value_dtype`, then k indices of `index_width(n)` bytes each.
    """

    name = "topk"
    sample_size = 4096
    margin = 1.3  # candidates kept per wanted element, so the estimate rarely falls short

    def __init__(self, ratio: float, value_dtype: str = "fp16", seed: int = 0) -> None:
        _check(ratio, value_dtype, "topk")
        self.ratio, self.value_dtype, self.seed = float(ratio), value_dtype, seed
        self.calls = 0

    def payload_nbytes(self, shape, dtype):
        n = numel(shape)
        return keep_count(self.ratio, n) * (VALUE_DTYPES[self.value_dtype].itemsize + index_width(n))

    def select(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the k largest |flat| (the same set torch.topk returns)."""
        n = flat.numel()
        magnitude = flat.abs()
        if n > 4 * self.sample_size and k * self.margin < n / 2:
            g = seeded_generator(flat.device, self.seed, self.calls)
            self.calls += 1
            sample = magnitude[torch.randint(0, n, (self.sample_size,), generator=g, device=flat.device)]
            rank = min(self.sample_size - 1, int(self.sample_size * k * self.margin / n) + 1)
            threshold = torch.topk(sample, rank, sorted=True).values[-1]
            candidates = (magnitude >= threshold).nonzero().squeeze(1)
            if candidates.numel() >= k:
                best = torch.topk(magnitude[candidates], k, sorted=False).indices
                return candidates[best]
        return torch.topk(magnitude, k, sorted=False).indices

    def encode(self, x):
        n = x.numel()
        k = keep_count(self.ratio, n)
        if k == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        flat = x.detach().reshape(-1)
        indices = self.select(flat, k)
        return torch.cat([_values_to_bytes(flat[indices], self.value_dtype), _pack_indices(indices, index_width(n))])

    def decode(self, payload, shape, dtype):
        n = numel(shape)
        k = keep_count(self.ratio, n)
        vdtype = VALUE_DTYPES[self.value_dtype]
        values = from_bytes(payload, vdtype, k)
        indices = _unpack_indices(payload[k * vdtype.itemsize :], index_width(n)) if k else payload.new_zeros(0, dtype=torch.int64)
        return _scatter(values, indices, shape, dtype)

    def state_dict(self):
        return {"calls": self.calls}


class RandKCodec(Codec):
    """k = ratio * n values at random positions; both sides draw the positions from the shared
    seed and their own call counter, so only the values are sent. Values are not rescaled by
    n / k: meant for use with error feedback, which returns what was dropped later."""

    name = "randk"

    def __init__(self, ratio: float, value_dtype: str = "fp16", seed: int = 0) -> None:
        _check(ratio, value_dtype, "randk")
        self.ratio, self.value_dtype, self.seed = float(ratio), value_dtype, seed
        self.calls = 0

    def payload_nbytes(self, shape, dtype):
        return keep_count(self.ratio, numel(shape)) * VALUE_DTYPES[self.value_dtype].itemsize

    def _indices(self, n: int, device: torch.device) -> torch.Tensor:
        g = seeded_generator(device, self.seed, self.calls)
        self.calls += 1
        return torch.randperm(n, generator=g, device=device)[: keep_count(self.ratio, n)]

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
