"""`torch.compile` for a stage's decoder blocks (`prepare(..., compile=True)`, `simulate(..., compile=True)`).

Each block is compiled on its own, in place, with `nn.Module.compile`, and nothing else is:

- the blocks are the compute: attention and MLP, forward and backward, are nearly all of a
  stage's floating-point work, and the part that a compiler can fuse;
- identical blocks share one compiled graph: dynamo inlines nn modules and takes their parameters
  as graph inputs (torch's default `inline_inbuilt_nn_modules`), so blocks 1..n-1 reuse what block
  0 compiled (guards permitting: a new input shape, `requires_grad` of the input, or `train()`
  against `eval()` compile once more). A stage's compile time is about one block's whatever its depth;
- what lies between the blocks stays eager: the embeddings, the mask and rotary tables (built once
  per micro-batch), the head and the loss, the boundary codecs' state (error feedback, AQ-SGD
  memory, random rounding) and the pipeline's send/recv. A graph never holds a collective or a
  codec's state. The deterministic quantizers' own arithmetic (`quantize`, `hadamard`) is compiled
  apart from the blocks (hf_actcomp/codecs/fused.py); the step's numbers differ from eager by the
  blocks' floating-point reassociation and, where a value lies on a rounding step, by one
  quantization level of the payload. A block's forward hooks (its submodules' too) run inside its
  compiled call: the package's own, the MoE router's recorder (models/router.py) and
  `compressed_inference`'s boundary hooks, are `torch.compiler.disable`d, so they stay eager;
- in place: the block stays the model's own module (no `_orig_mod.` wrapper, as `torch.compile(module)`
  would add), so parameter names, state dicts, `save_pretrained`, PEFT's LoRA layers inside a block
  and transformers' activation checkpointing (which wraps the layer's forward, traced into the
  block's graph) are unchanged. The model's blocks stay compiled after the call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .base import StageModule

# torch.compile's keyword arguments (its first argument, the model, is the block).
COMPILE_KEYWORDS = ("backend", "disable", "dynamic", "fullgraph", "mode", "options")


def compile_options(compile: bool, compile_kwargs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The keyword arguments `compile_blocks` passes to `torch.compile`, or None when `compile` is
    off; checked before anything is built."""
    if not isinstance(compile, bool):
        raise TypeError(f"compile={compile!r}: give True or False (torch.compile's options go in compile_kwargs).")
    if compile_kwargs is None:
        return {} if compile else None
    if not compile:
        raise ValueError("compile_kwargs is given but compile=False: set compile=True to compile the blocks.")
    if not isinstance(compile_kwargs, Mapping):
        raise TypeError(f"compile_kwargs must be a dict of torch.compile's arguments, got {type(compile_kwargs).__name__}.")
    unknown = sorted(set(compile_kwargs) - set(COMPILE_KEYWORDS))
    if unknown:
        raise ValueError(f"compile_kwargs: unknown torch.compile arguments {unknown}; it takes {list(COMPILE_KEYWORDS)}.")
    return dict(compile_kwargs)


def compile_blocks(stages: StageModule | Iterable[StageModule], **compile_kwargs: Any) -> int:
    """Compile the decoder blocks of `stages` (one stage or several), in place, each with
    `block.compile(**compile_kwargs)` (torch.compile's arguments: backend, mode, dynamic, ...).
    The blocks compile at their first call. Returns how many blocks were set to compile."""
    if isinstance(stages, StageModule):
        stages = [stages]
    count = 0
    for stage in stages:
        blocks = stage.adapter.blocks()
        for index in range(stage.start, stage.stop):
            blocks[index].compile(**compile_kwargs)
            count += 1
    return count
