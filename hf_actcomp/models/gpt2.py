"""GPT-2: blocks in `transformer.h`, learned absolute positions, LM head tied to `wte`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import Cache
from transformers.masking_utils import create_causal_mask

from .base import ModelAdapter


class GPT2Adapter(ModelAdapter):
    """Mirrors `GPT2Model.forward` / `GPT2LMHeadModel.forward` (transformers 5.x) without a cache,
    and with one (the `*_cached` methods, for split generation)."""

    model_types = ("gpt2",)
    blocks_path = "transformer.h"

    def _embedding_paths(self) -> list[str]:
        return ["transformer.wte", "transformer.wpe", "transformer.drop"]

    def _head_paths(self) -> list[str]:
        return ["transformer.ln_f", "lm_head"]

    def _final_norm_paths(self) -> list[str]:
        return ["transformer.ln_f"]

    def final_norm(self, hidden: Tensor) -> Tensor:
        return self.model.transformer.ln_f(hidden)

    @staticmethod
    def _position_ids(hidden: Tensor) -> Tensor:
        # GPT-2 numbers positions 0..L-1 whatever the padding (no cache: past length 0).
        return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)

    def embed(self, input_ids: torch.LongTensor, attention_mask: Tensor | None) -> Tensor:
        return self.embed_cached(input_ids, attention_mask, self._position_ids(input_ids))

    def block_context(self, hidden: Tensor, attention_mask: Tensor | None) -> dict[str, Any]:
        self._check_mask(hidden, attention_mask)
        position_ids = self._position_ids(hidden)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=None,
            position_ids=position_ids,
        )
        return {"attention_mask": mask, "position_ids": position_ids}

    def run_block(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        # The block's second positional parameter is the cache (left at None): the rest by keyword.
        return self.model.transformer.h[index](
            hidden,
            attention_mask=context["attention_mask"],
            encoder_hidden_states=None,
            encoder_attention_mask=None,
            use_cache=False,
            position_ids=context["position_ids"],
        )

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(self.model.transformer.ln_f(hidden))

    # -- with a KV cache ----------------------------------------------------------------------

    def embed_cached(self, input_ids: torch.LongTensor, attention_mask: Tensor | None,
                     position_ids: Tensor) -> Tensor:
        t = self.model.transformer
        inputs_embeds = t.wte(input_ids)
        position_embeds = t.wpe(position_ids)
        return t.drop(inputs_embeds + position_embeds.to(inputs_embeds.device))

    def block_context_cached(self, hidden: Tensor, attention_mask: Tensor | None, position_ids: Tensor,
                             cache: Cache, layers: range) -> dict[str, Any]:
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  cache=cache, position_ids=position_ids,
                                  layer_idx=self._cache_mask_layer(cache, layers))
        return {"attention_mask": mask, "position_ids": position_ids, "cache": cache}

    def run_block_cached(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        return self.model.transformer.h[index](
            hidden, context["cache"], context["attention_mask"], None, encoder_attention_mask=None,
            use_cache=True, position_ids=context["position_ids"],
        )
