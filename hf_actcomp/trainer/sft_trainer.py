"""`ActCompSFTTrainer`: TRL's `SFTTrainer` over a plan's stages (`pip install 'hf-actcomp[trl]'`).

`SFTTrainer` prepares the data in its `__init__` (tokenizes text, prompt-completion and
conversational rows with the chat template, builds completion-only or assistant-only labels,
packs) and may wrap the model with PEFT (`peft_config`). `ActCompTrainer` reads the training
rows only after its parent's `__init__`, so the two compose by inheritance: this class is
`class ActCompSFTTrainer(ActCompTrainer, SFTTrainer)` plus what the stages change:

- the loss: SFTTrainer's fused LM head runs the whole model's `forward`, which the split model
  never calls; the stages compute the same negative log-likelihood (Trainer's `compute_loss` on
  the in-process stages, the last stage's loss with several processes). Its per-step `entropy`
  and `mean_token_accuracy` need that head and are not logged.
- padding-free batches (`packing=True` with the default `"bfd"` strategy, or `padding_free=True`)
  are one row of concatenated sequences with `position_ids`. The stages take rows with an
  attention mask, so each batch is cut back into its sequences, right-padded
  (`UnpackedPaddingFree`): the same tokens, targets and loss, without the packing's saving of
  padding. `packing_strategy="wrapped"` rows go through as they are.

Any other Trainer subclass composes the same way: `class X(ActCompTrainer, YourTrainer)`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from ..plan import Plan
from .actcomp_trainer import ActCompTrainer

try:
    from transformers import Trainer
    from trl import SFTTrainer
except ImportError as err:  # pragma: no cover - exercised by tests/test_sft.py with trl hidden
    raise ImportError(
        "hf_actcomp.ActCompSFTTrainer needs TRL: pip install 'hf-actcomp[trl]' (tested with trl>=1.16,<2)."
    ) from err

# SFTConfig settings the stages cannot honour, each with why and what to use instead.
_REFUSED_SFT = {
    "loss_type": (lambda v: v != "nll", "the stages compute the model's negative log-likelihood; use loss_type='nll'"),
    "activation_offloading": (bool, "offloading hooks the whole model's forward, which the split model never calls"),
}


def _named_model_dtype(init_kwargs: dict | None, torch_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a checkpoint given by name is loaded in, from `SFTConfig.model_init_kwargs` as
    SFTTrainer reads them (`dtype`, float32 when unset; "auto": as saved). A rank loads only its
    stage's tensors, so the other `from_pretrained` options cannot apply and are refused."""
    init = dict(init_kwargs or {})
    dtype = init.pop("dtype", init.pop("torch_dtype", None))
    if init.get("device_map") is None:
        init.pop("device_map", None)  # SFTTrainer's own setting for a distributed run
    if not init.get("trust_remote_code"):
        init.pop("trust_remote_code", None)
    if init:
        raise ValueError(f"ActCompSFTTrainer loads a model given by name stage by stage and takes only 'dtype' from "
                         f"SFTConfig.model_init_kwargs; got {sorted(init)}. Load the model yourself with "
                         "from_pretrained(name, ...) and pass it as model=, or drop them.")
    if dtype is None:
        return torch_dtype if torch_dtype is not None else torch.float32  # SFTTrainer's default
    if isinstance(dtype, str):
        dtype = None if dtype == "auto" else getattr(torch, dtype)
    if torch_dtype is not None and dtype != torch_dtype:
        raise ValueError(f"torch_dtype={torch_dtype} and SFTConfig.model_init_kwargs dtype={dtype} disagree: set one.")
    return dtype


class UnpackedPaddingFree:
    """Wrap a padding-free collator: its one row of concatenated sequences (`position_ids`
    restart at 0 at each) becomes one right-padded row per sequence with an attention mask.

    The collator already set the label of each sequence's first token to -100, so the targets
    are the same pairs (no prediction crosses from one sequence into the next), Trainer's
    `num_items_in_batch` count is the same, and so is the loss."""

    def __init__(self, collator, pad_token_id: int) -> None:
        self.collator = collator
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.collator(features)
        if "position_ids" not in batch or "attention_mask" in batch:
            return batch
        positions = batch["position_ids"][0]
        real = int(batch["input_ids"].shape[1] if "cu_seq_lens_q" not in batch else batch["cu_seq_lens_q"][-1])
        starts = (positions[:real] == 0).nonzero().flatten().tolist() + [real]
        spans = [(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True) if b > a]
        longest = max(b - a for a, b in spans)
        out = {"input_ids": torch.full((len(spans), longest), self.pad_token_id, dtype=batch["input_ids"].dtype),
               "labels": torch.full((len(spans), longest), -100, dtype=batch["labels"].dtype),
               "attention_mask": torch.zeros((len(spans), longest), dtype=torch.long)}
        for row, (a, b) in enumerate(spans):
            out["input_ids"][row, : b - a] = batch["input_ids"][0, a:b]
            out["labels"][row, : b - a] = batch["labels"][0, a:b]
            out["attention_mask"][row, : b - a] = 1
        return out


class ActCompSFTTrainer(ActCompTrainer, SFTTrainer):
    """`trl.SFTTrainer` that trains the model split into the stages of `plan`, with the plan's
    compression at every boundary. Takes everything `SFTTrainer` takes (`SFTConfig`, datasets of
    text, prompt-completion or conversations, `peft_config`, `formatting_func`, ...) plus `plan=`,
    and `ActCompTrainer`'s `pad_to_length=`, `timeout=`, `torch_dtype=`, `eval_plain_loss=`. A model
    given by name is loaded with `SFTConfig.model_init_kwargs`' dtype (float32 unless set, as
    SFTTrainer does). Run it as is (one
    process) or with `plan.world_size` processes. See docs/trainer.md."""

    _tag_names = ["trl", "sft", "hf-actcomp"]

    def __init__(self, model=None, args=None, *, plan: Plan, torch_dtype: torch.dtype | None = None,
                 **kwargs: Any) -> None:
        for name, (refused, why) in _REFUSED_SFT.items():
            if args is not None and refused(getattr(args, name, None)):
                raise ValueError(f"ActCompSFTTrainer does not support SFTConfig({name}={getattr(args, name)!r}): {why}.")
        if isinstance(model, (str, os.PathLike)) and args is not None:
            torch_dtype = _named_model_dtype(args.model_init_kwargs, torch_dtype)
            args = dataclasses.replace(args, model_init_kwargs=None)  # applied here: SFTTrainer gets the model
        super().__init__(model=model, args=args, plan=plan, torch_dtype=torch_dtype, **kwargs)
        if self.padding_free:
            if self.plan.uses_aqsgd:
                raise ValueError(
                    "AQ-SGD keeps one fixed-shape memory row per training row, and padding-free batches (packing=True "
                    "with packing_strategy='bfd', or padding_free=True) change shape from batch to batch: use "
                    "SFTConfig(packing=True, packing_strategy='wrapped'), or packing=False."
                )
            self.data_collator = self._train_collator = UnpackedPaddingFree(self.data_collator,
                                                                            self._tokenizer.pad_token_id)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """Trainer's loss on the in-process stages (one process; with several, the last stage
        computes it in `Pipeline.train_step`): the same negative log-likelihood as SFTTrainer's."""
        inputs = {k: v for k, v in inputs.items() if k != "use_cache"}
        return Trainer.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def eval_item_count(self, inputs: dict[str, Any]) -> None:
        """SFTTrainer's evaluation loss is each batch's mean per label token (its prediction step
        passes no `num_items_in_batch`)."""
        return None
