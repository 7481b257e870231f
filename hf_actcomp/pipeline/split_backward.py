"""A stage's backward in two passes, for zero-bubble schedules: the input gradient now, the weight
gradient later.

The stage upstream waits for the input gradient (`B`); nobody waits for the weight gradient
(`W`), which a schedule can move into time the stage would otherwise idle. Computing them apart
without doing the backward twice needs autograd's graph: the `B` pass records the gradients that
reach the nodes feeding the weights, and the `W` pass starts from them. torch.distributed.pipelining
does exactly this in `stage_backward_input` / `stage_backward_weight` (private in torch 2.13); they
are used here, in this one module, and tests/test_pipeline.py fails loudly when a torch release
renames or changes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight


def weights_of(stage: nn.Module) -> list[nn.Parameter]:
    """The parameters a weight gradient is computed for: the stage's trainable ones."""
    return [p for p in stage.parameters() if p.requires_grad]


def input_gradient(output: torch.Tensor, output_grad: torch.Tensor | None, x: torch.Tensor,
                   weights: list[nn.Parameter]) -> list[dict[str, Any]]:
    """Backpropagate `output` (the loss when `output_grad` is None) to the stage input `x` only:
    `x.grad` is set (accumulated). Returns what `weight_gradient` needs; the graph is kept until
    then, and the output's side of it is freed now."""
    _, groups = stage_backward_input([output], None if output_grad is None else [output_grad], [x], iter(weights))
    return groups


def weight_gradient(weights: list[nn.Parameter], groups: list[dict[str, Any]]) -> None:
    """Accumulate the weight gradients of one micro-batch into `p.grad`, from what
    `input_gradient` recorded; the rest of its graph is freed."""
    stage_backward_weight(iter(weights), groups)
