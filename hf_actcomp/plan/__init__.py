"""The plan: how a model is split into pipeline stages and what crosses each stage boundary.

`Plan` is the one object a user writes (in Python, JSON or YAML); everything else in the package
is built from it. Every field is validated when it is built, so a bad value fails before any model
is touched, with a message naming the value and the allowed ones. Codec names and their fields are
checked against the codec registry (`hf_actcomp.codecs`), data-parallel hooks against the hook
registry (`hf_actcomp.dp`): a codec or hook registered there is accepted here as is.

One module a concept: `plan` (`Plan`), `compression`, `memory`, `auto`, `diloco`, `split` (stage
ranges and per-boundary codecs) and `config` (the checks and the JSON / YAML / Hub io they share).
Import from here: `from hf_actcomp.plan import Plan`.
"""

from typing import Any  # noqa: F401 -- the classes' annotations resolve here (`typing.get_type_hints`)

from .auto_config import AUTO_QUALITY, AutoConfig
from .compression import (
    AQSGD,
    AQSGD_INNER,
    FEEDBACK_KINDS,
    FIRST_VISIT,
    INFERENCE_FALLBACK,
    Compression,
    compression_methods,
)
from .config import CONFIG_NAME, FORMAT_VERSION, check_choice
from .diloco import DILOCO, REPLICA_ENV, DiLoCoConfig
from .memory_config import MEMORY_DTYPES, MEMORY_STORES, MemoryConfig
from .plan import SCHEDULES, Plan, launched_per_replica

# The classes name this package as their module, as before it was split: pickles keep reading
# `hf_actcomp.plan.Plan`, and stay readable by older versions.
for _cls in (AutoConfig, Compression, DiLoCoConfig, MemoryConfig, Plan):
    _cls.__module__ = __name__
del _cls

__all__ = [
    "AQSGD",
    "AQSGD_INNER",
    "AUTO_QUALITY",
    "AutoConfig",
    "CONFIG_NAME",
    "Compression",
    "DILOCO",
    "DiLoCoConfig",
    "FEEDBACK_KINDS",
    "FIRST_VISIT",
    "FORMAT_VERSION",
    "INFERENCE_FALLBACK",
    "MEMORY_DTYPES",
    "MEMORY_STORES",
    "MemoryConfig",
    "Plan",
    "REPLICA_ENV",
    "SCHEDULES",
    "check_choice",
    "compression_methods",
    "launched_per_replica",
]
