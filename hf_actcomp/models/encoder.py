"""BERT and RoBERTa: encoders split into stages, with their sequence-classification,
token-classification and masked-LM heads.

Mirrors `BertModel.forward` (transformers 5.x) without a cache: the embeddings module (word,
position and token-type embeddings, LayerNorm, dropout; RoBERTa numbers positions from the
`input_ids` past its padding index) runs on the first stage with the batch's `token_type_ids`;
every stage rebuilds the bidirectional attention mask from the 2-D padding mask with
transformers' `create_bidirectional_mask`; the layers run as `BertEncoder` calls them. The last
stage runs what the task's class puts after the encoder, in its order: BERT's pooler (the first
token's hidden state, dense, tanh) before the classifier's dropout, RoBERTa's classification
head (which takes the first token itself), the token classifier's dropout and classifier, the
masked-LM head (tied to the word embeddings: the pipeline's tie exchange keeps the two copies
equal, as for GPT-2).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.masking_utils import create_bidirectional_mask

from .base import ModelAdapter


class EncoderAdapter(ModelAdapter):
    """BERT and RoBERTa encoders and their task heads (models/heads.py's tasks but the causal LM)."""

    model_types = ("bert", "roberta")
    blocks_path = ""  # set per model: `{base_model_prefix}.encoder.layer`

    def __init__(self, model: nn.Module) -> None:
        self.prefix = model.base_model_prefix
        self.blocks_path = f"{self.prefix}.encoder.layer"
        if getattr(model.config, "is_decoder", False) or type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
            raise ValueError(f"{type(model).__name__}: {model.config.model_type} as a decoder (is_decoder=True, "
                             "a causal LM head) is not supported; hf-actcomp splits its encoder with a sequence "
                             "classification, token classification or masked-LM head.")
        super().__init__(model)

    def _embedding_paths(self) -> list[str]:
        return [f"{self.prefix}.embeddings"]

    def _head_paths(self) -> list[str]:
        return []  # never a causal LM (refused above)

    def _final_norm_paths(self) -> list[str]:
        return []  # the last layer's output is the encoder's

    def final_norm(self, hidden: Tensor) -> Tensor:
        return hidden

    def head_paths(self) -> list[str]:
        """BERT's pooler (sequence classification), then every module the task's class registers
        after the encoder, in its order."""
        base = self.model.get_submodule(self.prefix)
        pooler = [f"{self.prefix}.pooler"] if getattr(base, "pooler", None) is not None else []
        return pooler + [name for name, _ in self.model.named_children() if name != self.prefix]

    def task_head(self, hidden: Tensor, input_ids: Tensor | None = None,
                  attention_mask: Tensor | None = None) -> Tensor:
        for path in self.head_paths():
            hidden = self.model.get_submodule(path)(hidden)
        return hidden

    def embed(self, input_ids: torch.LongTensor, attention_mask: Tensor | None,
              token_type_ids: Tensor | None = None) -> Tensor:
        return self.model.get_submodule(self._embedding_paths()[0])(input_ids=input_ids, token_type_ids=token_type_ids)

    def block_context(self, hidden: Tensor, attention_mask: Tensor | None) -> dict[str, Any]:
        self._check_mask(hidden, attention_mask)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        return {"attention_mask": mask}

    def run_block(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        # `BertEncoder`'s call: the mask positional, no cross-attention, no cache.
        return self.blocks()[index](hidden, context["attention_mask"], None, encoder_attention_mask=None, cache=None)

    def head(self, hidden: Tensor) -> Tensor:
        """The task's logits (an encoder has no causal-LM head: that model is refused above)."""
        return self.task_head(hidden)
