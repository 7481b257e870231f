"""DeBERTa-v2 (and v3, the same class) encoders split into stages, with their sequence and token
classifiers and masked LM.

Mirrors `DebertaV2Model.forward` / `DebertaV2Encoder.forward` (transformers 5.x), without
`z_steps` (refused): the embeddings (word, optional absolute positions and segments, LayerNorm,
the padding mask applied, dropout) and, where the config has one, the encoder's convolution after
layer 0 run on the first stage; every stage rebuilds from the 2-D padding mask and the hidden
states' length what each layer reads besides the hidden states: the 4-D mask, the relative
positions (log buckets) and the relative-position embeddings after their LayerNorm.

Those embeddings (`encoder.rel_embeddings`, `encoder.LayerNorm`) are parameters that every layer
reads: every stage holds them (`_context_paths`, `ModelAdapter.shared_parameters`). In one process
(`simulate`, `compressed_inference`) the stages share the very same tensors, so gradients add up
as in the model; across processes each stage holds a copy, the pipeline sums their gradients
over the stages after the backward and counts them once in the clip norm
(`pipeline/gradsync.py`), so every copy takes the same update and stays equal.

The heads: the sequence classifier's context pooler (the first token, dropout, dense,
activation), dropout and classifier; the token classifier's dropout and classifier; the masked
LM's `cls` head (transform, then the decoder tied to the word embeddings: the pipeline's tie
exchange keeps the copies equal). The head of `config.legacy=False`, which reads the word
embeddings at call time instead, is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .base import ModelAdapter
from .heads import MASKED_LM, SEQUENCE_CLASSIFICATION


class DebertaV2Adapter(ModelAdapter):
    """DeBERTa-v2 encoders: sequence and token classifiers, masked LM."""

    model_types = ("deberta-v2",)
    blocks_path = "deberta.encoder.layer"

    def __init__(self, model: nn.Module) -> None:
        name = type(model).__name__
        if name.endswith("ForMaskedLM") and not getattr(model.config, "legacy", True):
            raise ValueError(f"{name}: config.legacy=False (a masked-LM head that reads the word embeddings at call "
                             "time) is not supported; the default head (legacy=True, `cls`, its decoder tied to "
                             "the word embeddings) is.")
        if getattr(model.config, "z_steps", 0) > 1:
            raise ValueError(f"{name}: config.z_steps={model.config.z_steps} (layers re-applied at the end) is not "
                             "supported; it must be 0 or 1.")
        super().__init__(model)
        self.encoder = model.get_submodule("deberta.encoder")

    def _embedding_paths(self) -> list[str]:
        conv = ["deberta.encoder.conv"] if getattr(self.model.deberta.encoder, "conv", None) is not None else []
        return ["deberta.embeddings", *conv]

    def _head_paths(self) -> list[str]:
        return []  # no causal LM

    def _context_paths(self) -> list[str]:
        encoder = self.model.deberta.encoder
        paths = []
        if encoder.relative_attention:
            paths.append("deberta.encoder.rel_embeddings")
            if "layer_norm" in encoder.norm_rel_ebd:
                paths.append("deberta.encoder.LayerNorm")
        return paths

    def _final_norm_paths(self) -> list[str]:
        return []

    def final_norm(self, hidden: Tensor) -> Tensor:
        return hidden

    def head_paths(self) -> list[str]:
        names = [name for name, _ in self.model.named_children() if name != "deberta"]
        return names  # pooler, classifier, dropout (sequence) or dropout, classifier (tokens)

    def task_head(self, hidden: Tensor, input_ids: Tensor | None = None,
                  attention_mask: Tensor | None = None) -> Tensor:
        """As the task's forward: pooler, dropout, classifier; dropout, classifier per token; or the MLM head."""
        model = self.model
        if self.task == MASKED_LM:
            return model.cls(hidden)
        if self.task == SEQUENCE_CLASSIFICATION:
            hidden = model.pooler(hidden)
        return model.classifier(model.dropout(hidden))

    def head(self, hidden: Tensor) -> Tensor:
        return self.task_head(hidden)

    def embed(self, input_ids: torch.LongTensor, attention_mask: Tensor | None,
              token_type_ids: Tensor | None = None) -> Tensor:
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        return self.model.deberta.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, mask=mask)

    def block_context(self, hidden: Tensor, attention_mask: Tensor | None) -> dict[str, Any]:
        self._check_mask(hidden, attention_mask)
        mask = attention_mask if attention_mask is not None else torch.ones(hidden.shape[:2], device=hidden.device)
        encoder = self.encoder
        return {"input_mask": mask, "attention_mask": encoder.get_attention_mask(mask),
                "relative_pos": encoder.get_rel_pos(hidden), "rel_embeddings": encoder.get_rel_embedding()}

    def run_block(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        out, _ = self.blocks()[index](hidden, context["attention_mask"], relative_pos=context["relative_pos"],
                                      rel_embeddings=context["rel_embeddings"])
        if index == 0 and self.encoder.conv is not None:  # the encoder's convolution after layer 0
            out = self.encoder.conv(hidden, out, context["input_mask"])
        return out

    def check_batch(self, batch: dict[str, Tensor | None]) -> None:
        labels = batch.get("labels")
        if (self.task == SEQUENCE_CLASSIFICATION and self.config.problem_type is None and labels is not None
                and labels.is_floating_point() and labels.dim() > 1 and labels.shape[-1] > 1):
            raise ValueError("DeBERTa-v2 with float labels of several columns and no config.problem_type takes a "
                             "soft-label cross-entropy of its own, which hf-actcomp does not mirror: set "
                             "config.problem_type ('multi_label_classification' for independent labels).")
        super().check_batch(batch)

