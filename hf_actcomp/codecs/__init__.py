"""Boundary codecs and their registry by name.

A codec registers once, with `register_codec`, and is then usable everywhere a codec name is:
`Compression(method=name)` validates the fields the codec declares in `Codec.params`, the codec is
built from them, its `label` names it in logs and cards and its `hub_tag` tags the model card
(docs/adding_a_codec.md).
"""

from __future__ import annotations

import inspect

from .base import BITS, GROUP_SIZE, RATIO, ROUNDING, SEED, Codec, Param
from .cast import Bf16Codec, Fp16Codec, NoneCodec
from .hadamard import HadamardCodec
from .hadamard_codebook import HadamardCodebookCodec
from .hadamard_outliers import HadamardOutliersCodec
from .hadamard_vq import HadamardVQCodec
from .lowrank import LowRankCodec
from .quantize import QuantizeCodec
from .sparsify import RandKCodec, TopKCodec
from .topk_quantize import TopKQuantizeCodec

CODECS: dict[str, type[Codec]] = {}
# `Compression(method="aqsgd")` wraps a codec (its `inner`); it cannot name one.
RESERVED_NAMES = ("aqsgd",)


def _constructor_args(cls: type[Codec]) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator adding a codec to the registry under `cls.name`: from then on
    `Compression(method=cls.name, ...)` accepts it in plans (Python, JSON, YAML), in a pipeline,
    a simulation and on model cards. Register it in every process before building the plan.

    Refuses a name already taken by another class (`del CODECS[name]` first to replace one) and
    `params` that are not constructor arguments.
    """
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"register_codec expects a Codec subclass, got {cls!r}.")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name in RESERVED_NAMES:
        raise ValueError(f"{cls.__name__}.name={name!r} must be a non-empty string other than "
                         f"{', '.join(RESERVED_NAMES)}.")
    if name in CODECS and CODECS[name] is not cls:
        raise ValueError(f"A codec named {name!r} is already registered ({CODECS[name].__name__}).")
    unknown = sorted(set(cls.params) - _constructor_args(cls))
    if unknown:
        raise ValueError(f"{cls.__name__}.params names {unknown}, which {cls.__name__}.__init__ does not take: "
                         "each declared Compression field is passed to the constructor under its own name.")
    CODECS[name] = cls
    return cls


def get_codec_class(name: str) -> type[Codec]:
    """The codec class registered as `name`."""
    if name not in CODECS:
        raise ValueError(f"Unknown codec {name!r}. Available codecs: {', '.join(available_codecs())}")
    return CODECS[name]


def available_codecs() -> list[str]:
    """Registered codec names, sorted."""
    return sorted(CODECS)


def make_codec(name: str, **params) -> Codec:
    """Build the codec registered as `name` with its constructor parameters."""
    cls = get_codec_class(name)
    accepted = _constructor_args(cls)
    unknown = sorted(set(params) - accepted)
    if unknown:
        allowed = ", ".join(sorted(accepted)) or "none"
        raise ValueError(f"Codec {name!r} does not take {unknown}. Its parameters: {allowed}.")
    return cls(**params)


for _cls in (NoneCodec, Fp16Codec, Bf16Codec, QuantizeCodec, TopKCodec, RandKCodec, HadamardCodec,
             HadamardOutliersCodec, HadamardCodebookCodec, HadamardVQCodec, TopKQuantizeCodec,
             LowRankCodec):
    register_codec(_cls)

__all__ = [
    "BITS",
    "CODECS",
    "GROUP_SIZE",
    "RATIO",
    "ROUNDING",
    "SEED",
    "Bf16Codec",
    "Codec",
    "Fp16Codec",
    "HadamardCodebookCodec",
    "HadamardCodec",
    "HadamardOutliersCodec",
    "HadamardVQCodec",
    "LowRankCodec",
    "NoneCodec",
    "Param",
    "QuantizeCodec",
    "RandKCodec",
    "TopKCodec",
    "TopKQuantizeCodec",
    "available_codecs",
    "get_codec_class",
    "make_codec",
    "register_codec",
]
