"""Model adapters by `config.model_type`: how each decoder family is split into stages, and
(`heads.py`) what the last stage computes for the model's task: a causal LM's logits, or a
sequence or token classifier's, with the loss exact to the unsplit model's.

Add a family by subclassing `ModelAdapter` and decorating it with `@register_adapter`
(see docs/adding_a_model.md).
"""

from __future__ import annotations

from .base import ModelAdapter, StageModule
from .check import check_adapter
from .compile import compile_blocks
from .decoder import VERIFIED_TYPES, DecoderAdapter, has_standard_layout
from .gpt2 import GPT2Adapter
from .opt import OPTAdapter
from .registry import (
    ADAPTERS,
    get_adapter,
    register_adapter,
    register_standard_decoder,
    supported_model_types,
    unwrap_peft,
)

__all__ = [
    "ADAPTERS",
    "GPT2Adapter",
    "DecoderAdapter",
    "ModelAdapter",
    "OPTAdapter",
    "StageModule",
    "VERIFIED_TYPES",
    "check_adapter",
    "compile_blocks",
    "get_adapter",
    "has_standard_layout",
    "register_adapter",
    "register_standard_decoder",
    "supported_model_types",
    "unwrap_peft",
]
