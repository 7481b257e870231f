"""ViT image classifiers split into stages: `ViTForImageClassification` with `pixel_values`.

Mirrors `ViTForImageClassification.forward` (transformers 5.x): the patch embeddings (a strided
convolution, the [CLS] token, position embeddings, dropout) run on the first stage, which takes
the batch's `pixel_values` where a text model takes `input_ids`; the layers run as `ViTModel`
calls them, without a mask (every image has the same number of patches, so there is no padding);
the last stage applies the final LayerNorm, takes the [CLS] token and the classifier. The loss is
the sequence classifier's (transformers maps `ForImageClassification` to it): regression, single-
or multi-label as `config.problem_type` says.

What crosses a boundary is (images, patches + 1, hidden): its length comes from the configured
image and patch sizes (`hidden_shape`), not from the input's shape, so the receiving stage sizes
its buffer before the images are read. Images of another size (`interpolate_pos_encoding`) are
not supported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .base import ModelAdapter


class ViTAdapter(ModelAdapter):
    """ViT (`ViTForImageClassification`): patch embeddings, encoder layers, LayerNorm, classifier."""

    model_types = ("vit",)
    blocks_path = "vit.layers"

    def __init__(self, model: nn.Module) -> None:
        if not type(model).__name__.endswith("ForImageClassification"):
            raise ValueError(f"{type(model).__name__}: hf-actcomp splits ViT as an image classifier "
                             "(ViTForImageClassification) only.")
        super().__init__(model)

    def _embedding_paths(self) -> list[str]:
        return ["vit.embeddings"]

    def _head_paths(self) -> list[str]:
        return []  # no causal LM

    def _final_norm_paths(self) -> list[str]:
        return ["vit.layernorm"]

    def final_norm(self, hidden: Tensor) -> Tensor:
        return self.model.get_submodule("vit.layernorm")(hidden)

    def head_paths(self) -> list[str]:
        return ["vit.layernorm", "classifier"]

    def task_head(self, hidden: Tensor, input_ids: Tensor | None = None,
                  attention_mask: Tensor | None = None) -> Tensor:
        """The classifier on the [CLS] token after the final LayerNorm."""
        return self.model.get_submodule("classifier")(self.final_norm(hidden)[:, 0, :])

    def head(self, hidden: Tensor) -> Tensor:
        return self.task_head(hidden)

    def hidden_shape(self, main_input: Tensor) -> tuple[int, int]:
        """(images, patches + 1): the [CLS] token and one position per patch of the configured size."""
        patches = self.model.get_submodule("vit.embeddings.patch_embeddings").num_patches
        return (int(main_input.shape[0]), int(patches) + 1)

    def embed(self, pixel_values: Tensor, attention_mask: Tensor | None) -> Tensor:
        if attention_mask is not None:
            raise ValueError("ViT takes no attention_mask: drop the key from the batch (images are not padded).")
        embeddings = self.model.get_submodule("vit.embeddings")
        weight = embeddings.patch_embeddings.projection.weight
        # As ViTModel: pixel values in the projection's dtype.
        return embeddings(pixel_values.to(weight.dtype) if pixel_values.dtype != weight.dtype else pixel_values)

    def block_context(self, hidden: Tensor, attention_mask: Tensor | None) -> dict[str, Any]:
        return {}

    def run_block(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        return self.blocks()[index](hidden, None)

    def check_batch(self, batch: dict[str, Tensor | None]) -> None:
        check_images(self.model, batch)
        super().check_batch(batch)


def check_images(model: nn.Module, batch: dict[str, Tensor | None]) -> None:
    """Refuse what an image classifier cannot take: `pixel_values` (the batch's main input) that
    are not (images, channels, height, width) floats, or an attention mask."""
    images = batch["input_ids"]
    if not torch.is_floating_point(images) or images.dim() != 4:
        raise ValueError(f"{type(model).__name__} takes pixel_values of shape (images, channels, height, "
                         f"width) as floats; got a {images.dtype} tensor of shape {tuple(images.shape)}.")
    if batch.get("attention_mask") is not None:
        raise ValueError(f"{type(model).__name__} takes no attention_mask: drop the key from the batch (images are "
                         "not padded).")
