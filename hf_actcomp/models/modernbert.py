"""ModernBERT encoders split into stages, with their sequence-classification, token-classification
and masked-LM heads.

Mirrors `ModernBertModel.forward` (transformers 5.x, which has no unpadding path): the embeddings
(token embeddings, LayerNorm, dropout) run on the first stage; every stage rebuilds from the 2-D
padding mask what each layer reads: the bidirectional mask of the global layers
(`create_bidirectional_mask`) or the banded one of the local layers
(`create_bidirectional_sliding_window_mask`, `config.local_attention` wide), and the rotary table
of the layer's type (`rotary_emb`, a module without parameters every stage holds) at positions
0..length-1. The last stage applies the final norm, then what the task's class puts after the
encoder, in its order: the sequence classifier's pooling (`config.classifier_pooling`: the first
token, or the mean over the unpadded tokens, which is why the last stage gets the padding mask),
prediction head (dense, activation, norm), dropout and classifier; the token classifier's
prediction head, dropout and classifier on every position; the masked LM's prediction head and
decoder (tied to the token embeddings: the pipeline's tie exchange keeps the copies equal).
`sparse_prediction=True` (the masked LM's logits of the masked tokens only) is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
)

from .base import ModelAdapter
from .heads import MASKED_LM, SEQUENCE_CLASSIFICATION


class ModernBertAdapter(ModelAdapter):
    """ModernBERT encoders: global and local (sliding) attention layers with rotary positions."""

    model_types = ("modernbert",)
    blocks_path = "model.layers"

    def __init__(self, model: nn.Module) -> None:
        name = type(model).__name__
        if name.endswith("ForMaskedLM") and getattr(model.config, "sparse_prediction", False):
            raise ValueError(f"{name}: config.sparse_prediction=True (logits of the masked tokens only) is not "
                             "supported; set it to False (the default): the loss is the same.")
        super().__init__(model)
        self.base = model.get_submodule("model")
        self.pooling = model.config.classifier_pooling  # "cls" or "mean" (the config checks it)

    def _embedding_paths(self) -> list[str]:
        return ["model.embeddings"]

    def _head_paths(self) -> list[str]:
        return []  # no causal LM

    def _context_paths(self) -> list[str]:
        return ["model.rotary_emb"]  # buffers only: nothing to sum over the stages

    def _final_norm_paths(self) -> list[str]:
        return ["model.final_norm"]

    def final_norm(self, hidden: Tensor) -> Tensor:
        return self.base.final_norm(hidden)

    def head_paths(self) -> list[str]:
        """The final norm, then the task's modules: head, dropout, classifier; or head, decoder."""
        task_modules = ["head", "decoder"] if self.task == MASKED_LM else ["head", "drop", "classifier"]
        return self._final_norm_paths() + task_modules

    def task_head(self, hidden: Tensor, input_ids: Tensor | None = None,
                  attention_mask: Tensor | None = None) -> Tensor:
        """As the task's forward after `ModernBertModel`: pooled (sequence classifier) or per token."""
        model = self.model
        hidden = self.final_norm(hidden)
        if self.task == MASKED_LM:
            return model.decoder(model.head(hidden))
        if self.task == SEQUENCE_CLASSIFICATION:
            if self.pooling == "cls":
                hidden = hidden[:, 0]
            else:
                mask = (attention_mask if attention_mask is not None
                        else torch.ones(hidden.shape[:2], device=hidden.device, dtype=torch.bool))
                hidden = (hidden * mask.unsqueeze(-1)).sum(dim=1) / mask.sum(dim=1, keepdim=True)
        return model.classifier(model.drop(model.head(hidden)))

    def head(self, hidden: Tensor) -> Tensor:
        return self.task_head(hidden)

    def embed(self, input_ids: torch.LongTensor, attention_mask: Tensor | None) -> Tensor:
        return self.base.embeddings(input_ids=input_ids)

    def block_context(self, hidden: Tensor, attention_mask: Tensor | None) -> dict[str, Any]:
        self._check_mask(hidden, attention_mask)
        masks = {"config": self.config, "inputs_embeds": hidden, "attention_mask": attention_mask}
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return {
            "masks": {"full_attention": create_bidirectional_mask(**masks),
                      "sliding_attention": create_bidirectional_sliding_window_mask(**masks)},
            "rotary": {kind: self.base.rotary_emb(hidden, positions, kind) for kind in set(self.config.layer_types)},
        }

    def run_block(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        layer = self.blocks()[index]
        kind = layer.attention_type
        return layer(hidden, attention_mask=context["masks"][kind], position_embeddings=context["rotary"][kind])
