"""transformers' `examples/pytorch/language-modeling/run_clm.py`, restated, with two lines changed.

The steps are the original's: arguments through `HfArgumentParser` (with `TrainingArguments`),
raw text (a local text file through `load_dataset("text")`, or, offline by default, the Python
reference documentation every CPython carries), tokenize, concatenate and cut into blocks of
`block_size`, `preprocess_logits_for_metrics` (argmax) and `compute_metrics` (next-token accuracy),
train, evaluate, perplexity, `save_metrics`. What changes for hf-actcomp is the `plan` and
`ActCompTrainer(` where the original writes `Trainer(` (`--plain` runs the original, for a side
by side). The original computes accuracy with `evaluate.load("accuracy")`, which downloads the
metric's script; here the same number is computed with numpy.

    python recipes/run_clm.py --output_dir out --do_train --do_eval          # the stages in one process
    torchrun --nproc-per-node 2 recipes/run_clm.py --output_dir out --do_train --do_eval   # one per process

Any `TrainingArguments` flag works (`--eval_strategy steps --eval_steps 10 --metric_for_best_model
accuracy --load_best_model_at_end`, ...). On a machine without a GPU neither launcher needs extra
environment: `ActCompTrainer` counts the processes itself.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from itertools import chain

import datasets
import numpy as np
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
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
        "help": "A local checkpoint directory or Hub id; default: a small random GPT-2 (4 layers, hidden 128)."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Default: the model's, or one trained offline."})
    config_overrides: str | None = field(default=None, metadata={
        "help": "For the model built from scratch, as in run_clm: e.g. 'n_layer=2,resid_pdrop=0.0'."})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "A text file; default: CPython's own docs."})
    validation_split_percentage: int = field(default=5, metadata={"help": "Held out for evaluation, in percent."})
    block_size: int = field(default=64, metadata={"help": "Tokens per training row."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N evaluation blocks."})
    max_texts: int | None = field(default=2000, metadata={"help": "Read at most N lines of the offline corpus."})


@dataclass
class ActCompArguments:
    plan: str | None = field(default=None, metadata={
        "help": "A plan file (YAML or JSON, e.g. recipes/configs/plan_aqsgd_fw4_bw8.yaml); default: 2 stages, "
                "no compression."})
    plain: bool = field(default=False, metadata={"help": "Run transformers.Trainer on the whole model instead."})


def load_plan(path: str | None) -> hf_actcomp.Plan:
    """The plan in `path` (JSON or YAML), or two stages without compression."""
    return hf_actcomp.Plan(num_stages=2) if path is None else hf_actcomp.Plan.from_file(path)


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):  # some models return more than the logits
        logits = logits[0]
    return logits.argmax(dim=-1)


def compute_metrics(eval_preds):
    """Next-token accuracy, as run_clm's `evaluate.load("accuracy")` computes it."""
    preds, labels = eval_preds
    labels = labels[:, 1:].reshape(-1)  # preds have the same shape as the labels, after the argmax
    preds = preds[:, :-1].reshape(-1)
    keep = labels != -100
    return {"accuracy": float(np.mean(preds[keep] == labels[keep]))}


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments, ActCompArguments))
    model_args, data_args, training_args, actcomp_args = parser.parse_args_into_dataclasses(args=argv)
    set_seed(training_args.seed)

    if data_args.train_file is not None:
        raw = datasets.load_dataset("text", data_files={"train": data_args.train_file})["train"]
    else:
        raw = datasets.Dataset.from_dict({"text": offline_corpus()[: data_args.max_texts]})
    raw = raw.filter(lambda row: bool(row["text"].strip()))
    split = raw.train_test_split(test_size=data_args.validation_split_percentage / 100, shuffle=False)

    name = model_args.tokenizer_name or model_args.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(name) if name else build_tokenizer(raw["text"], vocab_size=512)
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    else:
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=data_args.block_size, n_embd=128, n_layer=4,
                            n_head=4, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        if model_args.config_overrides:
            config.update_from_string(model_args.config_overrides)
        model = AutoModelForCausalLM.from_config(config)

    def tokenize(rows):
        return tokenizer(rows["text"])

    def group_texts(rows):
        joined = {k: list(chain(*rows[k])) for k in rows}
        total = (len(joined["input_ids"]) // data_args.block_size) * data_args.block_size
        out = {k: [t[i: i + data_args.block_size] for i in range(0, total, data_args.block_size)]
               for k, t in joined.items()}
        out["labels"] = out["input_ids"].copy()
        return out

    with training_args.main_process_first(desc="dataset map tokenization"):
        lm = split.map(tokenize, batched=True, remove_columns=["text"]).map(group_texts, batched=True)
    train, evaluation = lm["train"], lm["test"]
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    if data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(data_args.max_eval_samples, len(evaluation))))

    common = dict(model=model, args=training_args, train_dataset=train if training_args.do_train else None,
                  eval_dataset=evaluation if training_args.do_eval else None, processing_class=tokenizer,
                  data_collator=default_data_collator, compute_metrics=compute_metrics,
                  preprocess_logits_for_metrics=preprocess_logits_for_metrics)
    if actcomp_args.plain:
        trainer = Trainer(**common)
    else:
        trainer = hf_actcomp.ActCompTrainer(plan=load_plan(actcomp_args.plan), **common)

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
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(evaluation)
        metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
    # Destroy the process groups before exit (transformers' Trainer.end): left to interpreter
    # shutdown, gloo's destructor can abort a rank ("terminate called without an active exception").
    trainer.end()
    return results


if __name__ == "__main__":
    main()
