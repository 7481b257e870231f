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

- Data-parallel replicas: each replica's loss is its pairs' mean and the replicas' gradients are
  averaged, as under DDP (RewardTrainer's batch has no `labels`: Trainer passes no count and never
  multiplies the loss by the processes); the training metrics are over the rewards gathered from
  every replica, and each replica evaluates in batches of the global evaluation batch.

AQ-SGD keys each row of a pair (`preference.py`). Not yet: AQ-SGD with data-parallel replicas
(refused); a model given by name with several processes loads whole on each rank before the split.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..plan import Plan
from .actcomp_trainer import ActCompTrainer
from .preference import AQSGD_WITH_REPLICAS, PreferenceStages, pair_order

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
    take it: rows reordered by `pair_order`, and `labels` the pair margin of each row (zero
    without margins)."""
    pairs = inputs["input_ids"].shape[0] // 2
    order = pair_order(inputs["input_ids"].shape[0], micro_batches, inputs["input_ids"].device)
    margin = inputs.get("margin")
    margin = torch.zeros(pairs, device=order.device) if margin is None else margin.to(order.device, torch.float32)
    out = {k: v.index_select(0, order) for k, v in inputs.items() if k in ("input_ids", "attention_mask", "sample_id")}
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


class ActCompRewardTrainer(PreferenceStages, ActCompTrainer, RewardTrainer):
    """`trl.RewardTrainer` that trains the reward model (a sequence classifier with one label)
    split into the stages of `plan`, with the plan's compression at every boundary. Takes what
    `RewardTrainer` takes (`RewardConfig`, preference data, `peft_config`, ...) plus `plan=` and
    `ActCompTrainer`'s `timeout=`, `torch_dtype=`. Run it as is (one process) or with
    `plan.world_size` processes. See docs/trainer.md."""

    _tag_names = ["trl", "reward-trainer", "hf-actcomp"]
    _keeps_outputs = True  # RewardTrainer's evaluation returns every row's reward
    # The stages' `labels` are the pair margins made here: RewardTrainer's batch has none, so Trainer
    # passes no item count and under DDP never multiplies the loss by the processes.
    _labels_made_for_the_stages = True

    def __init__(self, model=None, args=None, *, plan: Plan, torch_dtype: torch.dtype | None = None,
                 **kwargs: Any) -> None:
        if isinstance(plan, Plan) and plan.uses_aqsgd and plan.data_parallel > 1:
            raise ValueError(f"ActCompRewardTrainer {AQSGD_WITH_REPLICAS}")
        if isinstance(model, str):  # as RewardTrainer loads a name: one label, the score's head
            init = dict(getattr(args, "model_init_kwargs", None) or {})
            if torch_dtype is not None:
                init["dtype"] = torch_dtype
            model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, **init)
            torch_dtype = None
        super().__init__(model=model, args=args, plan=plan, torch_dtype=torch_dtype, eval_plain_loss=False, **kwargs)
        if self.pipe is not None:
            self._check_pair_batches("RewardConfig")
            self._pair_loss = PairwiseRewardLoss(self.args.center_rewards_coefficient)
            self.pipe.set_objective(self._pair_loss)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """RewardTrainer's loss and metrics on the in-process stages (one process; with several, the
        last stage computes the loss in `Pipeline.train_step`)."""
        return RewardTrainer.compute_loss(self, _DropsExtras(model), inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)

    def _get_dataloader(self, dataset, description: str, batch_size: int, sampler_fn=None, is_training: bool = False,
                        dataloader_key: str | None = None):
        """With replicas, every replica evaluates the whole set in batches of the global evaluation
        batch (replicas x per-device pairs): the groups RewardTrainer's per-batch metrics (min and
        max reward, accuracy, margin) are taken over under DDP, where the processes' batches are
        gathered."""
        if not is_training:
            batch_size *= self._backend.num_replicas
        return super()._get_dataloader(dataset, description, batch_size, sampler_fn=sampler_fn,
                                       is_training=is_training, dataloader_key=dataloader_key)

    def _longest_training_row(self) -> int:
        return max(len(ids) for column in ("chosen_ids", "rejected_ids") for ids in self.train_dataset[column])

    def _stage_batch(self, inputs: dict[str, torch.Tensor], micro_batches: int, steps: int) -> dict:
        return pairs_per_micro_batch(inputs, micro_batches)

    def _pair_outputs(self, out, inputs: dict[str, torch.Tensor], micro_batches: int) -> torch.Tensor:
        """RewardTrainer's logits: every row's reward, in the batch's order (chosen rows, then rejected)."""
        rewards = self.pipe.share_predictions(out.logits)
        order = pair_order(rewards.shape[0], micro_batches, rewards.device)
        return torch.empty_like(rewards).index_copy_(0, order, rewards)

    def _record(self, inputs: dict[str, torch.Tensor], mode: str) -> None:
        """RewardTrainer's metrics of this batch, from the rewards the last stage saw (shared with
        every rank) and, in training, gathered over the replicas as RewardTrainer gathers them over
        the processes (every replica evaluates the whole global batch itself); its token count
        summed over the replicas."""
        rewards = self.pipe.share_predictions(self._pair_loss.take_rewards())
        if mode == "train":
            rewards = self.pipe.gather_over_replicas(rewards)
        self._count_tokens(inputs, mode)
        for key, value in reward_metrics(rewards.float()).items():
            self._metrics[mode][key].append(value)
