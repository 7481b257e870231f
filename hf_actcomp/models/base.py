"""What a model family must provide to be split into pipeline stages, and the stage module.

An adapter mirrors its family's `forward` piece by piece (embeddings, the context every block
needs, one block, the head) so that running the pieces in order reproduces the full model's
logits and gradients exactly. The block context is rebuilt by each stage from the 2-D
attention mask alone, so only hidden states ever cross a stage boundary.

It also mirrors the same forward with a KV cache, on the new tokens only (`embed_cached`,
`block_context_cached`, `run_block_cached`, `head_cached`), which split generation
(`hf_actcomp.split_generation.CachedStage`, `Pipeline.generate`) runs in the same order.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn
from transformers import Cache, PreTrainedModel

from .heads import (
    CAUSAL_LM,
    SEQUENCE_CLASSIFICATION,
    check_rows,
    classification_loss,
    head_module_paths,
    last_non_pad_logits,
    takes_item_count,
    task_of,
)


class CachedForward(Protocol):
    """The forward with a KV cache, on the new tokens only, that split generation
    (`hf_actcomp.split_generation.CachedStage`) runs in `StageModule.forward`'s order: the methods an
    adapter adds to `ModelAdapter` to generate split (`ModelAdapter.has_cached_forward`).

    Positions and masks come from the 2-D mask as `generate` builds them (positions
    `cumsum - 1`, pads 0; `attention_mask` None when there is no padding at all)."""

    def embed_cached(self, input_ids: torch.LongTensor, attention_mask: Tensor | None,
                     position_ids: Tensor) -> Tensor:
        """Hidden states of the new tokens `input_ids` at `position_ids`; `attention_mask`: the
        2-D mask of every token so far (None: no padding)."""

    def block_context_cached(self, hidden: Tensor, attention_mask: Tensor | None, position_ids: Tensor,
                             cache: Cache, layers: range) -> dict[str, Any]:
        """What blocks `layers` (this stage's) need to run the new tokens `hidden` against `cache`
        (a `transformers.DynamicCache` of every layer of the model), the cache included."""

    def run_block_cached(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        """Apply block `index` (global index) to the new tokens, updating the cache in `context`."""


class ModelAdapter(abc.ABC):
    """Base class of the per-family adapters; subclasses name their submodules and mirror forward.

    Subclasses set `model_types`, `blocks_path`, and implement `_embedding_paths`,
    `_head_paths`, `embed`, `block_context`, `run_block` and `head`; for split generation
    (`Pipeline.generate`) also `CachedForward`'s `embed_cached`, `block_context_cached` and
    `run_block_cached` (and `head_cached` where the family's forward slices the last position
    elsewhere). For the family's sequence and token classifiers (`models/heads.py`) also
    `_final_norm_paths` and `final_norm`: what runs between the last block and the task head.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    blocks_path: ClassVar[str] = ""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = model.config
        # E.g. a bare LlamaModel (no head) instead of LlamaForCausalLM: a ValueError naming the class.
        self.task = task_of(model)
        if self.task != CAUSAL_LM and not hasattr(self, "final_norm"):
            raise ValueError(f"{type(self).__name__} splits the causal LM of {'/'.join(self.model_types)} only: "
                             f"{type(model).__name__} ({self.task}) needs the adapter's `_final_norm_paths` and "
                             "`final_norm` (docs/adding_a_model.md).")
        # A decoder classifier's head modules after the final norm, found once (an adapter with
        # its own head_paths, the encoders', names them itself).
        uses_generic_head = self.task != CAUSAL_LM and type(self).head_paths is ModelAdapter.head_paths
        self._task_modules = head_module_paths(model, self.task) if uses_generic_head else []
        try:
            for path in (
                self.blocks_path,
                *self._embedding_paths(),
                *self.head_paths(),
                *self._context_paths(),
            ):
                model.get_submodule(path)
        except AttributeError as err:
            raise ValueError(
                f"{type(self).__name__} expects a causal LM, sequence or token classifier of "
                f"{'/'.join(self.model_types)}; {type(model).__name__} lacks a submodule: {err}"
            ) from err
        # Whether the embeddings take an encoder's segments: looked up once, not every step.
        self._takes_segments = "token_type_ids" in inspect.signature(self.embed).parameters

    # -- structure ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks())

    def blocks(self) -> nn.ModuleList:
        """The model's transformer blocks, in order."""
        return self.model.get_submodule(self.blocks_path)

    def block_paths(self) -> list[str]:
        """The dotted path (in the model) of each block, in order: `{blocks_path}.{i}`; a family
        whose blocks sit in several lists (ResNet's stages of layers) names them itself."""
        return [f"{self.blocks_path}.{i}" for i in range(self.num_blocks)]

    @abc.abstractmethod
    def _embedding_paths(self) -> list[str]:
        """Dotted paths (in the model) of the modules run before block 0."""

    @abc.abstractmethod
    def _head_paths(self) -> list[str]:
        """Dotted paths (in the model) of the modules run after the last block."""

    def _context_paths(self) -> list[str]:
        """Modules every stage needs to build its block context (rotary tables; DeBERTa-v2's
        relative-position embeddings, which have parameters: `shared_parameters`).

        Registered in every stage so that moving a stage to a device moves their buffers too.
        """
        return []

    def shared_parameters(self) -> list[str]:
        """Names of the parameters every stage holds (those of `_context_paths`' modules): their
        gradients are summed over the stages and every copy takes the same update."""
        return [f"{path}.{name}" for path in self._context_paths()
                for name, _ in self.model.get_submodule(path).named_parameters()]

    def embedding_modules(self) -> list[nn.Module]:
        return [self.model.get_submodule(p) for p in self._embedding_paths()]

    def head_modules(self) -> list[nn.Module]:
        return [self.model.get_submodule(p) for p in self.head_paths()]

    # A family that also splits as a classifier defines `_final_norm_paths()` (dotted paths of
    # what runs between the last block and the task head) and `final_norm(hidden)` (the last
    # block's output as the base model returns it); without them a classifier is refused above.

    def head_paths(self) -> list[str]:
        """Dotted paths of the modules run after the last block, for this model's task."""
        if self.task == CAUSAL_LM:
            return self._head_paths()
        return self._final_norm_paths() + self._task_modules

    def tied_weights(self) -> list[tuple[str, str]]:
        """Pairs (later name, first name) of model parameters that are the same tensor.

        Found by identity rather than from the config, so it reflects what the model really
        shares (e.g. `("lm_head.weight", "transformer.wte.weight")` for GPT-2). A tie within the
        head (BERT's `cls.predictions.bias` and its decoder's bias) stays on one stage: not listed.
        """
        first: dict[int, str] = {}
        pairs: list[tuple[str, str]] = []
        heads = tuple(f"{path}." for path in self.head_paths())
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if id(param) in first:
                if not (name.startswith(heads) and first[id(param)].startswith(heads)):  # not within one head
                    pairs.append((name, first[id(param)]))
            else:
                first[id(param)] = name
        return pairs

    # -- computation -------------------------------------------------------------------------

    @abc.abstractmethod
    def embed(self, input_ids: torch.LongTensor, attention_mask: Tensor | None) -> Tensor:
        """Hidden states entering block 0, exactly as the full model computes them."""

    @abc.abstractmethod
    def block_context(self, hidden: Tensor, attention_mask: Tensor | None) -> dict[str, Any]:
        """Keyword arguments the blocks need, built from the 2-D mask and `hidden`'s shape only."""

    @abc.abstractmethod
    def run_block(self, index: int, hidden: Tensor, context: dict[str, Any]) -> Tensor:
        """Apply block `index` (global index) to `hidden`."""

    @abc.abstractmethod
    def head(self, hidden: Tensor) -> Tensor:
        """Logits from the last block's output."""

    def task_head(self, hidden: Tensor, input_ids: Tensor | None = None,
                  attention_mask: Tensor | None = None) -> Tensor:
        """The model's logits from the last block's output, for its task: the causal LM's `head`;
        a classifier's head after `final_norm` (a sequence classifier's pooled at each row's last
        non-pad token of `input_ids`). `attention_mask`: the 2-D padding mask, for a family that
        pools over the unpadded tokens (ModernBERT's mean pooling)."""
        if self.task == CAUSAL_LM:
            return self.head(hidden)
        hidden = self.final_norm(hidden)
        for path in self._task_modules:
            hidden = self.model.get_submodule(path)(hidden)
        if self.task == SEQUENCE_CLASSIFICATION:
            return last_non_pad_logits(hidden, input_ids, self.config)
        return hidden

    def loss(self, logits: Tensor, labels: Tensor, normaliser=None, loss_function=None) -> Tensor:
        """The loss of a micro-batch's logits: the sum of its terms over `normaliser` (the step's
        `batching.count_items`), or the model's own mean without one. A causal LM's goes through
        `loss_function` (default: the model's `loss_function`), as its forward does."""
        if self.task == CAUSAL_LM:
            function = loss_function or self.model.loss_function
            return function(logits, labels, vocab_size=self.config.vocab_size, num_items_in_batch=normaliser)
        return classification_loss(self.task, self.config, logits, labels, normaliser)

    def hidden_shape(self, main_input: Tensor) -> tuple[int, int]:
        """(rows, positions) of the hidden states the blocks see for the batch's main input: a
        text model's `input_ids` shape; an image model's from its patches (models/vision.py)."""
        return (int(main_input.shape[0]), int(main_input.shape[1]))

    # Whether every boundary carries the same shape (transformers: (rows, positions, hidden));
    # not so for a convolutional model, whose channels and resolution change with depth.
    uniform_boundaries: ClassVar[bool] = True

    def boundary_shape(self, main_input: Tensor, block: int) -> tuple[int, ...]:
        """The shape of the hidden states entering block `block` (`num_blocks`: leaving the last)
        for the batch's main input, known before any data arrives: what a receiving stage
        allocates. (rows, positions, `config.hidden_size`) unless the family says otherwise."""
        return (*self.hidden_shape(main_input), int(self.config.hidden_size))

    def takes_item_count(self, labels: Tensor | None) -> bool:
        """Whether the model's own forward divides its loss by a `num_items_in_batch` it is given
        (`heads.takes_item_count`; a family whose forward drops the count says no)."""
        return takes_item_count(self.task, self.config, labels)

    def check_batch(self, batch: dict[str, Tensor | None]) -> None:
        """Refuse, before any work and on every rank alike, what this model cannot take: a
        sequence classifier's rows without a pad token, segments (`token_type_ids`) for a model
        whose embeddings take none."""
        check_rows(self.task, self.config, batch["input_ids"].shape[0])
        if batch.get("token_type_ids") is not None and not self._takes_segments:
            raise ValueError(f"{type(self.model).__name__} (through hf-actcomp's stages) takes no token_type_ids: "
                             "they are an encoder's segments. Drop the key from the batch (the tokenizer's "
                             "return_token_type_ids=False).")

    def build_stage(self, start: int, stop: int, *, first: bool, last: bool) -> StageModule:
        """Blocks [start, stop), with the embeddings if `first` and the head if `last`."""
        return StageModule(self, start, stop, first=first, last=last)

    # -- computation with a KV cache (split generation) ---------------------------------------
    # The cached forward is optional (`CachedForward`): a family without it still trains, and
    # split generation refuses it before any work.

    CACHED_METHODS: ClassVar[tuple[str, ...]] = ("embed_cached", "block_context_cached", "run_block_cached")

    @classmethod
    def has_cached_forward(cls) -> bool:
        """Whether the family implements the cached forward (every method of `CACHED_METHODS`,
        the interface `CachedForward` describes)."""
        return all(callable(getattr(cls, name, None)) for name in cls.CACHED_METHODS)

    def head_cached(self, hidden: Tensor) -> Tensor:
        """The logits of the last position of the last block's output."""
        return self.head(hidden[:, -1:, :])

    # -- helpers for subclasses --------------------------------------------------------------

    @staticmethod
    def _cache_mask_layer(cache: Cache, layers: range, sliding: bool = False) -> int:
        """The first of `layers` whose cache layer is sliding (or not): it must size that kind of
        4-D mask (`layer_idx`); the default, the model's first such layer, is empty in later stages."""
        return next((i for i in layers if bool(cache.is_sliding[i]) == sliding), layers.start)

    @staticmethod
    def _check_mask(hidden: Tensor, attention_mask: Tensor | None) -> None:
        if attention_mask is None:
            return
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
            raise ValueError(
                "attention_mask must be a 2-D (batch, length) padding mask matching the "
                f"hidden states {tuple(hidden.shape[:2])}, got shape {tuple(attention_mask.shape)}."
            )


class _Container(nn.Module):
    """An empty module used only to reproduce the model's dotted paths inside a stage."""

    def forward(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - never called
        raise RuntimeError("_Container is a namespace, not a layer")


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` under `root` at dotted `path`, creating containers along the way."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        child = dict(node.named_children()).get(name)
        if child is None:
            child = _Container()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


class StageModule(nn.Module):
    """Blocks [start, stop) of the model plus the embeddings if first and the head if last.

    Holds references to the ORIGINAL submodules (no copies), so in one process the stages share
    parameters with the model. Submodules are registered under the same dotted paths as in the
    model, so a stage's parameter names are the model's names (`lm_head.weight` for a tied head).
    """

    def __init__(
        self, adapter: ModelAdapter, start: int, stop: int, *, first: bool, last: bool
    ) -> None:
        super().__init__()
        n = adapter.num_blocks
        if not 0 <= start <= stop <= n:
            raise ValueError(f"Invalid block range [{start}, {stop}) for a model with {n} blocks.")
        if first and start != 0:
            raise ValueError(f"The first stage must start at block 0, not {start}.")
        if last and stop != n:
            raise ValueError(f"The last stage must end at block {n}, not {stop}.")
        self.start, self.stop, self.first, self.last = start, stop, first, last
        # A plain attribute (not a submodule): the adapter's model must not be registered here.
        self._adapter = adapter
        paths: list[str] = []
        if first:
            paths += adapter._embedding_paths()
        paths += adapter.block_paths()[start:stop]
        if last:
            paths += adapter.head_paths()
        paths += adapter._context_paths()
        model = adapter.model
        for path in paths:
            _attach(self, path, model.get_submodule(path))

    @property
    def adapter(self) -> ModelAdapter:
        return self._adapter

    def forward(self, x: Tensor, attention_mask: Tensor | None = None, input_ids: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """First stage: `x` is input_ids; otherwise hidden states. Returns logits if last
        (`input_ids`: the batch's, where a sequence classifier pools at the last non-pad token;
        `token_type_ids`: an encoder's segments, for its embeddings)."""
        adapter = self._adapter
        if self.first:
            segments = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
            hidden = adapter.embed(x, attention_mask, **segments)
        else:
            hidden = x
        if self.stop > self.start:
            context = adapter.block_context(hidden, attention_mask)
            for index in range(self.start, self.stop):
                hidden = adapter.run_block(index, hidden, context)
        if not self.last:
            return hidden
        return adapter.task_head(hidden, x if self.first and input_ids is None else input_ids, attention_mask)

    def extra_repr(self) -> str:
        return f"blocks=[{self.start}, {self.stop}), first={self.first}, last={self.last}"
