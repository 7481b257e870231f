"""OPT: blocks in `model.decoder.layers`, positions counted from the attention mask.

OPT's learned positions are `cumsum(mask) * mask - 1` (+2 offset inside the embedding), so
left padding shifts them; its optional `project_in`/`project_out` map between the embedding
width and the hidden size, and the LM head is tied to `embed_tokens`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import Cache
from transformers.masking_utils import create_causal_mask

from .base import ModelAdapter


class OPTAdapter(ModelAdapter):
    """Mirrors `OPTDecoder.forward` / `OPTForCausalLM.forward` (transformers 5.x) without a cache,
    and with one (the `*_cached` methods, for split generation)."""

    model_types = ("opt",)
    blocks_path = "model.decoder.layers"

    @property
    def _decoder(self) -> torch.nn.Module:
        return self.model.model.decoder

    def _embedding_paths(self) -> list[str]:
        paths = ["model.decoder.embed_tokens", "model.decoder.embed_positions"]
        if self._decoder.project_in is not None:
            paths.append("model.decoder.project_in")
        return paths

    def _head_paths(self) -> list[str]:
        paths = []
        if self._decoder.final_layer_norm is not None:
            paths.append("model.decoder.final_layer_norm")
        if self._decoder.project_out is not None:
            paths.append("model.decoder.project_out")
        return paths + ["lm_head"]

    def _final_norm_paths(self) -> list[str]:
        return self._head_paths()[:-1]

    def final_norm(self, hidden: Tensor) -> Tensor:
        return self._before_lm_head(hidden)

    @staticmethod
    def _position_mask(hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
        # As OPTDecoder: an all-ones float mask stands in for a missing one (positions only).
        if attention_mask is None:
            return torch.ones(hidden.shape[0], hidden.shape[1], device=hidden.device)
        return attention_mask

    @classmethod
    def _position_ids(cls, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
        mask = cls._position_mask(hidden, attention_mask)
        return (torch.cumsum(mask, dim=1) * mask - 1).long()

    def embed(self, input_ids: torch.LongTensor, attention_mask: Tensor | None) -> Tensor:
        return self._embed_at(input_ids, self._position_mask(input_ids, attention_mask),
                              self._position_ids(input_ids, attention_mask))

    def _embed_at(self, input_ids: torch.LongTensor, position_mask: Tensor, position_ids: Tensor) -> Tensor:
        d = self._decoder
        inputs_embeds = d.embed_tokens(input_ids)
        pos_embeds = d.embed_positions(position_mask, 0, position_ids=position_ids)  # adds OPT's +2
        if d.project_in is not None:
            inputs_embeds = d.project_in(inputs_embeds)
        # OPT applies no dropout to the embeddings.
        return inputs_embeds + pos_embeds.to(inputs_embeds.device)

    def block_context(self, hidden: Tensor, attention_mask: Tensor | None) -> dict[str, Any]:
        self._check_mask(hidden, attention_mask)
        # OPT builds its causal mask without position_ids, from the mask as given (None stays None).
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=None,
        )
        return {"attention_mask": mask, "position_ids": self._position_ids(hidden, attention_mask)}

    def run_block(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        d = self._decoder
        # LayerDrop exactly as OPTDecoder: one draw per layer, in training only.
        if d.training and d.layerdrop > 0.0 and torch.rand([]) < d.layerdrop:
            return hidden
        return d.layers[index](
            hidden,
            attention_mask=context["attention_mask"],
            position_ids=context["position_ids"],
            use_cache=False,
        )

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(self._before_lm_head(hidden)).contiguous()

    def _before_lm_head(self, hidden: Tensor) -> Tensor:
        d = self._decoder
        if d.final_layer_norm is not None:
            hidden = d.final_layer_norm(hidden)
        if d.project_out is not None:
            hidden = d.project_out(hidden)
        return hidden

    # -- with a KV cache ----------------------------------------------------------------------

    def embed_cached(self, input_ids: torch.LongTensor, attention_mask: Tensor | None,
                     position_ids: Tensor) -> Tensor:
        # embed_positions reads only the shape of the mask when position_ids are given.
        shape_only = attention_mask if attention_mask is not None else torch.ones(input_ids.shape[0], 1)
        return self._embed_at(input_ids, shape_only, position_ids)

    def block_context_cached(self, hidden: Tensor, attention_mask: Tensor | None, position_ids: Tensor,
                             cache: Cache, layers: range) -> dict[str, Any]:
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  cache=cache, layer_idx=self._cache_mask_layer(cache, layers))  # no position_ids
        return {"attention_mask": mask, "position_ids": position_ids, "cache": cache}

    def run_block_cached(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        return self._decoder.layers[index](hidden, attention_mask=context["attention_mask"],
                                           position_ids=context["position_ids"], cache=context["cache"],
                                           use_cache=True)

    def head_cached(self, hidden: Tensor) -> Tensor:
        # As OPTForCausalLM with logits_to_keep=1: norm and projection of every position, then the last.
        return self.model.lm_head(self._before_lm_head(hidden)[:, -1:, :])
