"""The codec interface: tensor -> one flat uint8 payload of a size known in advance -> tensor."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

import torch


class Codec(abc.ABC):
    """Encodes a tensor into a single contiguous uint8 payload and back.

    `payload_nbytes(shape, dtype)` is exact and needs no data, so a receiver can allocate its
    buffer before the payload arrives and byte counts are the bytes actually sent.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Exact size in bytes of `encode(x)` for any `x` of this shape and dtype."""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """1-D contiguous uint8 tensor on `x.device`; `x` is left unchanged."""

    @abc.abstractmethod
    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A fresh tensor of `shape` and `dtype` on `payload.device`."""

    def state_dict(self) -> dict[str, int]:
        """Counters that make random streams resumable ({} for stateless codecs)."""
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, value in state.items():
            if not hasattr(self, key):
                raise KeyError(f"{type(self).__name__} has no state {key!r}.")
            setattr(self, key, int(value))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor as a flat uint8 view (no copy when contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(payload: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    """`count` elements of `dtype` from the front of a uint8 buffer (copied if misaligned)."""
    nbytes = count * dtype.itemsize
    chunk = payload[:nbytes]
    if chunk.data_ptr() % dtype.itemsize:
        chunk = chunk.clone()
    return chunk.view(dtype)


def seeded_generator(device: torch.device, seed: int, counter: int) -> torch.Generator:
    """A generator for call `counter` of a stream: both sides derive the same one."""
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 1_000_003 + int(counter)) % (2**63 - 1))
    return g
