"""Preference pairs through the stages: what `ActCompRewardTrainer` and `ActCompDPOTrainer` share.

TRL's preference collators stack a batch's chosen rows, then the same pairs' rejected rows, and
their losses pair row i with row i + pairs. AQ-SGD keys its memory per row: example i's chosen row
is key 2i, its rejected row 2i + 1 (`PadToLength(rows_per_example=2)`). With several processes only the last stage sees the
outputs, one micro-batch at a time, so each batch is reordered to hold whole pairs in every
micro-batch (`pair_order`), the trainer's loss runs there as the pipeline's objective, and what
its metrics need is shared with every rank after the step (`PreferenceStages`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

AQSGD_WITH_REPLICAS = ("takes AQ-SGD with data_parallel=1 only so far: a pair's two rows are two memory keys "
                       "(2i, 2i+1), which the replicas' contiguous shards of sample ids do not split yet.")


def pair_order(rows: int, micro_batches: int, device: torch.device | None = None) -> torch.Tensor:
    """The row order that cuts a preference batch into `micro_batches` row-wise parts of whole
    pairs: each part its chosen rows, then the same pairs' rejected rows."""
    pairs = rows // 2
    if rows % 2 or pairs % micro_batches:
        raise ValueError(f"A preference batch of {pairs} pairs cannot be cut into plan.micro_batches={micro_batches} "
                         f"parts of whole pairs: use a per-device batch size (in pairs) that is a multiple of "
                         f"{micro_batches}.")
    per = pairs // micro_batches
    return torch.cat([torch.cat([torch.arange(m * per, (m + 1) * per), pairs + torch.arange(m * per, (m + 1) * per)])
                      for m in range(micro_batches)]).to(device)


class PreferenceStages:
    """The multi-process half of a TRL preference trainer (first in its bases, before
    `ActCompTrainer`): training and evaluation steps on pairs reordered for the stages. A trainer
    defines `_stage_batch(inputs, micro_batches, accumulation_steps)` (the batch the stages take,
    after anything that must run first, such as a reference pass) and `_record(inputs, mode)`
    (its metrics of the batch); `_pair_outputs(out, inputs, micro_batches)` gives the evaluation's
    predictions (with `_keeps_outputs`; default: none). In one process both steps are the parent
    trainer's."""

    _keeps_outputs = False  # whether evaluation returns predictions (the last stage's logits, shared)
    _rows_per_example = 2  # AQ-SGD: example i's chosen row is memory key 2i, its rejected row 2i + 1

    def _check_pair_batches(self, config_name: str) -> None:
        """Both per-device batch sizes (in pairs) split into the plan's micro-batches, or a clear error."""
        micro = self.plan.micro_batches
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            size = getattr(self.args, name)
            if size % micro:
                raise ValueError(f"{config_name}({name}={size}) must be a multiple of plan.micro_batches={micro}: "
                                 "each micro-batch holds whole preference pairs.")

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        if self.pipe is None:
            return super().training_step(model, inputs, num_items_in_batch)
        inputs = self._prepare_inputs(inputs)
        batch = self._stage_batch(inputs, self.plan.micro_batches, self.current_gradient_accumulation_steps)
        loss = super().training_step(model, batch, None)
        self._record(inputs, "train")
        return loss

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys=None):
        if self.pipe is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        micro = math.gcd(inputs["input_ids"].shape[0] // 2, self.plan.micro_batches)  # a short last batch too
        batch = self._stage_batch(inputs, micro, 1)
        out = self.pipe.eval_step(batch, compress=True, keep_logits=self._keeps_outputs and not prediction_loss_only,
                                  micro_batches=micro)
        self._record(inputs, "eval")
        loss = out.loss.detach().to(self.args.device)
        if prediction_loss_only or not self._keeps_outputs:
            return loss, None, None
        return loss, self._pair_outputs(out, inputs, micro), None

    def _pair_outputs(self, out, inputs: dict[str, torch.Tensor], micro_batches: int):
        return None

    def _count_tokens(self, inputs: dict[str, torch.Tensor], mode: str) -> None:
        """TRL's `num_tokens`, summed over the replicas instead of over every process (the stages
        of one pipeline read the same batch)."""
        if mode == "train":
            self._total_train_tokens += self.pipe.count_over_replicas(int(inputs["attention_mask"].sum()))
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
