"""`ActCompTrainer`'s evaluation: Trainer's own `evaluation_loop`, fed by the stages.

`evaluate()` and `predict()` are Trainer's, so `compute_metrics`, `preprocess_logits_for_metrics`,
`include_for_metrics`, `eval_accumulation_steps`, `batch_eval_metrics`, `prediction_loss_only`
and `metric_for_best_model` keep their contract. What differs is where a batch's loss and logits
come from:

- one process: Trainer's `prediction_step` on the in-process stages (`simulate`);
- several processes: `Pipeline.eval_step` on every rank of the pipeline; only the last stage has
  logits, so it runs `preprocess_logits_for_metrics` on them and shares the result with the
  other stages (`Pipeline.share_predictions`, counted under `predictions`). Every rank already
  evaluated the whole set (evaluation is not sharded), so Trainer's gather across processes is
  switched off for the loop: every rank ends with what plain Trainer returns.

`eval_loss` is Trainer's number: each batch's token-loss sum divided by Trainer's
`num_items_in_batch` count for it (the model's mean when the model takes no loss kwargs),
averaged over batches as Trainer does. Beside it (`EvalExtras`): `eval_plain_loss` (the same
without the boundary codecs), `eval_token_loss` / `eval_plain_token_loss` (the mean per
predicted token over the whole set) and the perplexities, exp of the token losses.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Any

import torch
from accelerate.utils import recursively_apply
from transformers.trainer_pt_utils import nested_detach

from ..batching import count_label_tokens
from ..models.heads import CAUSAL_LM


def trainer_item_count(trainer, inputs: dict[str, Any]) -> int | None:
    """What plain Trainer in one process divides a batch's token-loss sum by, in training and in
    evaluation
    (`Trainer._get_num_items_in_batch` without its cross-process gather, which here would add
    the stages of one pipeline), or None where Trainer lets the model take its own mean."""
    if inputs.get("labels") is None or not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func):
        return None
    # Trainer's own (private) flag for whether its loss shifts the labels: the only place that
    # knows it for `compute_loss_func` and the model's loss type alike.
    return count_label_tokens(inputs["labels"], shifted=trainer._loss_shifts_labels,
                              shift_labels=inputs.get("shift_labels"))


class EvalExtras:
    """The metrics ActCompTrainer adds to Trainer's: the loss without the codec, and (`per_token`:
    a causal LM's) the mean per predicted token with and without it (sums over one evaluation)."""

    def __init__(self, per_token: bool = True) -> None:
        self.per_token = per_token
        self.rows = 0
        self.plain_rows = 0  # rows evaluated without the codec too (none when that pass is off)
        self.plain = 0.0  # sum of the batches' losses without the codec (Trainer's), weighted by rows
        self.token_sums = [0.0, 0.0]  # token-loss sums with and without the codec
        self.tokens = 0

    def add(self, loss: torch.Tensor | None, plain: torch.Tensor | None, count: int | None, labels) -> None:
        """One batch's loss with the codec and, unless the second pass is off (None), without."""
        if loss is None:
            return
        tokens = count_label_tokens(labels)
        divisor = count if count is not None else tokens
        rows = labels.shape[0]  # Trainer weighs a batch's loss by its rows (the last one cut to its own)
        self.rows += rows
        self.token_sums[0] += float(loss) * divisor
        self.tokens += tokens
        if plain is not None:
            self.plain_rows += rows
            self.plain += float(plain) * rows
            self.token_sums[1] += float(plain) * divisor

    def metrics(self, prefix: str) -> dict[str, float]:
        if not self.rows:
            return {}
        token_loss, plain_token_loss = (s / max(self.tokens, 1) for s in self.token_sums)
        out = {f"{prefix}_token_loss": token_loss, f"{prefix}_perplexity": math.exp(min(token_loss, 50.0))}
        if self.plain_rows:
            out.update({f"{prefix}_plain_loss": self.plain / self.plain_rows,
                        f"{prefix}_plain_token_loss": plain_token_loss,
                        f"{prefix}_plain_perplexity": math.exp(min(plain_token_loss, 50.0))})
        if not self.per_token:
            out = {k: v for k, v in out.items() if not k.endswith(("token_loss", "perplexity"))}
        return out


def _labels(trainer, inputs: dict[str, Any]):
    """The labels as Trainer's `prediction_step` returns them (None without them)."""
    if not trainer.label_names or not all(inputs.get(k) is not None for k in trainer.label_names):
        return None
    labels = nested_detach(tuple(inputs.get(name) for name in trainer.label_names))
    return labels[0] if len(labels) == 1 else labels


def in_process_prediction_step(trainer, base, model, inputs, prediction_loss_only: bool, ignore_keys):
    """Trainer's `prediction_step` on the in-process stages, plus the loss without the codec
    (the model itself), noted in `trainer.eval_extras`."""
    loss, logits, labels = base.prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
    plain = None
    if loss is not None and inputs.get("labels") is not None:  # (a reward model's loss has no labels)
        # Trainer's private `_prepare_inputs` (device placement, its input hooks): no public way to
        # prepare a batch exactly as `prediction_step` would.
        inputs = trainer._prepare_inputs(inputs)
        count = trainer.eval_item_count(inputs)
        if trainer.eval_plain_loss:
            plain_inputs = {k: v for k, v in inputs.items() if k != "sample_id"}
            if count is not None and trainer.model_accepts_loss_kwargs:
                plain_inputs["num_items_in_batch"] = count
            with torch.no_grad(), trainer.compute_loss_context_manager(), trainer.autocast_smart_context_manager():
                plain = trainer.model(**plain_inputs).loss.detach()
        trainer.eval_extras.add(loss, plain, count, inputs["labels"])
    return loss, logits, labels


def replicas_loss_scale(trainer, pipe, inputs: dict[str, Any]) -> int:
    """What Trainer under DDP multiplies a classifier's batch mean by in evaluation, as in
    training: the number of processes (here: replicas) where it averages tokens across devices
    and passes the model a count, taking any model with **kwargs to divide by the global count."""
    if pipe.num_replicas == 1 or pipe.task == CAUSAL_LM or inputs.get("labels") is None:
        return 1
    if getattr(trainer, "_labels_made_for_the_stages", False):  # Trainer saw no labels: no count passed
        return 1
    passes_count = trainer.model_accepts_loss_kwargs or trainer.compute_loss_func
    return pipe.num_replicas if trainer.args.average_tokens_across_devices and passes_count else 1


def pipelined_prediction_step(trainer, pipe, inputs, prediction_loss_only: bool, preprocess):
    """Loss, predictions and labels of one batch from this rank's stage: the loss and the
    (preprocessed, on the last stage) logits on every rank of the pipeline."""
    inputs = trainer._prepare_inputs(inputs)
    labels = _labels(trainer, inputs)
    count = trainer.eval_item_count(inputs)
    # Every key, as training passes them: a key the stages cannot take fails as it does there.
    batch = {k: v for k, v in inputs.items() if v is not None}
    out = pipe.eval_step(batch, compress=True, num_items_in_batch=count, keep_logits=not prediction_loss_only)
    loss = out.loss
    if loss is not None:
        scale = replicas_loss_scale(trainer, pipe, inputs)
        loss = loss.detach().to(trainer.args.device) * scale
        plain = (pipe.eval_step(batch, compress=False, num_items_in_batch=count).loss * scale
                 if trainer.eval_plain_loss else None)
        trainer.eval_extras.add(loss, plain, count, batch["labels"])
    if prediction_loss_only:
        return loss, None, None
    predictions = out.logits
    if pipe.is_last and preprocess is not None:
        predictions = preprocess(predictions, labels)
    return loss, pipe.share_predictions(predictions), labels


@contextlib.contextmanager
def without_gathering(trainer):
    """Within one evaluation loop: Trainer's gather and padding across processes act as in one
    process (every rank holds the whole evaluation already: the last batch's repeated losses are
    cut to its real rows, as `gather_for_metrics` does), and its own
    `preprocess_logits_for_metrics` is skipped (the last stage ran it); all restored after."""
    accelerator, preprocess = trainer.accelerator, trainer.preprocess_logits_for_metrics
    trainer.gather_function = partial(_as_one_process, accelerator.gradient_state)
    accelerator.pad_across_processes = _identity
    trainer.preprocess_logits_for_metrics = None
    try:
        yield preprocess
    finally:
        del accelerator.pad_across_processes  # the instance attribute: the method shows again
        trainer.gather_function = accelerator.gather_for_metrics
        trainer.preprocess_logits_for_metrics = preprocess


def _as_one_process(gradient_state, data):
    """`Accelerator.gather_for_metrics` of a single process: the data, with the last batch cut to
    the rows the data set really has (Trainer repeats a batch's loss `eval_batch_size` times)."""
    if gradient_state.end_of_dataloader and gradient_state.remainder > 0:
        return recursively_apply(lambda t: t[: gradient_state.remainder], data)
    return data


def _identity(tensor, *args, **kwargs):  # noqa: ARG001 (pad_across_processes' dim, pad_index, pad_first)
    return tensor
