"""Llama-style decoders (Llama, Mistral, Qwen2): `model.layers`, rotary positions, RMSNorm.

One base mirrors `LlamaModel.forward`; the families differ only in which attention mask a
layer gets: Llama always the causal mask, Mistral the sliding-window mask when
`config.sliding_window` is set, Qwen2 a per-layer choice from `config.layer_types`.
Submodule paths are class attributes, so a family laid out differently (GPT-NeoX:
`gpt_neox.embed_in`, `gpt_neox.final_layer_norm`) only overrides names and what differs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .base import ModelAdapter

FULL = "full_attention"
SLIDING = "sliding_attention"


class LlamaAdapter(ModelAdapter):
    """Mirrors `LlamaModel.forward` / `LlamaForCausalLM.forward` (transformers 5.x) without a cache."""

    model_types = ("llama",)
    blocks_path = "model.layers"
    embed_path = "model.embed_tokens"
    norm_path = "model.norm"
    rotary_path = "model.rotary_emb"
    lm_head_path = "lm_head"

    def _module(self, path: str) -> nn.Module:
        return self.model.get_submodule(path)

    def _embedding_paths(self) -> list[str]:
        return [self.embed_path]

    def _head_paths(self) -> list[str]:
        return [self.norm_path, self.lm_head_path]

    def _context_paths(self) -> list[str]:
        return [self.rotary_path]

    def layer_mask_kind(self, index: int) -> str:
        """Which attention mask block `index` receives: "full_attention" or "sliding_attention"."""
        return FULL

    def embed(self, input_ids: torch.LongTensor, attention_mask: Tensor | None) -> Tensor:
        return self._module(self.embed_path)(input_ids)

    def block_context(self, hidden: Tensor, attention_mask: Tensor | None) -> dict[str, Any]:
        self._check_mask(hidden, attention_mask)
        # Positions 0..L-1 whatever the padding, as the model computes them without a cache.
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask_kwargs = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        kinds = {self.layer_mask_kind(i) for i in range(self.num_blocks)}
        masks = {}
        if FULL in kinds:
            masks[FULL] = create_causal_mask(**mask_kwargs)
        if SLIDING in kinds:
            masks[SLIDING] = create_sliding_window_causal_mask(**mask_kwargs)
        # The rotary tables depend only on positions and hidden's dtype/device.
        position_embeddings = self._module(self.rotary_path)(hidden, position_ids=position_ids)
        return {
            "masks": masks,
            "position_ids": position_ids,
            "position_embeddings": position_embeddings,
        }

    def run_block(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        return self.blocks()[index](
            hidden,
            attention_mask=context["masks"][self.layer_mask_kind(index)],
            position_embeddings=context["position_embeddings"],
            position_ids=context["position_ids"],
            past_key_values=None,
            use_cache=False,
        )

    def head(self, hidden: Tensor) -> Tensor:
        return self._module(self.lm_head_path)(self._module(self.norm_path)(hidden))


class MistralAdapter(LlamaAdapter):
    """Mistral: every layer gets the sliding-window mask when `config.sliding_window` is set."""

    model_types = ("mistral",)

    def layer_mask_kind(self, index: int) -> str:
        return FULL if getattr(self.config, "sliding_window", None) is None else SLIDING


class Qwen2Adapter(LlamaAdapter):
    """Qwen2: each layer's mask kind comes from `config.layer_types`."""

    model_types = ("qwen2",)

    def layer_mask_kind(self, index: int) -> str:
        return self.config.layer_types[index]
