"""The codec interface: tensor -> one flat uint8 payload of a size known in advance -> tensor."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class Param:
    """How a codec takes one `Compression` field (its constructor argument of the same name), and
    the check that both `Compression` and the constructor run on it, so a plan fails before any
    model is touched, with a message naming the value and the allowed ones.

    Args:
        required: `Compression` leaves the field None, so a plan must set it (`bits`, `ratio`).
        choices: the allowed values (empty: any value, or the range below).
        low, high: the allowed range (None: unbounded); `bounds` says which ends are closed,
            e.g. `"(]"` for (0, 1].
        integer: the value must be an `int`; otherwise any real number, kept as a float.
    """

    required: bool = False
    choices: tuple[Any, ...] = ()
    low: float | None = None
    high: float | None = None
    bounds: str = "[]"
    integer: bool = False

    def allowed(self) -> str:
        """The allowed values in words: `group, channel`, `1..8`, `(0, 1]`, `a positive integer`."""
        if self.choices:
            return ", ".join(map(str, self.choices))
        if self.integer and self.low == 1 and self.high is None:
            return "a positive integer"
        if self.integer and self.bounds == "[]" and None not in (self.low, self.high):
            return f"{self.low}..{self.high}"
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return f"{self.bounds[0]}{low}, {high}{self.bounds[1]}"

    def check(self, label: str, value: Any) -> Any:
        """`value` (a float for a real range) if allowed, else a ValueError naming `label` (e.g.
        `Compression.bits` or `quantize bits`), the value and the allowed values."""
        if self.choices:
            if value not in self.choices:
                raise ValueError(f"{label}={value!r} is not valid. Allowed values: {self.allowed()}.")
            return value
        if self.low is None and self.high is None:
            return value
        ok = isinstance(value, int) if self.integer else isinstance(value, (int, float))
        if ok and self.low is not None:
            ok = value > self.low if self.bounds[0] == "(" else value >= self.low
        if ok and self.high is not None:
            ok = value < self.high if self.bounds[1] == ")" else value <= self.high
        if not ok:
            if self.integer and self.low == 1 and self.high is None:
                raise ValueError(f"{label}={value!r} must be {self.allowed()}.")
            raise ValueError(f"{label}={value!r} is outside the allowed range {self.allowed()}.")
        return value if self.integer else float(value)


# The checks of the `Compression` fields the built-in codecs share.
BITS = Param(required=True, integer=True, low=1, high=8)
RATIO = Param(required=True, low=0.0, high=1.0, bounds="(]")
GROUP_SIZE = Param(integer=True, low=1)
ROUNDING = Param(choices=("deterministic", "stochastic"))
SEED = Param()


class Codec(abc.ABC):
    """Encodes a tensor into a single contiguous uint8 payload and back.

    `payload_nbytes(shape, dtype)` is exact and needs no data, so a receiver can allocate its
    buffer before the payload arrives and byte counts are the bytes actually sent.

    What `hf_actcomp.codecs.register_codec` records, so that a `Plan` validates, builds, labels
    and tags the codec from this class alone:

    - `name`: the `Compression(method=...)` that selects it;
    - `params`: the `Compression` fields it takes, each passed to the constructor under its own
      name, with its check (`Compression(method=name)` runs these; other fields are ignored);
    - `hub_tag`: its model-card tag (None: the name);
    - `label(params)`: its short label for cards and logs.
    """

    name: ClassVar[str]
    params: ClassVar[Mapping[str, Param]] = {}
    hub_tag: ClassVar[str | None] = None

    @classmethod
    def label(cls, params: Mapping[str, Any]) -> str:
        """Short label for cards and logs: the name, then the values of its required settings
        (`quantize4`, `topk0.1`, `bf16`). `params` are the constructor arguments a plan gives."""
        values = [params[key] for key, param in cls.params.items() if param.required and key in params]
        return cls.name + "".join(f"{v:g}" if isinstance(v, (int, float)) else str(v) for v in values)

    @classmethod
    def check_params(cls, **values: Any) -> dict[str, Any]:
        """Constructor arguments checked against `params` (floats for real ranges); an error
        names the codec, e.g. `quantize bits=9 is outside the allowed range 1..8`."""
        return {key: cls.params[key].check(f"{cls.name} {key}", value) for key, value in values.items()}

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
