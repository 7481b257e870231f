"""A stage's backward in two passes, for zero-bubble schedules: the input gradient now, the weight
gradient later.

The stage upstream waits for the input gradient (`B`); nobody waits for the weight gradient (`W`),
which a schedule can move into time the stage would otherwise idle. The weight gradients worth
moving are the matrix products of the stage's linear layers (`nn.Linear`, GPT-2's `Conv1D`): during
a micro-batch's `B` (`WeightGradients.deferring`), each such layer computes its input's gradient
and keeps what its weight's gradient needs (its input and its output's gradient); that
micro-batch's `W` (`WeightGradients.compute`) does the products. Every other parameter (norms,
embeddings, routers) gets its gradient in `B` as in a plain backward, so `B` is a plain
`backward()` with the layers' weight products held back: no graph walking per micro-batch (what
torch.distributed.pipelining's `stage_backward_input` / `stage_backward_weight` do; measured slower
here, benchmarks/results/schedules.md). Outside `deferring` the layers compute both gradients at
once, with the same products as autograd's linear.

Only the micro-batches whose `B` is split go through the store (`WeightGradients.routed` around
their forward): the others, run fused, use the layers' own forward and autograd's own backward,
so a schedule that splits few backwards pays for few.

Layers inside a `torch.compile`d block are left as they are (a Python side effect in a backward
would break the compiled graph): there the weight gradient comes with `B`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

_LAYERS = (nn.Linear, Conv1D)


class WeightGradients:
    """The held-back weight-gradient work of each micro-batch whose `B` ran and whose `W` did not."""

    def __init__(self) -> None:
        self.routing = False
        self.recording: list[Callable[[], None]] | None = None
        self.pending: dict[int, list[Callable[[], None]]] = {}

    @contextlib.contextmanager
    def routed(self) -> Iterator[None]:
        """Within: the patched layers run through the store (the forward of a micro-batch whose
        `B` will be split); outside, their class's own forward, with no Python-side cost."""
        before, self.routing = self.routing, True
        try:
            yield
        finally:
            self.routing = before

    @contextlib.contextmanager
    def deferring(self, micro_batch: int) -> Iterator[None]:
        """Within: a backward through the routed layers keeps their weight gradients for
        `compute(micro_batch)` (routed too: activation checkpointing recomputes the forward here)."""
        self.recording = []
        try:
            with self.routed():
                yield
        finally:
            self.pending[micro_batch], self.recording = self.recording, None

    @torch.no_grad()
    def compute(self, micro_batch: int) -> None:
        """Accumulate `micro_batch`'s held-back weight (and bias) gradients into `p.grad`.

        Without autograd: the layer inputs it multiplies require gradients, and a recorded
        product would chain every micro-batch's inputs and output gradients onto `p.grad` until
        the next `zero_grad` (memory growing with each `W`, and the recording's time)."""
        for work in self.pending.pop(micro_batch, ()):
            work()


class _WeightProducts:
    """One layer's weight (and bias) gradient: what it needs, and the products."""

    __slots__ = ("x", "grad_2d", "weight", "bias", "transposed", "want_weight", "want_bias")

    def __init__(self, x, grad_2d, weight, bias, transposed: bool, want_weight: bool, want_bias: bool) -> None:
        self.x, self.grad_2d, self.weight, self.bias = x, grad_2d, weight, bias
        self.transposed, self.want_weight, self.want_bias = transposed, want_weight, want_bias

    def gradients(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        g = self.grad_2d
        x = self.x.reshape(-1, self.x.size(-1))
        if x.dtype != g.dtype:  # autocast: the product ran in the output's dtype
            x = x.to(g.dtype)
        grad_w = grad_b = None
        if self.want_weight:
            grad_w = torch.mm(x.t(), g) if self.transposed else torch.mm(g.t(), x)
            grad_w = grad_w if grad_w.dtype == self.weight.dtype else grad_w.to(self.weight.dtype)
        if self.want_bias:
            grad_b = g.sum(0)
            grad_b = grad_b if grad_b.dtype == self.bias.dtype else grad_b.to(self.bias.dtype)
        return grad_w, grad_b

    def accumulate(self) -> None:
        """`p.grad += gradient` (set when None), as autograd accumulates a leaf's gradient."""
        for param, grad in zip((self.weight, self.bias), self.gradients(), strict=True):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad


class _Linear(torch.autograd.Function):
    """`x @ W.T + b` (`nn.Linear`), or `x @ W + b` when `transposed` (`Conv1D`), whose weight
    gradient waits in `store` while it is recording."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer: nn.Module, store: WeightGradients, transposed: bool):
        # The layer, not the saved weight: under activation checkpointing saved tensors come back
        # as detached copies, and a gradient must land on the parameter itself.
        ctx.layer, ctx.store, ctx.transposed = layer, store, transposed
        ctx.save_for_backward(x)
        if transposed:
            out = torch.addmm(bias, x.view(-1, x.size(-1)), weight)
            return out.view(*x.shape[:-1], weight.size(-1))
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.layer.weight, ctx.layer.bias
        grad_2d = grad_out.reshape(-1, grad_out.size(-1))
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = weight if weight.dtype == grad_out.dtype else weight.to(grad_out.dtype)
            grad_x = torch.mm(grad_2d, w.t() if ctx.transposed else w).view(*x.shape[:-1], -1)
            grad_x = grad_x if grad_x.dtype == x.dtype else grad_x.to(x.dtype)
        products = _WeightProducts(x, grad_2d, weight, bias, ctx.transposed, *ctx.needs_input_grad[1:3])
        if ctx.store.recording is not None:
            ctx.store.recording.append(products.accumulate)
            return grad_x, None, None, None, None, None
        return grad_x, *products.gradients(), None, None, None


def _compiled_prefixes(stage: nn.Module) -> list[str]:
    return [f"{name}." for name, m in stage.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def defer_weight_gradients(stage: nn.Module, store: WeightGradients) -> int:
    """Route `stage`'s linear layers with a trainable weight through `store` (not those inside a
    compiled block); returns how many. `keep_weight_gradients` undoes it."""
    compiled = _compiled_prefixes(stage)
    count = 0
    for name, module in stage.named_modules():
        if type(module) not in _LAYERS or not module.weight.requires_grad:
            continue
        if any(f"{name}.".startswith(prefix) for prefix in compiled):
            continue
        transposed = type(module) is Conv1D

        def forward(x: torch.Tensor, module: nn.Module = module, transposed: bool = transposed) -> torch.Tensor:
            if not store.routing:
                return type(module).forward(module, x)
            return _Linear.apply(x, module.weight, module.bias, module, store, transposed)

        module.forward = forward
        count += 1
    return count


def keep_weight_gradients(stage: nn.Module) -> None:
    """Undo `defer_weight_gradients`: every layer back to its class's own forward."""
    for module in stage.modules():
        if type(module) in _LAYERS and "forward" in vars(module):
            del module.forward
