"""The standard Hugging Face decoder layout: one adapter for Llama, Mistral, Qwen, Gemma, ...

Most causal LMs in transformers 5.x share one forward: `model.embed_tokens` ->
`model.layers[i](hidden, attention_mask=mask_of(layer_types[i]), position_embeddings=...)`
-> `model.norm` -> `lm_head`. They differ only in data the config and modules already carry:

- which mask a layer gets: `config.layer_types` (Qwen2/3, Gemma 2/3), else the sliding-window
  mask when `config.sliding_window` is set (Mistral, Phi-3, Mixtral), else the causal mask;
- rotary tables per layer type when the rotary module takes a `layer_type` (Gemma 3);
- Gemma's embedding scale, which lives inside its embedding module, and its final logit
  soft-capping (`config.final_logit_softcapping`), applied by `head`.

`DecoderAdapter` reads the module names from the config's `base_model_pp_plan` (the pipeline
plan transformers declares for these models) and the head from the model's `_pp_plan`, with
the standard names as fallback, and builds masks and rotary tables with transformers' own
helpers. Every family listed in `VERIFIED_TYPES` passes the exactness tests of
tests/test_models.py; other families with this layout can be tried with
`register_standard_decoder`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from transformers import Cache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .base import ModelAdapter

FULL = "full_attention"
SLIDING = "sliding_attention"
MASK_FUNCTIONS = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
STANDARD_PLAN_KEYS = {"embed_tokens", "layers", "norm"}  # base_model_pp_plan of the standard layout

VERIFIED_TYPES = (
    "gemma2",
    "gemma3_text",
    "llama",
    "mistral",
    "mixtral",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen3",
)


class DecoderAdapter(ModelAdapter):
    """Mirrors `LlamaModel.forward` / `LlamaForCausalLM.forward` (transformers 5.x), without a
    cache and with one (the `*_cached` methods, for split generation), and the per-family
    variations listed in the module docstring."""

    model_types = VERIFIED_TYPES
    blocks_path = "model.layers"
    embed_path = "model.embed_tokens"
    norm_path = "model.norm"
    rotary_path = "model.rotary_emb"
    lm_head_path = "lm_head"

    def __init__(self, model: nn.Module) -> None:
        self._paths_from_pp_plan(model)
        super().__init__(model)
        self._refuse_unsupported_features()
        # Gemma 3 keeps one rotary table per layer type: `rotary_emb(x, pos, layer_type)`.
        forward = self._module(self.rotary_path).forward
        self._per_layer_type_rotary = "layer_type" in inspect.signature(forward).parameters

    def _paths_from_pp_plan(self, model: nn.Module) -> None:
        """When the class's module paths are not in `model`, take them from the pipeline plans
        transformers declares: `config.base_model_pp_plan` (under `base_model_prefix`) and the
        causal LM's `_pp_plan` (the head)."""
        names = {name for name, _ in model.named_modules()}
        prefix = getattr(model, "base_model_prefix", "") or ""
        plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
        if self.blocks_path not in names and prefix and STANDARD_PLAN_KEYS <= set(plan):
            self.embed_path = f"{prefix}.embed_tokens"
            self.blocks_path = f"{prefix}.layers"
            self.norm_path = f"{prefix}.norm"
            self.rotary_path = f"{prefix}.rotary_emb"
        head_plan = getattr(model, "_pp_plan", None) or {}
        if self.lm_head_path not in names and len(head_plan) == 1:
            self.lm_head_path = next(iter(head_plan))

    def _refuse_unsupported_features(self) -> None:
        """Features a stage cannot reproduce from the hidden states and the 2-D mask alone."""
        config = self.config
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError(
                f"{config.model_type}: use_bidirectional_attention=True (an encoder-style mask) "
                "is not supported; hf-actcomp splits causal LMs. Set it to False."
            )
        if len(self.blocks()) != config.num_hidden_layers:
            raise ValueError(
                f"{config.model_type}: the model has {len(self.blocks())} layers but "
                f"config.num_hidden_layers={config.num_hidden_layers}; they must agree."
            )

    def _module(self, path: str) -> nn.Module:
        return self.model.get_submodule(path)

    def _embedding_paths(self) -> list[str]:
        return [self.embed_path]

    def _head_paths(self) -> list[str]:
        return [self.norm_path, self.lm_head_path]

    def _final_norm_paths(self) -> list[str]:
        return [self.norm_path]

    def final_norm(self, hidden: Tensor) -> Tensor:
        return self._module(self.norm_path)(hidden)

    def _context_paths(self) -> list[str]:
        return [self.rotary_path]

    def layer_mask_kind(self, index: int) -> str:
        """Which attention mask block `index` receives: "full_attention" or "sliding_attention"."""
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None:
            return layer_types[index]
        return FULL if getattr(self.config, "sliding_window", None) is None else SLIDING

    def _rotary_per_layer_type(self) -> bool:
        """Whether the rotary module builds one table per layer type (inspected once, at init)."""
        return self._per_layer_type_rotary

    def embed(self, input_ids: torch.LongTensor, attention_mask: Tensor | None) -> Tensor:
        # Gemma's sqrt(hidden) scale is inside its embedding module.
        return self._module(self.embed_path)(input_ids)

    def block_context(self, hidden: Tensor, attention_mask: Tensor | None) -> dict[str, Any]:
        self._check_mask(hidden, attention_mask)
        # Positions 0..L-1 whatever the padding, as the model computes them without a cache.
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask_kwargs = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=None,
            position_ids=position_ids,
        )
        kinds = {self.layer_mask_kind(i) for i in range(self.num_blocks)}
        masks = {}
        if FULL in kinds:
            masks[FULL] = create_causal_mask(**mask_kwargs)
        if SLIDING in kinds:
            masks[SLIDING] = create_sliding_window_causal_mask(**mask_kwargs)
        return {
            "masks": masks,
            "position_ids": position_ids,
            "position_embeddings": self._rotary_tables(hidden, position_ids, kinds),
        }

    def _rotary_tables(self, hidden: Tensor, position_ids: Tensor, kinds: set[str]) -> dict[str, Any]:
        """The rotary `position_embeddings` of each mask kind (they depend only on positions and
        hidden's dtype/device): one table per kind, or one shared by all."""
        rotary = self._module(self.rotary_path)
        if self._rotary_per_layer_type():
            return {kind: rotary(hidden, position_ids, kind) for kind in kinds}
        table = rotary(hidden, position_ids=position_ids)
        return dict.fromkeys(kinds, table)

    def run_block(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        return self._call_block(index, hidden, context, use_cache=False)

    def _call_block(self, index: int, hidden: Tensor, context: dict[str, Any], **cache: Any) -> Tensor:
        """Block `index` with the context of its mask kind; `cache`: the cache keywords."""
        kind = self.layer_mask_kind(index)
        return self.blocks()[index](
            hidden,
            attention_mask=context["masks"][kind],
            position_embeddings=context["position_embeddings"][kind],
            position_ids=context["position_ids"],
            **cache,
        )

    def head(self, hidden: Tensor) -> Tensor:
        logits = self._module(self.lm_head_path)(self._module(self.norm_path)(hidden))
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:  # Gemma 2 (and Gemma 3 when set): cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- with a KV cache ----------------------------------------------------------------------

    def embed_cached(self, input_ids: torch.LongTensor, attention_mask: Tensor | None,
                     position_ids: Tensor) -> Tensor:
        return self.embed(input_ids, attention_mask)  # no positions in the standard layout's embeddings

    def block_context_cached(self, hidden: Tensor, attention_mask: Tensor | None, position_ids: Tensor,
                             cache: Cache, layers: range) -> dict[str, Any]:
        # Only the mask kinds of this stage's layers, each sized by one of its own cache layers.
        kinds = {self.layer_mask_kind(i) for i in layers}
        masks = {kind: MASK_FUNCTIONS[kind](config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                            cache=cache, position_ids=position_ids,
                                            layer_idx=self._cache_mask_layer(cache, layers, kind == SLIDING))
                 for kind in kinds}
        return {"masks": masks, "position_ids": position_ids, "cache": cache,
                "position_embeddings": self._rotary_tables(hidden, position_ids, kinds)}

    def run_block_cached(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        return self._call_block(index, hidden, context, cache=context["cache"], use_cache=True)


def has_standard_layout(model: nn.Module) -> bool:
    """Whether `model` has the standard decoder modules (`model.embed_tokens`, `model.layers`,
    `model.norm`, `lm_head`) or declares them in `config.base_model_pp_plan`."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None) or {}
    if STANDARD_PLAN_KEYS <= set(plan):
        return True
    names = {name for name, _ in model.named_modules()}
    return {"model.embed_tokens", "model.layers", "model.norm", "lm_head"} <= names
