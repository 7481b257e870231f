"""The adapter registry: which `ModelAdapter` serves each `config.model_type`, and the lookup
every entry point starts with (`get_adapter`). Kept apart from the package's `__init__` so that
modules inside `models` (the exactness check) can use it without importing their own package."""

from __future__ import annotations

import sys

from torch import nn
from transformers import PreTrainedModel

from .base import ModelAdapter
from .deberta import DebertaV2Adapter
from .decoder import DecoderAdapter, has_standard_layout
from .encoder import EncoderAdapter
from .gpt2 import GPT2Adapter
from .modernbert import ModernBertAdapter
from .opt import OPTAdapter
from .resnet import ResNetAdapter
from .vision import ViTAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {}


def register_adapter(cls: type[ModelAdapter]) -> type[ModelAdapter]:
    """Register `cls` for each of its `model_types`; usable as a class decorator.

    Re-registering the same class is a no-op; a type already served by another class is an
    error (remove it from `ADAPTERS` first to replace a built-in adapter).
    """
    if not (isinstance(cls, type) and issubclass(cls, ModelAdapter)):
        raise TypeError(f"register_adapter expects a ModelAdapter subclass, got {cls!r}.")
    if not cls.model_types:
        raise ValueError(
            f"{cls.__name__}.model_types is empty: name the config.model_type values it serves."
        )
    for model_type in cls.model_types:
        existing = ADAPTERS.get(model_type)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"Model type {model_type!r} is already served by {existing.__name__}; "
                f"delete ADAPTERS[{model_type!r}] first to replace it with {cls.__name__}."
            )
    for model_type in cls.model_types:
        ADAPTERS[model_type] = cls
    return cls


def supported_model_types() -> list[str]:
    """The `config.model_type` values with a registered adapter, sorted: the built-in ones are
    verified by the exactness tests; others are what `register_adapter` or
    `register_standard_decoder` added in this process."""
    return sorted(ADAPTERS)


def register_standard_decoder(model_type: str) -> type[ModelAdapter]:
    """Serve `model_type` with the generic `DecoderAdapter`, for a family that has the standard
    decoder layout but is not verified yet. Check the result with `check_adapter(model)`."""
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type must be a config.model_type string, got {model_type!r}.")
    cls = type(f"DecoderAdapter_{model_type}", (DecoderAdapter,), {"model_types": (model_type,)})
    return register_adapter(cls)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a `peft.PeftModel` (adapter layers injected), else `model`.

    Stages are cut from the inner model, so a stage's parameter names are the transformers names
    (`transformer.h.0.attn.c_attn.lora_A.default.weight`) whether or not an adapter is attached.
    """
    peft = sys.modules.get("peft")  # a PeftModel exists only if peft was imported
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def get_adapter(model: PreTrainedModel) -> ModelAdapter:
    """The adapter for `model` (a causal LM, a classifier or masked LM, or a `peft.PeftModel` of
    one), chosen by `model.config.model_type`."""
    model = unwrap_peft(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    cls = ADAPTERS.get(model_type) if isinstance(model_type, str) else None
    if cls is None:
        message = (
            f"Model type '{model_type}' is not supported. Supported model types: "
            f"{', '.join(supported_model_types())}."
        )
        if has_standard_layout(model):
            message += (
                " It has the standard decoder layout, so the generic adapter may serve it: call "
                f"hf_actcomp.models.register_standard_decoder({model_type!r}), then "
                "hf_actcomp.models.check_adapter(model) to compare the stages' loss and every "
                "gradient with the unsplit model before training."
            )
        raise ValueError(message + " See docs/adding_a_model.md to add an adapter.")
    return cls(model)


for _cls in (GPT2Adapter, OPTAdapter, DecoderAdapter, EncoderAdapter, DebertaV2Adapter, ModernBertAdapter,
             ViTAdapter, ResNetAdapter):
    register_adapter(_cls)
del _cls
