"""`ActCompDPOTrainer`: TRL's `DPOTrainer` over a plan's stages (`pip install 'hf-actcomp[trl]'`).

DPOTrainer scores each pair's chosen and rejected completions (its collator stacks the batch's
chosen rows, then its rejected rows) with a fused LM head: `model(..., labels=labels,
fused_lm_head=True)` returns per-token log-probabilities (and entropy, mean logit, top-1 hits)
without building the logits. The split model never calls `model.forward`, so `FusedHeadOnStages`
computes the same per-token fields from the stages' logits; DPOTrainer's own loss, every
`loss_type` and every metric then run unchanged on them.

In one process the reference model runs through the same plan (`simulate` in evaluation mode: the
boundaries send what the plan's inference form sends, exact with codec none): a `ref_model` given
or built by DPOTrainer, the policy with its LoRA adapters disabled under a `peft_config`, and the
`precompute_ref_log_probs` pass alike.

With several processes (one stage per rank) only the last stage sees logits, one micro-batch at
a time. Each batch's rows are reordered so that every micro-batch holds whole pairs (as
`ActCompRewardTrainer` does), the reference log-probabilities are computed first by a pass
through the pipeline without gradients (the policy with its LoRA adapters disabled, or the
`ref_model` split by the same plan) and kept on the last stage, and `PairwiseDPOLoss` computes
DPOTrainer's loss there (`Pipeline.set_objective`); its statistics are shared with every rank
after the step for DPOTrainer's metrics. There: `loss_type` sigmoid, hinge or ipo (others refused,
with the reason), `f_divergence_type="reverse_kl"`, no WPO weighting, no precomputed reference.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..models import unwrap_peft
from ..pipeline import prepare
from ..plan import Plan
from ..simulate import simulate
from .actcomp_trainer import ActCompTrainer
from .preference import AQSGD_WITH_REPLICAS, PreferenceStages, pair_order

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


PIPELINED_LOSSES = ("sigmoid", "hinge", "ipo")  # DPOTrainer's loss types the last stage computes


class PairwiseDPOLoss:
    """DPOTrainer's loss of one micro-batch on the last stage: its rows are whole pairs (chosen
    rows, then the same pairs' rejected rows), `labels` the next-token targets of the completions
    (-100 elsewhere). `reference` holds each micro-batch's reference log-probabilities in order
    (set before the step); `divisor` the step's pairs times the accumulation steps, so that the
    micro-batches add up to DPOTrainer's mean over pairs (divided by the accumulation steps, as
    Trainer divides a loss that takes no count). What the metrics need is kept per micro-batch."""

    def __init__(self, beta: float, loss_types: list[str], loss_weights: list[float]) -> None:
        self.beta = beta
        self.loss_types = loss_types
        self.loss_weights = loss_weights
        self.reference: list[torch.Tensor] = []
        self.divisor = 1.0
        self.pairs: list[torch.Tensor] = []  # (pairs, 4): chosen, rejected, reference chosen, reference rejected
        self.sums: list[torch.Tensor] = []  # entropy, tokens, chosen / rejected logits and tokens, top-1 hits

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, normaliser) -> torch.Tensor:
        fields = fused_head_fields(logits, labels)
        logps = fields.log_probs.sum(dim=1)
        reference = self.reference.pop(0).to(logps.device)
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = reference.chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = chosen_ratio - rejected_ratio
        chosen_mask, rejected_mask = fields.label_mask.chunk(2)
        loss = 0.0
        for kind, weight in zip(self.loss_types, self.loss_weights, strict=True):
            if kind == "sigmoid":
                per_pair = -nn.functional.logsigmoid(self.beta * delta)
            elif kind == "hinge":
                per_pair = torch.relu(1 - self.beta * delta)
            else:  # ipo: per-token averages of the log-ratios
                per_pair = (chosen_ratio / chosen_mask.sum(1).clamp(min=1) - rejected_ratio
                            / rejected_mask.sum(1).clamp(min=1) - 1 / (2 * self.beta)) ** 2
            loss = loss + per_pair.sum() / self.divisor * weight
        with torch.no_grad():
            self.pairs.append(torch.stack([chosen, rejected, ref_chosen, ref_rejected], dim=1).detach().float())
            chosen_logits, rejected_logits = fields.mean_logits.chunk(2)
            chosen_top1, _ = fields.is_top1.chunk(2)
            self.sums.append(torch.stack([
                fields.entropy.sum(), fields.label_mask.sum(), chosen_logits.sum(), chosen_mask.sum(),
                rejected_logits.sum(), rejected_mask.sum(), chosen_top1.sum()]).float())
        return loss

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(pairs x 4, the summed statistics) since the last call, or None where none were seen."""
        if not self.pairs:
            return None
        pairs, sums = torch.cat(self.pairs), torch.stack(self.sums).sum(0)
        self.pairs, self.sums = [], []
        return pairs, sums


def dpo_metrics(pairs: torch.Tensor, sums: torch.Tensor, beta: float) -> dict[str, float]:
    """DPOTrainer's per-batch metrics from `PairwiseDPOLoss.take()` (num_tokens aside)."""
    chosen, rejected, ref_chosen, ref_rejected = pairs.unbind(1)
    entropy, tokens, chosen_logits, chosen_tokens, rejected_logits, rejected_tokens, top1 = sums.tolist()
    chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    return {"entropy": entropy / tokens if tokens else 0.0,
            "logits/chosen": chosen_logits / chosen_tokens if chosen_tokens else 0.0,
            "logits/rejected": rejected_logits / rejected_tokens if rejected_tokens else 0.0,
            "mean_token_accuracy": top1 / chosen_tokens if chosen_tokens else 0.0,
            "rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
            "logps/chosen": chosen.mean().item(), "logps/rejected": rejected.mean().item()}


class ActCompDPOTrainer(PreferenceStages, ActCompTrainer, DPOTrainer):
    """`trl.DPOTrainer` that trains the policy split into the stages of `plan`, with the plan's
    compression at every boundary; the reference model runs through the same plan. Takes what
    `DPOTrainer` takes (`DPOConfig`, preference data, `ref_model`, `peft_config`, ...) plus `plan=`
    and `ActCompTrainer`'s `timeout=`. Run it as is (one process) or with `plan.world_size`
    processes. See docs/trainer.md."""

    _tag_names = ["trl", "dpo", "hf-actcomp"]

    def __init__(self, model=None, ref_model=None, args=None, *, plan: Plan, **kwargs: Any) -> None:
        if isinstance(plan, Plan) and plan.uses_aqsgd and plan.data_parallel > 1:
            raise ValueError(f"ActCompDPOTrainer {AQSGD_WITH_REPLICAS}")
        if args is not None and getattr(args, "world_size", 1) > 1:
            _check_pipelined(args)
        self._plan_given = plan
        super().__init__(model=model, args=args, plan=plan, ref_model=ref_model, eval_plain_loss=False, **kwargs)
        self._ref_pipe = None
        if self.pipe is not None:
            self._check_pair_batches("DPOConfig")
            self._pair_loss = PairwiseDPOLoss(self.beta, list(self.loss_types), list(self.loss_weights))
            self.pipe.set_objective(self._pair_loss)
            if self.ref_model is not None:  # split by the same plan, one stage per rank like the policy
                self._ref_pipe = prepare(unwrap_peft(self.ref_model), self.plan, timeout=self._backend.timeout)
            elif getattr(self.model, "disable_adapter", None) is None:
                raise ValueError("ActCompDPOTrainer with several processes needs a reference: a ref_model, or a LoRA "
                                 "peft_config (the reference is the policy without its adapters).")
        # One process, the reference through the plan: DPOTrainer's own, or the policy without its adapters.
        elif self.ref_model is not None:
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

    # ------------------------------------------------------------------ several processes
    def _longest_training_row(self) -> int:
        """Prompt and completion of the longest chosen or rejected row (cut at `max_length`, as
        DPOTrainer's collator cuts them)."""
        data = self.train_dataset
        longest = max(len(p) + max(len(c), len(r))
                      for p, c, r in zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"], strict=True))
        return min(longest, self.args.max_length) if self.args.max_length else longest

    def _stage_batch(self, inputs: dict[str, torch.Tensor], micro: int, steps: int) -> dict:
        """The batch as the stages take it (rows in whole pairs per micro-batch, completion targets
        as labels), after a reference pass through the pipeline that leaves each micro-batch's
        reference log-probabilities with the last stage's objective."""
        order = pair_order(inputs["input_ids"].shape[0], micro, inputs["input_ids"].device)
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        batch = {k: inputs[k].index_select(0, order) for k in ("input_ids", "attention_mask", "sample_id") if k in inputs}
        labels = labels.index_select(0, order)
        pipe = self._ref_pipe or self.pipe
        adapters = self.model.disable_adapter() if self._ref_pipe is None else contextlib.nullcontext()
        with torch.no_grad(), adapters:
            out = pipe.eval_step(batch, compress=True, keep_logits=True, micro_batches=micro)
        if self.pipe.is_last:
            reference = fused_head_fields(out.logits, labels).log_probs.sum(dim=1)
            self._pair_loss.reference = list(reference.chunk(micro))
        self._pair_loss.divisor = inputs["input_ids"].shape[0] // 2 * steps
        return {**batch, "labels": labels}

    def _record(self, inputs: dict[str, torch.Tensor], mode: str) -> None:
        """DPOTrainer's metrics of this batch, from what the last stage's objective kept (shared
        with every rank); its token count without the gather over processes (the stages of one
        pipeline read the same batch)."""
        pairs, sums = self.pipe.share_predictions(self._pair_loss.take())
        values = dpo_metrics(pairs, sums, self.beta)
        self._metrics[mode]["entropy"].append(values.pop("entropy"))  # DPOTrainer's order of keys
        self._count_tokens(inputs, mode)
        for key, value in values.items():
            self._metrics[mode][key].append(value)


def _check_pipelined(args) -> None:
    """What the last stage's DPO loss does not cover, refused before any work."""
    refused = {
        "loss_type": ([t for t in (args.loss_type if isinstance(args.loss_type, list) else [args.loss_type])
                       if t not in PIPELINED_LOSSES], f"the last stage computes {', '.join(PIPELINED_LOSSES)}"),
        "f_divergence_type": (args.f_divergence_type not in ("reverse_kl", None) and args.f_divergence_type,
                              "the last stage computes the reverse KL (standard DPO)"),
        "use_weighting": (args.use_weighting, "WPO's weights need the squared probabilities of every token"),
        "ld_alpha": (args.ld_alpha is not None and args.ld_alpha, "LD-DPO's split of the log-probabilities"),
        "precompute_ref_log_probs": (args.precompute_ref_log_probs,
                                     "the reference runs through the pipeline at every step instead"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"ActCompDPOTrainer with several processes does not take DPOConfig({name}="
                             f"{getattr(args, name)!r}): {why}. Run in one process for it.")
