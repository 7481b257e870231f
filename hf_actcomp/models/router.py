"""The MoE router's load-balancing loss (Mixtral's `output_router_logits=True`) split over stages.

transformers adds `coef * aux` to the loss of each forward call, with (Switch Transformer, eqs.
4-6, as `load_balancing_loss_func` computes it over the router logits of every layer)

    aux = E * sum_e (T_e / R) * (P_e / R)

where T_e counts the tokens routed to expert e (top-k, padding masked out), P_e sums the routing
probabilities of expert e and R counts rows (layers x real tokens). T, P and R are sums over
layers, so each stage adds its own layers' part onto the earlier stages' sums, in layer order as
transformers does; the sums travel forward with the activations (2E + 1 floats), and the last
stage adds the loss with transformers' expression. Once T and R are known, aux is linear in P, so
the gradient of the loss with respect to every stage's part of P is the same vector (coef * E *
T / R^2), which the last stage's autograd gives and which travels back with the activation
gradients (E floats).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from .heads import CAUSAL_LM, task_of


def router_spec(model: nn.Module) -> tuple[type, int] | None:
    """(router module class, index of the logits in its output) when `model` is an MoE model
    that asks for the load-balancing loss (`config.output_router_logits=True`), else None.
    Only a causal LM adds it to its loss (transformers' classifiers do not)."""
    if not getattr(model.config, "output_router_logits", False) or task_of(model) != CAUSAL_LM:
        return None
    base = getattr(model, model.base_model_prefix, model)
    recorder = (getattr(type(base), "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None or not hasattr(model, "num_experts"):
        raise ValueError(
            f"{model.config.model_type}: output_router_logits=True but the model declares no router outputs "
            "(`_can_record_outputs['router_logits']`) or no num_experts: hf-actcomp cannot compute its "
            "load-balancing loss. Set config.output_router_logits=False."
        )
    return recorder.target_class, recorder.index


class RouterLoss:
    """Collects the router logits of `module`'s routers during `collecting()` and turns them into
    this stage's part of the load-balancing loss.

    Args:
        model: the causal LM (its `num_experts`, `num_experts_per_tok`, `router_aux_loss_coef`).
        module: the part of the model whose routers count here (a stage, or the whole model).
    """

    def __init__(self, model: nn.Module, module: nn.Module) -> None:
        spec = router_spec(model)
        if spec is None:
            raise ValueError("RouterLoss needs a model with config.output_router_logits=True.")
        router_class, self._index = spec
        self.num_experts = int(model.num_experts)
        self.top_k = int(model.num_experts_per_tok)
        self.coef = float(model.router_aux_loss_coef)
        self._logits: list[Tensor] | None = None  # being collected
        self._collected: list[Tensor] = []  # collected by the last forward
        for router in (m for m in module.modules() if isinstance(m, router_class)):
            router.register_forward_hook(self._record)

    @property
    def stats_numel(self) -> int:
        """Floats of the forward side channel: T (E), P (E) and R (1)."""
        return 2 * self.num_experts + 1

    # Eager inside a compiled block: traced, the append would guard on the list's length and
    # compile every block of the model apart (compile=True, hf_actcomp/models/compile.py).
    @torch.compiler.disable
    def _record(self, module: nn.Module, args, output) -> None:
        if self._logits is not None:  # not while activation checkpointing recomputes the block
            self._logits.append(output[self._index])

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        self._logits = []
        try:
            yield
        finally:
            self._collected, self._logits = self._logits, None

    def partial(self, attention_mask: Tensor | None, device: torch.device,
                start: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(stats, P): [T, P, R] (detached, 2E+1 floats) and P with gradient into the layers
        collected last, summed layer by layer onto `start` (the earlier stages' stats), in the
        order transformers sums them."""
        e = self.num_experts
        if start is None:
            start = torch.zeros(2 * e + 1, dtype=torch.float32, device=device)
        tokens, probs, rows = (t.clone() for t in self.split(start.to(device)))
        mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
        for logits in self._collected:
            weights = torch.nn.functional.softmax(logits.to(device), dim=-1)
            _, selected = torch.topk(weights, self.top_k, dim=-1)
            if mask is None:
                tokens = tokens + torch.histc(selected.reshape(-1).to(torch.float32), bins=e, min=0, max=e)
                probs = probs + weights.float().sum(dim=0)
                rows = rows + weights.shape[0]
            else:
                counts = torch.zeros(e, dtype=torch.float32, device=device)
                tokens = tokens + counts.scatter_add_(0, selected.reshape(-1), mask.repeat_interleave(self.top_k))
                probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
                rows = rows + mask.sum()
        self._collected = []
        return torch.cat([tokens, probs.detach(), rows.reshape(1)]), probs

    def split(self, stats: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        e = self.num_experts
        return stats[:e], stats[e:2 * e], stats[2 * e]

    def whole_loss(self, stats: Tensor, probs: Tensor) -> Tensor:
        """`coef * aux` when `probs` (with gradient) covers every layer: transformers' expression."""
        tokens, _, rows = self.split(stats)
        return self.coef * (torch.sum((tokens / rows) * (probs / rows).unsqueeze(0)) * self.num_experts)
