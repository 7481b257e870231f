"""A ViT on scikit-learn's handwritten digits through compressed boundaries, as Rudakov et al.
measured image classification beside LM fine-tuning: TopK at 30% and 10% on activations and
their gradients, with and without AQ-SGD, against uncompressed; 3 seeds; accuracy with plain
inference and with the training codec at inference.

The digits (`sklearn.datasets.load_digits`: 1,797 images of 8 x 8 pixels, 16 grey levels) are
the only image set at hand offline, and no pretrained ViT exists at that size, so the ViT trains
from scratch: 2 x 2 patches (16 + [CLS] = 17 positions), hidden 64, 4 layers, split in 2 stages
after layer 2. Every fifth image is held out (360), the rest train (1,437).

    pip install "hf-actcomp[bench]"            # scikit-learn, for load_digits
    python benchmarks/vit_digits.py                  # the grid: 5 settings x 3 seeds
    python benchmarks/vit_digits.py --quick          # 2 settings, 1 seed, 2 epochs
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.utils.data import DataLoader
from transformers import ViTConfig, ViTForImageClassification, default_data_collator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_model_classification import accuracy, settings, train_classifier, write_rows  # noqa: E402
from real_model_finetune import add_grid_arguments, run_grid  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def digits() -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows of pixel_values in [0, 1] (1 x 8 x 8), labels and, for training, sample ids."""
    from sklearn.datasets import load_digits

    data = load_digits()
    train, held_out = [], []
    for i, (image, label) in enumerate(zip(data.images, data.target, strict=True)):
        row = {"pixel_values": (image[None] / 16.0).tolist(), "labels": int(label)}
        (held_out if i % 5 == 0 else train).append(row)
    for i, row in enumerate(train):
        row["sample_id"] = i
    return train, held_out


def vit(seed: int) -> ViTForImageClassification:
    torch.manual_seed(seed)
    config = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4,
                       num_attention_heads=4, intermediate_size=128, num_labels=10)
    return ViTForImageClassification(config)


def write(rows: list[dict], meta: dict, name: str) -> None:
    a = meta["args"]
    write_rows(rows, meta, name, [
        "# A ViT on scikit-learn's digits through compressed boundaries", "",
        f"`benchmarks/vit_digits.py`: ViT (2 x 2 patches of 8 x 8 grey images, 17 positions, hidden 64, 4 layers, "
        f"trained from scratch) split into 2 stages after layer 2, `simulate`; {meta['train_rows']} training "
        f"images, {meta['eval_rows']} held out (every fifth); {a['epochs']} epochs, batch {a['batch_size']} in "
        f"{a['micro_batches']} micro-batches, AdamW lr {a['lr']}. Chance: 10%; untrained: "
        f"{100 * meta['accuracy_before']:.1f}%. Per seed the same initialisation and batch order for every "
        "setting; median [min-max] over seeds; gap: accuracy points against `none` of the same seed; one "
        "held-out image is 0.28 points. 'with the codec': held-out accuracy with the training codec at the "
        f"boundary at inference (`inference=\"direct\"`). {meta['machine']}; finished "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
    ])


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 settings, one seed, 2 epochs")
    add_grid_arguments(p, "vit_digits", epochs=10, settings="all")
    p.set_defaults(stages=[2], batch_size=32, lr=1e-3)
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds = 2, [0]
        args.settings = args.settings or ["none", "AQ-SGD + topk 10%"]
        args.name = "vit_digits_quick"
    data = digits()

    def before() -> float:
        return accuracy(vit(0).eval(), DataLoader(data[1], batch_size=64, collate_fn=default_data_collator))[0]

    run_grid(p, args, args.settings or list(settings()), settings(), ("epochs", "batch_size", "micro_batches", "lr"),
             {"train_rows": len(data[0]), "eval_rows": len(data[1])}, before,
             lambda name, stages, seed: train_classifier(vit(seed), name, stages, seed, data, args, eval_batch=64),
             lambda rows, meta: write(rows, meta, args.name), before_key="accuracy_before")


if __name__ == "__main__":
    main()
