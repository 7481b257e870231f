"""Boundary codecs and their registry by name."""

from __future__ import annotations

import inspect

from .base import Codec
from .cast import Bf16Codec, Fp16Codec, NoneCodec
from .hadamard import HadamardCodec
from .quantize import QuantizeCodec
from .sparsify import RandKCodec, TopKCodec

CODECS: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator adding a codec to the registry under `cls.name`."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"register_codec expects a Codec subclass, got {cls!r}.")
    if cls.name in CODECS and CODECS[cls.name] is not cls:
        raise ValueError(f"A codec named {cls.name!r} is already registered ({CODECS[cls.name].__name__}).")
    CODECS[cls.name] = cls
    return cls


def available_codecs() -> list[str]:
    """Registered codec names, sorted."""
    return sorted(CODECS)


def make_codec(name: str, **params) -> Codec:
    """Build the codec registered as `name` with its constructor parameters."""
    if name not in CODECS:
        raise ValueError(f"Unknown codec {name!r}. Available codecs: {', '.join(available_codecs())}")
    cls = CODECS[name]
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(params) - accepted)
    if unknown:
        allowed = ", ".join(sorted(accepted)) or "none"
        raise ValueError(f"Codec {name!r} does not take {unknown}. Its parameters: {allowed}.")
    return cls(**params)


for _cls in (NoneCodec, Fp16Codec, Bf16Codec, QuantizeCodec, TopKCodec, RandKCodec, HadamardCodec):
    register_codec(_cls)

__all__ = [
    "CODECS",
    "Bf16Codec",
    "Codec",
    "Fp16Codec",
    "HadamardCodec",
    "NoneCodec",
    "QuantizeCodec",
    "RandKCodec",
    "TopKCodec",
    "available_codecs",
    "make_codec",
    "register_codec",
]
