"""Checking a batch and cutting it into micro-batches, with the loss normaliser: one path for
the in-process simulation (`simulate`) and the pipeline (`Pipeline.train_step` / `eval_step`).

Every rank of a pipeline reads the same batch, so every rank can validate it identically before
any message is sent: a bad batch fails everywhere with the same error instead of hanging a peer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aqsgd_memory import check_sample_ids
from .models.heads import CAUSAL_LM, MASKED_LM, TOKEN_CLASSIFICATION, problem_type
from .plan import Plan

BATCH_KEYS = ("input_ids", "attention_mask", "labels", "sample_id", "token_type_ids")


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # the first stage's input: token ids, or an image model's pixel_values
    attention_mask: torch.Tensor | None
    labels: torch.Tensor
    sample_id: torch.Tensor | None
    token_type_ids: torch.Tensor | None = None  # an encoder's segments (BERT), read by the first stage


def count_label_tokens(labels: torch.Tensor, *, shifted: bool = True, shift_labels: torch.Tensor | None = None) -> int:
    """Label tokens a loss averages over, counted as Trainer counts them (`_get_num_items_in_batch`):
    a collator's `shift_labels` when given, else `labels` shifted by one when the loss shifts them
    (a causal LM's), -100 ignored. The one counting rule: the pipeline's and the simulation's loss
    normaliser, and ActCompTrainer's training and evaluation counts all use it."""
    if shift_labels is not None:
        return int(shift_labels.ne(-100).sum())
    return int((labels[..., 1:] if shifted else labels).ne(-100).sum())


def count_items(task: str, config, labels: torch.Tensor) -> int:
    """What a step's loss divides by, for the model's task (models/heads.py): label tokens for a
    causal LM (shifted), a token classifier and a masked LM (not shifted), labelled rows for single-label
    sequence classification, rows for regression and multi-label classification."""
    if task == CAUSAL_LM:
        return count_label_tokens(labels)
    if task in (TOKEN_CLASSIFICATION, MASKED_LM):
        return count_label_tokens(labels, shifted=False)
    if problem_type(config, labels, record=False) == "single_label_classification":
        return int(labels.ne(-100).sum())
    return int(labels.shape[0])


def with_main_input(batch: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """`batch` with an image model's `pixel_values` under `input_ids`, the key the pipeline carries
    the first stage's input in (`MicroBatch.input_ids`; the model's `main_input_name`)."""
    if "pixel_values" not in batch:
        return batch
    if batch.get("input_ids") is not None:
        raise ValueError("A batch has both input_ids and pixel_values: give a text model's input_ids or an "
                         "image model's pixel_values.")
    return {("input_ids" if k == "pixel_values" else k): v for k, v in batch.items() if k != "input_ids"}


def check_batch(batch: dict[str, torch.Tensor | None], plan: Plan, training: bool,
                sample_range: range | None = None, needs_labels: bool = True) -> None:
    """Raise a ValueError that says what is wrong with `batch` for this plan (AQ-SGD sample ids:
    within `sample_range` when this replica keeps memory for a shard only). `needs_labels`: the
    pipeline's last stage always computes the loss; the simulation may return logits only."""
    unknown = set(batch) - set(BATCH_KEYS)
    if "input_ids" not in batch or unknown:
        raise ValueError(
            f"A pipeline batch has input_ids (required; an image model's pixel_values in its place), "
            f"attention_mask, labels, sample_id and (an encoder's) token_type_ids; got keys "
            f"{sorted(batch)}."
        )
    rows, num_micro = batch["input_ids"].shape[0], plan.micro_batches
    if training and rows < num_micro:
        raise ValueError(
            f"A training batch of {rows} rows cannot be split into plan.micro_batches={num_micro}; "
            f"use a batch size >= {num_micro} (and dataloader_drop_last=True where the last batch is short)."
        )
    if needs_labels and batch.get("labels") is None:
        raise ValueError("The batch needs 'labels' to compute the loss on the last stage.")
    if training and plan.uses_aqsgd:
        if batch.get("sample_id") is None:
            raise ValueError(
                "AQ-SGD needs a 'sample_id' entry in every training batch. "
                "Add it with hf_actcomp.add_sample_ids(dataset)."
            )
        check_sample_ids(batch["sample_id"], sample_range or plan.memory.num_samples, rows)


def micro_batch_count(batch: dict[str, torch.Tensor | None], plan: Plan, training: bool) -> int:
    """`plan.micro_batches`; evaluation of a batch with fewer rows (the last of a set) runs one
    micro-batch per row instead (no state depends on the count there)."""
    return plan.micro_batches if training else min(plan.micro_batches, batch["input_ids"].shape[0])


def split_batch(batch: dict[str, torch.Tensor | None], num_micro: int,
                device: torch.device | None = None) -> list[MicroBatch]:
    """`batch` cut row-wise into `num_micro` micro-batches (as `torch.tensor_split`), moved to
    `device` when given."""

    def split(t: torch.Tensor | None) -> list:
        if t is None:
            return [None] * num_micro
        return list(torch.tensor_split(t if device is None else t.to(device), num_micro))

    return [MicroBatch(*parts) for parts in zip(*(split(batch.get(k)) for k in BATCH_KEYS), strict=True)]
