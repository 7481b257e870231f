"""`ActCompRewardTrainer`: TRL's `RewardTrainer` over a plan's stages (`pip install 'hf-actcomp[trl]'`).

A reward model is a sequence classifier with one label: `RewardTrainer` scores each pair's chosen
and rejected rows (its collator stacks the batch's chosen rows, then its rejected rows) and
minimises `-log sigmoid(r_chosen - r_rejected - margin)`, averaged over the pairs, plus
`center_rewards_coefficient * mean((r_chosen + r_rejected)^2)`.

- One process: RewardTrainer's own `compute_loss` on the in-process stages (`simulate`), which
  return every row's reward as the model would.
- Several processes: only the last stage sees rewards, one micro-batch at a time. The batch's rows
  are reordered so that every micro-batch holds whole pairs (its chosen rows, then the same pairs'
  rejected rows), each row's `labels` carry its pair's margin, and `PairwiseRewardLoss` computes
  the same loss there (`Pipeline.set_objective`); its rewards are shared with every rank after
  the step for RewardTrainer's metrics (`min/mean/max_reward`, `accuracy`, `margin`, counted under
  `predictions`). So the per-device batch (in pairs) must split evenly into `plan.micro_batches`.

Not yet: AQ-SGD plans (its memory is keyed by row, and a pair is two rows: refused), a model given
by name with several processes loads whole on each rank before the split.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..plan import Plan
from .actcomp_trainer import ActCompTrainer

try:
    from transformers import AutoModelForSequenceClassification
    from trl import RewardTrainer
except ImportError as err:  # pragma: no cover - exercised with trl hidden
    raise ImportError(
        "hf_actcomp.ActCompRewardTrainer needs TRL: pip install 'hf-actcomp[trl]' (tested with trl>=1.16,<2)."
    ) from err


class PairwiseRewardLoss:
    """RewardTrainer's loss of one micro-batch on the last stage, whose rows are `pairs` chosen
    rows then the same pairs' rejected rows; `labels` holds each row's pair margin.

    Summed over the micro-batches it equals RewardTrainer's batch mean: each micro-batch divides
    its terms' sum by the step's pair count. The step count the pipeline passes (`normaliser`)
    is of rows, two per pair; None (one micro-batch) means this micro-batch's own mean. The
    rewards seen since `take_rewards` are kept (detached) for the metrics."""

    def __init__(self, center_rewards_coefficient: float | None = None) -> None:
        self.center = center_rewards_coefficient
        self.rewards: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, normaliser) -> torch.Tensor:
        chosen, rejected = torch.chunk(logits.squeeze(-1), chunks=2)
        margin = labels[: chosen.shape[0]].to(chosen.dtype)
        pairs = chosen.shape[0] if normaliser is None else normaliser / 2
        loss = -nn.functional.logsigmoid(chosen - rejected - margin).sum() / pairs
        if self.center is not None:
            loss = loss + self.center * ((chosen + rejected) ** 2).sum() / pairs
        self.rewards.append(torch.stack([chosen, rejected], dim=1).detach())
        return loss

    def take_rewards(self) -> torch.Tensor | None:
        """The (pairs, 2) chosen / rejected rewards since the last call, or None where none were seen."""
        rewards, self.rewards = self.rewards, []
        return torch.cat(rewards) if rewards else None


def pairs_per_micro_batch(inputs: dict[str, torch.Tensor], micro_batches: int) -> dict[str, torch.Tensor]:
    """RewardTrainer's batch (chosen rows, then rejected rows; `margin` per pair) as the stages
    take it: rows reordered so that each of `micro_batches` row-wise parts holds whole pairs, and
    `labels` the pair margin of each row (zero without margins)."""
    rows = inputs["input_ids"].shape[0]
    pairs = rows // 2
    if rows % 2 or pairs % micro_batches:
        raise ValueError(f"A reward batch of {pairs} pairs cannot be cut into plan.micro_batches={micro_batches} parts "
                         f"of whole pairs: use a per-device batch size (in pairs) that is a multiple of {micro_batches}.")
    per = pairs // micro_batches
    order = torch.cat([torch.cat([torch.arange(m * per, (m + 1) * per), pairs + torch.arange(m * per, (m + 1) * per)])
                       for m in range(micro_batches)]).to(inputs["input_ids"].device)
    margin = inputs.get("margin")
    margin = torch.zeros(pairs, device=order.device) if margin is None else margin.to(order.device, torch.float32)
    out = {k: v.index_select(0, order) for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    out["labels"] = torch.cat([margin, margin]).index_select(0, order)
    return out


def reward_metrics(rewards: torch.Tensor) -> dict[str, float]:
    """RewardTrainer's per-batch metrics from the (pairs, 2) chosen / rejected rewards."""
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    every = torch.cat([chosen, rejected])
    return {"min_reward": every.min().item(), "mean_reward": every.mean().item(), "max_reward": every.max().item(),
            "accuracy": (chosen > rejected).float().mean().item(), "margin": (chosen - rejected).mean().item()}


class _DropsExtras(nn.Module):
    """The in-process stages called with RewardTrainer's batch: its `margin` (read by the loss, not
    the model) and `use_cache` are dropped before the call."""

    def __init__(self, sim: nn.Module) -> None:
        super().__init__()
        self.sim = sim

    def forward(self, **inputs: Any):
        return self.sim(**{k: v for k, v in inputs.items() if k not in ("margin", "use_cache")})


class ActCompRewardTrainer(ActCompTrainer, RewardTrainer):
    """`trl.RewardTrainer` that trains the reward model (a sequence classifier with one label)
    split into the stages of `plan`, with the plan's compression at every boundary. Takes what
    `RewardTrainer` takes (`RewardConfig`, preference data, `peft_config`, ...) plus `plan=` and
    `ActCompTrainer`'s `timeout=`, `torch_dtype=`. Run it as is (one process) or with
    `plan.world_size` processes. See docs/trainer.md."""

    _tag_names = ["trl", "reward-trainer", "hf-actcomp"]

    def __init__(self, model=None, args=None, *, plan: Plan, torch_dtype: torch.dtype | None = None,
                 **kwargs: Any) -> None:
        if isinstance(plan, Plan) and plan.uses_aqsgd:
            raise ValueError("ActCompRewardTrainer does not take AQ-SGD plans yet: its memory is keyed by row and a "
                             "preference pair is two rows. Use a stateless codec (quantize, hadamard, topk + 'ef').")
        if isinstance(model, str):  # as RewardTrainer loads a name: one label, the score's head
            init = dict(getattr(args, "model_init_kwargs", None) or {})
            if torch_dtype is not None:
                init["dtype"] = torch_dtype
            model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, **init)
            torch_dtype = None
        super().__init__(model=model, args=args, plan=plan, torch_dtype=torch_dtype, eval_plain_loss=False, **kwargs)
        if self.pipe is not None:
            micro = self.plan.micro_batches
            for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
                size = getattr(self.args, name)
                if size % micro:
                    raise ValueError(f"RewardConfig({name}={size}) must be a multiple of plan.micro_batches={micro}: "
                                     "each micro-batch holds whole preference pairs.")
            self._pair_loss = PairwiseRewardLoss(self.args.center_rewards_coefficient)
            self.pipe.set_objective(self._pair_loss)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """RewardTrainer's loss and metrics on the in-process stages (one process; with several, the
        last stage computes the loss in `Pipeline.train_step`)."""
        return RewardTrainer.compute_loss(self, _DropsExtras(model), inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        if self.pipe is None:
            return super().training_step(model, inputs, num_items_in_batch)
        self.model.train()  # RewardTrainer.log reads the mode off the model; only this rank's stage runs
        inputs = self._prepare_inputs(inputs)
        loss = super().training_step(model, pairs_per_micro_batch(inputs, self.plan.micro_batches), None)
        self._record(inputs, "train")
        return loss

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys=None):
        if self.pipe is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        self.model.eval()
        inputs = self._prepare_inputs(inputs)
        pairs = inputs["input_ids"].shape[0] // 2
        micro = math.gcd(pairs, self.plan.micro_batches)  # whole pairs in each (a short last batch too)
        batch = pairs_per_micro_batch(inputs, micro)
        out = self.pipe.eval_step(batch, compress=True, keep_logits=not prediction_loss_only, micro_batches=micro)
        self._record(inputs, "eval")
        loss = out.loss.detach().to(self.args.device)
        if prediction_loss_only:
            return loss, None, None
        # RewardTrainer's logits: every row's reward, in the batch's order (chosen rows, then rejected).
        rewards = self.pipe.share_predictions(out.logits)
        order = pairs_per_micro_batch({"input_ids": torch.arange(2 * pairs).unsqueeze(1)}, micro)["input_ids"]
        logits = torch.empty_like(rewards).index_copy_(0, order.flatten().to(rewards.device), rewards)
        return loss, logits, None

    def _record(self, inputs: dict[str, torch.Tensor], mode: str) -> None:
        """RewardTrainer's metrics of this batch, from the rewards the last stage saw (shared with
        every rank); its token count without the gather over processes (the stages of one pipeline
        read the same batch)."""
        rewards = self.pipe.share_predictions(self._pair_loss.take_rewards())
        if mode == "train":
            self._total_train_tokens += int(inputs["attention_mask"].sum()) * self._backend.num_replicas
        metrics = self._metrics[mode]
        metrics["num_tokens"] = [self._total_train_tokens]
        for key, value in reward_metrics(rewards.float()).items():
            metrics[key].append(value)
