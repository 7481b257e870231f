"""`ActCompDPOTrainer`: TRL's `DPOTrainer` over a plan's stages (`pip install 'hf-actcomp[trl]'`).

DPOTrainer scores each pair's chosen and rejected completions (its collator stacks the batch's
chosen rows, then its rejected rows) with a fused LM head: `model(..., labels=labels,
fused_lm_head=True)` returns per-token log-probabilities (and entropy, mean logit, top-1 hits)
without building the logits. The split model never calls `model.forward`, so `FusedHeadOnStages`
computes the same per-token fields from the stages' logits; DPOTrainer's own loss, every
`loss_type` and every metric then run unchanged on them.

The reference model runs through the same plan (`simulate` in evaluation mode: the boundaries
send what the plan's inference form sends, exact with codec none): a `ref_model` given or built by
DPOTrainer, the policy with its LoRA adapters disabled under a `peft_config`, and the
`precompute_ref_log_probs` pass alike.

One process so far: with several processes the batch's per-row log-probabilities exist only on
the last stage one micro-batch at a time, which needs the pairwise objective the reward trainer
uses (`Pipeline.set_objective`) plus a reference pass through the pipeline; refused for now.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..models import unwrap_peft
from ..plan import Plan
from ..simulate import simulate
from .actcomp_trainer import ActCompTrainer

try:
    from trl import DPOTrainer
    from trl.trainer.utils import FusedCausalLMOutput
except ImportError as err:  # pragma: no cover - exercised with trl hidden
    raise ImportError(
        "hf_actcomp.ActCompDPOTrainer needs TRL: pip install 'hf-actcomp[trl]' (tested with trl>=1.16,<2)."
    ) from err


def fused_head_fields(logits: torch.Tensor, labels: torch.Tensor, weighting: bool = False) -> FusedCausalLMOutput:
    """What TRL's fused LM head returns for `labels` (next-token targets, -100 ignored), from the
    full `logits`: per-token log-probability, entropy, mean logit and whether the target is the
    top-1 (and, for WPO's weighting, log sum of squared probabilities), zero where ignored, and the
    mean negative log-likelihood as the loss."""
    logits = logits[:, :-1].float()
    targets = labels[:, 1:].to(logits.device)
    mask = targets != -100
    log_z = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    log_probs = (target_logit - log_z).masked_fill(~mask, 0)
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = (log_z - (probs * logits).sum(-1)).masked_fill(~mask, 0)
        mean_logits = logits.mean(-1).masked_fill(~mask, 0)
        is_top1 = (target_logit >= logits.amax(-1)) & mask
        squares = (torch.logsumexp(2 * logits, dim=-1) - 2 * log_z).masked_fill(~mask, 0) if weighting else None
    loss = -log_probs.sum() / mask.sum().clamp(min=1)
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=squares,
                               mean_logits=mean_logits, is_top1=is_top1, label_mask=mask)


class FusedHeadOnStages(nn.Module):
    """A model's stages (a `simulate()` module) called as DPOTrainer calls a model with TRL's fused
    head. `reference`: run in evaluation mode (the plan's inference form at the boundaries, no
    gradients, no state updated), with the policy's LoRA adapters disabled when `without_adapters`."""

    def __init__(self, stages: nn.Module, *, reference: bool = False, without_adapters: bool = False,
                 weighting: bool = False) -> None:
        super().__init__()
        self.stages = stages
        self.reference = reference
        self.without_adapters = without_adapters
        self.weighting = weighting

    def forward(self, *, labels: torch.Tensor | None = None, fused_lm_head: bool = False, **inputs: Any):
        inputs = {k: v for k, v in inputs.items() if k not in ("use_cache", "output_router_logits")}
        with self._mode():
            out = self.stages(**inputs)
            return fused_head_fields(out.logits, labels, self.weighting) if fused_lm_head else out

    @contextlib.contextmanager
    def _mode(self):
        if not self.reference:
            yield
            return
        was_training = self.stages.training
        self.stages.eval()
        peft_model = self.stages.model if self.without_adapters else None
        adapters = peft_model.disable_adapter() if peft_model is not None and hasattr(peft_model, "disable_adapter") \
            else contextlib.nullcontext()
        try:
            with torch.no_grad(), adapters:
                yield
        finally:
            self.stages.train(was_training)


class ActCompDPOTrainer(ActCompTrainer, DPOTrainer):
    """`trl.DPOTrainer` that trains the policy split into the stages of `plan`, with the plan's
    compression at every boundary; the reference model runs through the same plan. Takes what
    `DPOTrainer` takes (`DPOConfig`, preference data, `ref_model`, `peft_config`, ...) plus `plan=`
    and `ActCompTrainer`'s `timeout=`. One process for now. See docs/trainer.md."""

    _tag_names = ["trl", "dpo", "hf-actcomp"]

    def __init__(self, model=None, ref_model=None, args=None, *, plan: Plan, **kwargs: Any) -> None:
        if args is not None and getattr(args, "world_size", 1) > 1:
            raise ValueError(
                "ActCompDPOTrainer runs in one process so far (the plan's stages in-process); with several processes "
                "the pairwise loss needs every row's log-probabilities, which only the last stage holds. Run it in "
                "one process, or ActCompTrainer / ActCompRewardTrainer across processes.")
        if isinstance(plan, Plan) and plan.uses_aqsgd:
            raise ValueError("ActCompDPOTrainer does not take AQ-SGD plans yet: its memory is keyed by row and a "
                             "preference pair is two rows. Use a stateless codec (quantize, hadamard, topk + 'ef').")
        self._plan_given = plan
        super().__init__(model=model, args=args, plan=plan, ref_model=ref_model, eval_plain_loss=False, **kwargs)
        # The reference through the plan: DPOTrainer's own, or the policy without its adapters.
        if self.ref_model is not None:
            self.ref_model = FusedHeadOnStages(simulate(unwrap_peft(self.ref_model), self.plan), reference=True,
                                               weighting=self.use_weighting)
        elif getattr(self.model, "disable_adapter", None) is not None:
            self.ref_model = FusedHeadOnStages(self.sim, reference=True, without_adapters=True,
                                               weighting=self.use_weighting)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """DPOTrainer's loss and metrics, with the per-token fields from the in-process stages."""
        return DPOTrainer.compute_loss(self, FusedHeadOnStages(model, weighting=self.use_weighting), inputs,
                                       return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def compute_ref_log_probs(self, model, inputs):
        """`precompute_ref_log_probs`' pass (inside DPOTrainer's `__init__`, before the stages are
        built), through the plan in evaluation mode; DPOTrainer disables a LoRA policy's adapters."""
        if not isinstance(model, FusedHeadOnStages):
            model = FusedHeadOnStages(simulate(model, self._plan_given), reference=True)
        return DPOTrainer.compute_ref_log_probs(self, model, inputs)
