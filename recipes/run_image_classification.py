"""transformers' `examples/pytorch/image-classification/run_image_classification.py`, restated, with
two lines changed.

The steps are the original's: arguments through `HfArgumentParser` (with `TrainingArguments`), an
image folder per split (`--train_dir` / `--validation_dir`, one sub-folder per class, read with
`load_dataset("imagefolder")`) or, offline by default, a generated set of 8 x 8 grey images of
bars (horizontal, vertical, and the two diagonals, at random places, with noise: 4 classes); the
label list from the dataset's features; the image processor's resize and normalisation
(`AutoImageProcessor` of the checkpoint; for the default model, pixels scaled to [-1, 1] as
ViT's processor does) applied on the fly with `set_transform`; an
`AutoModelForImageClassification` with `label2id` / `id2label`; a collator stacking
`pixel_values` and `labels`; `remove_unused_columns=False` (the transform reads the image
column); train, evaluate with accuracy, `save_metrics`. What changes for hf-actcomp is the `plan`
and `ActCompTrainer(` where the original writes `Trainer(` (`--plain` runs the original, for a
side by side). The original's random crop and flip are left out: so that a run is comparable
with the plain one image for image; accuracy is computed with numpy instead of
`evaluate.load("accuracy")`, which downloads the metric's script.

    python recipes/run_image_classification.py --output_dir out --do_train --do_eval
    torchrun --nproc-per-node 2 recipes/run_image_classification.py --output_dir out --do_train --do_eval

The default model is a small ViT (2 x 2 patches, hidden 64, 4 layers) built from scratch; give
`--model_name_or_path` for a ViT checkpoint (`ignore_mismatched_sizes` for another label count).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import datasets
import numpy as np
import torch
from transformers import (
    AutoImageProcessor,
    AutoModelForImageClassification,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    ViTConfig,
    set_seed,
)

import hf_actcomp

BARS = ("horizontal", "vertical", "diagonal", "anti-diagonal")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A local ViT checkpoint or Hub id; default: a small random ViT for 8 x 8 grey images."})
    ignore_mismatched_sizes: bool = field(default=False, metadata={
        "help": "Load a checkpoint whose classifier has another number of labels (a new head)."})


@dataclass
class DataTrainingArguments:
    train_dir: str | None = field(default=None, metadata={"help": "An image folder: one sub-folder per class."})
    validation_dir: str | None = field(default=None, metadata={"help": "As train_dir; required with it."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training images."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N evaluation images."})
    generated_images: int = field(default=512, metadata={"help": "Size of the offline set (a fifth held out)."})


@dataclass
class ActCompArguments:
    plan: str | None = field(default=None, metadata={
        "help": "A plan file (YAML or JSON); default: 2 stages, no compression."})
    plain: bool = field(default=False, metadata={"help": "Run transformers.Trainer on the whole model instead."})


def bars(count: int, seed: int = 0) -> datasets.DatasetDict:
    """`count` 8 x 8 grey images of one bar each (the class: its direction), placed at random,
    plus noise; a fifth held out. Pixels in [0, 1], one channel."""
    g = np.random.default_rng(seed)
    images, labels = [], []
    for i in range(count):
        label, at = i % len(BARS), int(g.integers(0, 8))
        image = g.uniform(0, 0.3, (8, 8))
        for k in range(8):
            row, col = [(at, k), (k, at), (k, (k + at) % 8), (k, (at - k) % 8)][label]
            image[row, col] = 1.0
        images.append(image[None].tolist())
        labels.append(label)
    names = datasets.ClassLabel(names=list(BARS))
    features = datasets.Features({"pixel_values": datasets.Array3D((1, 8, 8), "float32"), "label": names})
    full = datasets.Dataset.from_dict({"pixel_values": images, "label": labels}, features=features)
    cut = count * 4 // 5
    return datasets.DatasetDict(train=full.select(range(cut)), validation=full.select(range(cut, count)))


def compute_metrics(eval_preds):
    logits, labels = eval_preds
    logits = logits[0] if isinstance(logits, tuple) else logits
    return {"accuracy": float((np.argmax(logits, axis=1) == labels).mean())}


def collate_fn(examples):
    return {"pixel_values": torch.stack([torch.as_tensor(e["pixel_values"]) for e in examples]),
            "labels": torch.tensor([e["label"] for e in examples])}


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments, ActCompArguments))
    model_args, data_args, training_args, actcomp_args = parser.parse_args_into_dataclasses(args=argv)
    training_args.remove_unused_columns = False  # as the original: the transform reads the image column
    set_seed(training_args.seed)

    if data_args.train_dir is None:
        raw = bars(data_args.generated_images, training_args.seed)
    else:
        if data_args.validation_dir is None:
            raise ValueError("--train_dir needs --validation_dir.")
        raw = datasets.load_dataset("imagefolder", data_files={"train": os.path.join(data_args.train_dir, "**"),
                                                               "validation": os.path.join(data_args.validation_dir, "**")})
    labels = raw["train"].features["label"].names
    label2id, id2label = {name: i for i, name in enumerate(labels)}, dict(enumerate(labels))

    if model_args.model_name_or_path:
        processor = AutoImageProcessor.from_pretrained(model_args.model_name_or_path)
        model = AutoModelForImageClassification.from_pretrained(
            model_args.model_name_or_path, num_labels=len(labels), label2id=label2id, id2label=id2label,
            ignore_mismatched_sizes=model_args.ignore_mismatched_sizes)

        def transform(batch):
            batch["pixel_values"] = processor([image.convert("RGB") for image in batch["image"]],
                                              return_tensors="pt")["pixel_values"]
            return batch
    else:
        config = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4,
                           num_attention_heads=4, intermediate_size=128, num_labels=len(labels), label2id=label2id,
                           id2label=id2label)
        model = AutoModelForImageClassification.from_config(config)

        def transform(batch):  # ViT's normalisation: mean 0.5, std 0.5
            if "image" in batch:  # an image folder of 8 x 8 grey images
                batch["pixel_values"] = [np.asarray(i.convert("L"), dtype=np.float32)[None] / 255 for i in batch["image"]]
            batch["pixel_values"] = [(torch.as_tensor(p) - 0.5) / 0.5 for p in batch["pixel_values"]]
            return batch

    train, evaluation = raw["train"], raw["validation"]
    if data_args.max_train_samples is not None:
        train = train.shuffle(seed=training_args.seed).select(range(min(data_args.max_train_samples, len(train))))
    if data_args.max_eval_samples is not None:
        evaluation = evaluation.shuffle(seed=training_args.seed).select(range(min(data_args.max_eval_samples,
                                                                                  len(evaluation))))
    train.set_transform(transform)
    evaluation.set_transform(transform)

    common = dict(model=model, args=training_args, train_dataset=train if training_args.do_train else None,
                  eval_dataset=evaluation if training_args.do_eval else None, data_collator=collate_fn,
                  compute_metrics=compute_metrics)
    if actcomp_args.plain:
        trainer = Trainer(**common)
    else:
        plan = hf_actcomp.Plan(num_stages=2) if actcomp_args.plan is None else hf_actcomp.Plan.from_file(actcomp_args.plan)
        trainer = hf_actcomp.ActCompTrainer(plan=plan, **common)

    results = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        trainer.save_state()
        results.update(train_result.metrics)
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
    trainer.end()  # the process groups go before exit (see run_clm.py)
    return results


if __name__ == "__main__":
    main()
