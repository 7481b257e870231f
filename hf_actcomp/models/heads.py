"""What the last stage computes after the last block, by task, and its loss.

Five tasks, told apart by the model's class as transformers names it:

- `causal_lm` (`...ForCausalLM`, `GPT2LMHeadModel`): the family adapter's own `head` (token
  logits) and the model's `loss_function` (token sum over the step's label tokens);
- `sequence_classification` (`...ForSequenceClassification`, the head of reward models): the
  final norm, the `score` layer, then each row's logits at its last non-pad token, found from
  `input_ids` and `config.pad_token_id` as transformers does (every rank reads the batch, so
  the last stage has the ids); the loss as `config.problem_type` says (regression,
  single- or multi-label);
- `token_classification` (`...ForTokenClassification`): the final norm, dropout and the
  classifier on every position; cross-entropy over the labelled tokens (labels not shifted);
- `masked_lm` (`...ForMaskedLM`, encoders): the LM head on every position; cross-entropy over
  the vocabulary at the labelled (masked) tokens, labels not shifted;
- `image_classification` (`...ForImageClassification`, ViT: models/vision.py): the family's head on
  the [CLS] token; the loss as the sequence classifier's (transformers maps the class to it).

Encoders (models/encoder.py) run their own heads (BERT's pooler on the first token, RoBERTa's
classification head) in place of the decoders' final norm and pooling; the losses are these.

The loss of a micro-batch is the unsplit model's loss of the whole batch restricted to it: the
sum of its terms divided by the step's count of them (`batching.count_items`), so the
micro-batches add up to the model's mean exactly. The count is of label tokens for the causal LM
(shifted), token classification and the masked LM, of labelled rows for single-label
classification, and of rows for regression and multi-label classification (whose means run over
rows x num_labels elements).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.loss.loss_utils import fixed_cross_entropy

CAUSAL_LM = "causal_lm"
SEQUENCE_CLASSIFICATION = "sequence_classification"
TOKEN_CLASSIFICATION = "token_classification"
MASKED_LM = "masked_lm"
IMAGE_CLASSIFICATION = "image_classification"
TASKS = (CAUSAL_LM, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, MASKED_LM, IMAGE_CLASSIFICATION)

# The task head's modules after the final norm, by task: the first set whose modules all exist.
HEAD_MODULES = {
    SEQUENCE_CLASSIFICATION: (("score",),),
    TOKEN_CLASSIFICATION: (("dropout", "classifier"), ("dropout", "score")),
}


def task_of(model: nn.Module) -> str:
    """The task of `model`, from its class name as transformers' auto classes name them."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return CAUSAL_LM
    if name.endswith("ForSequenceClassification"):
        return SEQUENCE_CLASSIFICATION
    if name.endswith("ForTokenClassification"):
        return TOKEN_CLASSIFICATION
    if name.endswith("ForMaskedLM"):
        return MASKED_LM
    if name.endswith("ForImageClassification"):
        return IMAGE_CLASSIFICATION
    raise ValueError(
        f"{name} is not a model hf-actcomp splits: it takes a family's causal LM (AutoModelForCausalLM), "
        "sequence classifier (AutoModelForSequenceClassification), token classifier "
        "(AutoModelForTokenClassification) or an encoder's masked LM (AutoModelForMaskedLM)."
    )


def head_module_paths(model: nn.Module, task: str) -> list[str]:
    """The task head's modules (after the final norm) of a classifier, by name in `model`."""
    names = {name for name, _ in model.named_children()}
    for paths in HEAD_MODULES[task]:
        if set(paths) <= names:
            return list(paths)
    raise ValueError(f"{type(model).__name__} has none of the {task} head modules hf-actcomp knows "
                     f"({' or '.join('+'.join(p) for p in HEAD_MODULES[task])}).")


def check_rows(task: str, config, rows: int) -> None:
    """Refuse, before any work, a batch the unsplit sequence classifier refuses: several rows and
    no pad token to find each row's last token by (micro-batches of one row would hide it)."""
    if task == SEQUENCE_CLASSIFICATION and config.get_text_config().pad_token_id is None and rows != 1:
        raise ValueError(NO_PAD_TOKEN)


NO_PAD_TOKEN = ("Cannot handle batch sizes > 1 if no padding token is defined: set model.config.pad_token_id "
                "(a sequence classifier pools at each row's last non-pad token).")


def last_non_pad_logits(logits: Tensor, input_ids: Tensor | None, config) -> Tensor:
    """Each row's logits at its rightmost token that is not `pad_token_id` (left or right padding),
    as transformers' sequence classifiers pool; the last position without a pad token (one row)."""
    pad = config.get_text_config().pad_token_id
    rows = logits.shape[0]
    if pad is None and rows != 1:
        raise ValueError(NO_PAD_TOKEN)
    if pad is None or input_ids is None:
        last = torch.full((rows,), -1, device=logits.device, dtype=torch.long)
    else:
        non_pad = (input_ids != pad).to(logits.device, torch.int32)
        positions = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
        last = (positions * non_pad).argmax(-1)
    return logits[torch.arange(rows, device=logits.device), last]


def problem_type(config, labels: Tensor, record: bool = True) -> str:
    """`config.problem_type`, decided from the labels the first time as transformers decides it
    and, with `record`, recorded on the config as the model's own loss records it. Counting
    (`batching.count_items`) does not record: a trainer with its own loss (a reward model's) never
    runs the model's, and the config stays as the plain trainer leaves it."""
    if config.problem_type is not None:
        return config.problem_type
    if config.num_labels == 1:
        kind = "regression"
    elif labels.dtype in (torch.long, torch.int):
        kind = "single_label_classification"
    else:
        kind = "multi_label_classification"
    if record:
        config.problem_type = kind
    return kind


def takes_item_count(task: str, config, labels: Tensor | None) -> bool:
    """Whether the model's own forward divides its loss by a `num_items_in_batch` it is given, as
    Trainer passes under gradient accumulation: the causal LM (its token sum over the count) and an
    image classifier's single-label loss (transformers' `ForSequenceClassificationLoss` passes the
    count on to its cross-entropy); the sequence and token classifiers and the masked LM take their
    call's mean whatever they are given, and so do regression and multi-label losses."""
    if task == CAUSAL_LM:
        return True
    return (task == IMAGE_CLASSIFICATION and labels is not None
            and problem_type(config, labels, record=False) == "single_label_classification")


def classification_loss(task: str, config, logits: Tensor, labels: Tensor,
                        normaliser: int | Tensor | None) -> Tensor:
    """The loss of a classifier's (or masked LM's) micro-batch: its terms' sum over `normaliser`
    (the step's `batching.count_items`), or the model's own mean when `normaliser` is None."""
    labels = labels.to(logits.device)
    num_labels = config.num_labels
    if task == MASKED_LM:
        return fixed_cross_entropy(logits.view(-1, config.vocab_size), labels.view(-1), num_items_in_batch=normaliser)
    if task == TOKEN_CLASSIFICATION:
        return fixed_cross_entropy(logits.view(-1, num_labels).float(), labels.view(-1),
                                   num_items_in_batch=normaliser)
    kind = problem_type(config, labels)
    if kind == "single_label_classification":
        return fixed_cross_entropy(logits.view(-1, num_labels), labels.view(-1), num_items_in_batch=normaliser)
    if kind == "regression":
        loss = (nn.functional.mse_loss(logits.squeeze(), labels.squeeze()) if num_labels == 1
                else nn.functional.mse_loss(logits, labels))
    elif kind == "multi_label_classification":
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
    else:
        raise ValueError(f"config.problem_type={kind!r}: choose regression, single_label_classification "
                         "or multi_label_classification.")
    return loss if normaliser is None else loss * labels.shape[0] / normaliser
