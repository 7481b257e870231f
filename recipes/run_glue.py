"""transformers' `examples/pytorch/text-classification/run_glue.py`, restated, with two lines changed.

The steps are the original's: arguments through `HfArgumentParser` (with `TrainingArguments`), a
sentence or sentence-pair classification set (local CSV or JSON files with `sentence1`,
optionally `sentence2`, and `label` columns, as the original takes them; or, offline by default,
a pair task built from the Python reference documentation every CPython carries: are these two
lines consecutive?), the label list from the training set, tokenize the pairs (segments in
`token_type_ids`) padded to `max_seq_length`, an `AutoModelForSequenceClassification`, train,
evaluate with `compute_metrics` (accuracy, and F1 for two labels as GLUE's MRPC and QQP report),
`save_metrics`. What changes for hf-actcomp is the `plan` and `ActCompTrainer(` where the original
writes `Trainer(` (`--plain` runs the original, for a side by side). The original loads its metric
with `evaluate.load("glue", ...)`, which downloads the metric's script; the same numbers are
computed with numpy here.

    python recipes/run_glue.py --output_dir out --do_train --do_eval          # the stages in one process
    torchrun --nproc-per-node 2 recipes/run_glue.py --output_dir out --do_train --do_eval   # one per process

The default model is a small BERT built from scratch over a tokenizer trained offline; give
`--model_name_or_path` for a checkpoint (BERT, RoBERTa or any decoder family's classifier: set its
pad token, which sequence classification pools by).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import datasets
import numpy as np
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import hf_actcomp
from hf_actcomp.data import build_tokenizer, offline_corpus


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A local checkpoint directory or Hub id; default: a small random BERT (4 layers, hidden 128)."})
    config_overrides: str | None = field(default=None, metadata={
        "help": "For the model built from scratch: e.g. 'num_hidden_layers=2,hidden_dropout_prob=0.0'."})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "CSV or JSON with sentence1, [sentence2,] label."})
    validation_file: str | None = field(default=None, metadata={"help": "As train_file; required with it."})
    max_seq_length: int = field(default=64, metadata={"help": "Tokens per row, pairs truncated and padded to it."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N evaluation rows."})
    max_texts: int | None = field(default=2000, metadata={"help": "Read at most N lines of the offline corpus."})


@dataclass
class ActCompArguments:
    plan: str | None = field(default=None, metadata={
        "help": "A plan file (YAML or JSON); default: 2 stages, no compression."})
    plain: bool = field(default=False, metadata={"help": "Run transformers.Trainer on the whole model instead."})


def offline_pairs(max_texts: int | None) -> datasets.DatasetDict:
    """Pairs of documentation lines, labelled 1 where the second follows the first and 0 where it
    is a line from elsewhere: a GLUE-style pair task (like QNLI's "does the sentence answer?")
    that needs no download. The last tenth of the lines is held out. Each line is cut to its first
    200 characters (some are whole paragraphs; the pairs are cut to `max_seq_length` tokens anyway)."""
    lines = [t.strip()[:200] for t in offline_corpus()[:max_texts] if len(t.strip()) > 20]
    rows = [{"sentence1": a, "sentence2": b if i % 2 == 0 else lines[(i * 7919 + 13) % len(lines)], "label": 1 - i % 2}
            for i, (a, b) in enumerate(zip(lines, lines[1:], strict=False))]
    cut = len(rows) * 9 // 10
    return datasets.DatasetDict(train=datasets.Dataset.from_list(rows[:cut]),
                                validation=datasets.Dataset.from_list(rows[cut:]))


def load_raw(data_args: DataTrainingArguments) -> datasets.DatasetDict:
    if data_args.train_file is None:
        return offline_pairs(data_args.max_texts)
    if data_args.validation_file is None:
        raise ValueError("--train_file needs --validation_file (the original takes both).")
    kind = "csv" if data_args.train_file.endswith(".csv") else "json"
    return datasets.load_dataset(kind, data_files={"train": data_args.train_file,
                                                   "validation": data_args.validation_file})


def compute_metrics(eval_preds):
    """Accuracy, and for two labels F1 of the positive class, as GLUE's metric reports them."""
    logits, labels = eval_preds
    logits = logits[0] if isinstance(logits, tuple) else logits
    preds = np.argmax(logits, axis=1)
    metrics = {"accuracy": float((preds == labels).mean())}
    if logits.shape[1] == 2:
        tp, fp, fn = (float(((preds == p) & (labels == t)).sum()) for p, t in ((1, 1), (1, 0), (0, 1)))
        metrics["f1"] = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    return metrics


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments, ActCompArguments))
    model_args, data_args, training_args, actcomp_args = parser.parse_args_into_dataclasses(args=argv)
    set_seed(training_args.seed)

    raw = load_raw(data_args)
    label_list = sorted(raw["train"].unique("label"))
    num_labels = len(label_list)
    pairs = "sentence2" in raw["train"].column_names

    if model_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
        model = AutoModelForSequenceClassification.from_pretrained(model_args.model_name_or_path, num_labels=num_labels)
    else:
        tokenizer = build_tokenizer(raw["train"]["sentence1"], vocab_size=512)
        config = BertConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=256, max_position_embeddings=data_args.max_seq_length,
                            pad_token_id=tokenizer.pad_token_id, num_labels=num_labels)
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        model = AutoModelForSequenceClassification.from_config(config)
    label_to_id = {v: i for i, v in enumerate(label_list)}
    model.config.label2id, model.config.id2label = label_to_id, {i: str(v) for v, i in label_to_id.items()}
    # BERT-style segments where the model has them (its token_type_ids embedding); decoders take none.
    segments = getattr(model.config, "type_vocab_size", 0) > 1

    def preprocess(rows):
        texts = (rows["sentence1"], rows["sentence2"]) if pairs else (rows["sentence1"],)
        out = tokenizer(*texts, padding="max_length", max_length=data_args.max_seq_length, truncation=True,
                        return_token_type_ids=segments)
        out["label"] = [label_to_id[v] for v in rows["label"]]
        return out

    with training_args.main_process_first(desc="dataset map pre-processing"):
        encoded = raw.map(preprocess, batched=True, remove_columns=[c for c in raw["train"].column_names
                                                                     if c != "label"])
    train, evaluation = encoded["train"], encoded["validation"]
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    if data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(data_args.max_eval_samples, len(evaluation))))

    common = dict(model=model, args=training_args, train_dataset=train if training_args.do_train else None,
                  eval_dataset=evaluation if training_args.do_eval else None, processing_class=tokenizer,
                  data_collator=default_data_collator, compute_metrics=compute_metrics)
    if actcomp_args.plain:
        trainer = Trainer(**common)
    else:
        plan = hf_actcomp.Plan(num_stages=2) if actcomp_args.plan is None else hf_actcomp.Plan.from_file(actcomp_args.plan)
        trainer = hf_actcomp.ActCompTrainer(plan=plan, **common)

    results = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = {**train_result.metrics, "train_samples": len(train)}
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results.update(metrics)
    if training_args.do_eval:
        metrics = {**trainer.evaluate(), "eval_samples": len(evaluation)}
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
    trainer.end()  # the process groups go before exit (see run_clm.py)
    return results


if __name__ == "__main__":
    main()
