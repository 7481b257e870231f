"""ResNet image classifiers split into stages: `ResNetForImageClassification` with `pixel_values`.

Mirrors `ResNetForImageClassification.forward` (transformers 5.x): the stem (a 7x7 convolution of
stride 2, BatchNorm, activation, a 3x3 max-pool of stride 2) runs on the first stage; the blocks
are the residual layers of every ResNet stage, in order (`resnet.encoder.stages.{s}.layers.{l}`:
`ResNetStage` only chains its layers, so a cut may fall inside one); the last stage runs the
adaptive average pool and the classifier (flatten, linear). The loss is the model's
(`ForImageClassification` maps to the sequence classifier's: regression, single- or multi-label as
`config.problem_type` says); its forward passes no item count to it, so it never divides by one.

What crosses a boundary is a feature map (images, channels, height, width), whose channels and
resolution change with depth: `boundary_shape` works them out from the input images' size and the
config (every convolution pads to keep `ceil(size / stride)`), so a receiving stage sizes its
buffer before data arrives. Codecs see it as it is; `Plan.auto`, which assumes one shape for
every boundary, is refused.

BatchNorm normalises by the statistics of the batch it is given. Cut into micro-batches, each
micro-batch is normalised by its own (and updates the running statistics once), exactly as the
unsplit model does under gradient accumulation over those micro-batches; one micro-batch gives
the unsplit model's step on the whole batch.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .base import ModelAdapter
from .vision import check_images


def _strided(size: int, stride: int) -> int:
    """A spatial size after a convolution or pool of `stride` padded to keep ceil(size / stride)
    (kernel k, padding k // 2, odd k; the stem's max-pool: kernel 3, padding 1)."""
    return (size - 1) // stride + 1


class ResNetAdapter(ModelAdapter):
    """ResNet (`ResNetForImageClassification`): stem, residual layers, pooled classifier."""

    model_types = ("resnet",)
    blocks_path = "resnet.encoder.stages"  # a list of stages of layers: `block_paths` flattens it
    uniform_boundaries = False

    def __init__(self, model: nn.Module) -> None:
        if not type(model).__name__.endswith("ForImageClassification"):
            raise ValueError(f"{type(model).__name__}: hf-actcomp splits ResNet as an image classifier "
                             "(ResNetForImageClassification) only.")
        super().__init__(model)
        config = model.config
        # (channels, stride) after each block, in order: a stage's first layer downsamples (the
        # first stage's only with `downsample_in_first_stage`), the others keep the size.
        self._after = [(config.hidden_sizes[s], (2 if s > 0 or config.downsample_in_first_stage else 1) if i == 0 else 1)
                       for s, depth in enumerate(config.depths) for i in range(depth)]

    def blocks(self) -> nn.ModuleList:
        if getattr(self, "_blocks", None) is None:  # built once: run_block reads it every block
            self._blocks = nn.ModuleList(self.model.get_submodule(path) for path in self.block_paths())
        return self._blocks

    def block_paths(self) -> list[str]:
        stages = self.model.get_submodule(self.blocks_path)
        return [f"{self.blocks_path}.{s}.layers.{i}" for s, stage in enumerate(stages) for i in range(len(stage.layers))]

    def _embedding_paths(self) -> list[str]:
        return ["resnet.embedder"]

    def _head_paths(self) -> list[str]:
        return []  # no causal LM

    def _final_norm_paths(self) -> list[str]:
        return []  # the last layer's output is the encoder's

    def final_norm(self, hidden: Tensor) -> Tensor:
        return hidden

    def head_paths(self) -> list[str]:
        return ["resnet.pooler", "classifier"]

    def task_head(self, hidden: Tensor, input_ids: Tensor | None = None,
                  attention_mask: Tensor | None = None) -> Tensor:
        """The classifier (flatten, linear) on the average-pooled last feature map."""
        return self.model.classifier(self.model.resnet.pooler(hidden))

    def head(self, hidden: Tensor) -> Tensor:
        return self.task_head(hidden)

    def boundary_shape(self, main_input: Tensor, block: int) -> tuple[int, ...]:
        """(images, channels, height, width) entering block `block`, from the images' size."""
        height, width = int(main_input.shape[-2]), int(main_input.shape[-1])
        height, width = (_strided(_strided(size, 2), 2) for size in (height, width))  # the stem
        channels = int(self.config.embedding_size)
        for channels_after, stride in self._after[:block]:
            channels, height, width = channels_after, _strided(height, stride), _strided(width, stride)
        return (int(main_input.shape[0]), channels, height, width)

    def takes_item_count(self, labels: Tensor | None) -> bool:
        return False  # the forward calls its loss without the count Trainer passes

    def embed(self, pixel_values: Tensor, attention_mask: Tensor | None) -> Tensor:
        return self.model.resnet.embedder(pixel_values)

    def block_context(self, hidden: Tensor, attention_mask: Tensor | None) -> dict[str, Any]:
        return {}

    def run_block(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        return self.blocks()[index](hidden)

    def check_batch(self, batch: dict[str, Tensor | None]) -> None:
        check_images(self.model, batch)
        super().check_batch(batch)
