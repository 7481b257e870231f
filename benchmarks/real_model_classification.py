"""Classification through compressed boundaries on a real pretrained LLM, as the seeds measured it:
SmolLM2-135M with a sequence-classification head, fine-tuned to tell which standard-library module
a function comes from, each plan's accuracy beside uncompressed, 3 seeds.

The task, offline: every function and method of `--modules` (ast), its source cut to `--seq_len`
tokens, labelled by module; per module the first `--train_per_class` (in source order) train and
the last `--eval_per_class` are held out. Per (stages, setting, seed): a fresh copy of the model from
the fixture (benchmarks/smollm2.py) with a freshly seeded score head, AdamW, the same batches in the
same order for every setting of a seed (`simulate`, one process). After training, held-out
accuracy and loss with plain inference (the trained weights alone) and with the training codec
itself at the boundaries (`inference="direct"`: whether a model trained with compression needs it
at inference). Settings: TopK at 30% and 10% on activations and their gradients, without and with
AQ-SGD (TopK on the deltas), as Rudakov et al. compared them.

    python benchmarks/real_model_classification.py                 # ~30 min here
    python benchmarks/real_model_classification.py --quick         # checks the script (~2 min)
"""

from __future__ import annotations

import ast
import json
import os
import statistics
import sys
import sysconfig
from dataclasses import replace

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, default_data_collator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smollm2  # noqa: E402
from harness import write_markdown  # noqa: E402
from real_model_finetune import add_grid_arguments, run_grid, train_simulated  # noqa: E402

import hf_actcomp  # noqa: E402
from hf_actcomp import Compression  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def settings() -> dict[str, tuple[Compression, Compression]]:
    """(forward, backward) per label: TopK on both directions, with and without AQ-SGD."""
    def topk(ratio):
        return Compression("topk", ratio=ratio)

    def aqsgd(ratio):
        return Compression("aqsgd", inner="topk", ratio=ratio)

    return {"none": (Compression(), Compression()),
            "topk 30%": (topk(0.3), topk(0.3)), "topk 10%": (topk(0.1), topk(0.1)),
            "AQ-SGD + topk 30%": (aqsgd(0.3), topk(0.3)), "AQ-SGD + topk 10%": (aqsgd(0.1), topk(0.1))}


def functions_by_module(modules: list[str]) -> dict[str, list[str]]:
    """Source of every function and method of each stdlib module, in source order."""
    out = {}
    for module in modules:
        path = os.path.join(sysconfig.get_paths()["stdlib"], f"{module}.py")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        nodes = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        out[module] = [ast.get_source_segment(text, n) for n in sorted(nodes, key=lambda n: n.lineno)]
    return out


def datasets_of(tokenizer, args) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows: input_ids / attention_mask padded to seq_len, labels, sample_id."""
    train, held_out = [], []
    for label, (module, sources) in enumerate(functions_by_module(args.modules).items()):
        need = args.train_per_class + args.eval_per_class
        if len(sources) < need:
            raise SystemExit(f"{module} has {len(sources)} functions; {need} needed")
        for i, source in enumerate(sources[: args.train_per_class] + sources[-args.eval_per_class:]):
            ids = tokenizer(source, truncation=True, max_length=args.seq_len)["input_ids"]
            pad = args.seq_len - len(ids)
            row = {"input_ids": ids + [tokenizer.pad_token_id] * pad, "attention_mask": [1] * len(ids) + [0] * pad,
                   "labels": label}
            (train if i < args.train_per_class else held_out).append(row)
    for i, row in enumerate(train):
        row["sample_id"] = i
    return train, held_out


@torch.no_grad()
def accuracy(model, loader) -> tuple[float, float]:
    """(accuracy, mean loss) over `loader` (a model, a simulate() module or compressed inference)."""
    right = total = 0
    loss = 0.0
    for batch in loader:
        batch = {k: v for k, v in batch.items() if k != "sample_id"}
        out = model(**batch)
        right += int((out.logits.argmax(-1) == batch["labels"]).sum())
        total += batch["labels"].numel()
        loss += float(out.loss) * batch["labels"].numel()
    return right / total, loss / total


def load_classifier(num_labels: int, pad_token_id: int):
    model = AutoModelForSequenceClassification.from_pretrained(smollm2.smollm2_dir(), num_labels=num_labels,
                                                               dtype=torch.float32)
    model.config.pad_token_id = pad_token_id
    return model


def finetune(name: str, stages: int, seed: int, data, args, pad_token_id: int) -> dict:
    torch.manual_seed(seed)  # the score head's initialisation
    model = load_classifier(len(args.modules), pad_token_id)
    return train_classifier(model, name, stages, seed, data, args, eval_batch=16)


def train_classifier(model, name: str, stages: int, seed: int, data, args, eval_batch: int) -> dict:
    """`model` trained through the setting `name`'s boundaries: held-out accuracy after each
    epoch (plain inference) and with the training codec at inference, bytes, seconds."""
    train, held_out = data
    forward, backward = settings()[name]
    evaluation = DataLoader(held_out, batch_size=eval_batch, collate_fn=default_data_collator)
    run = train_simulated(model, forward, backward, stages, seed, train, args, lambda: accuracy(model, evaluation))
    plan, curve, epochs, seconds, sent, raw = (run[k] for k in ("plan", "curve", "epochs", "seconds", "sent", "raw"))
    direct = replace(plan, forward=replace(forward, inference="direct"), backward=replace(backward, inference="direct"))
    with hf_actcomp.compressed_inference(model, direct) as inf:
        with_codec = accuracy(inf, evaluation)
    row = {"setting": name, "stages": stages, "seed": seed, "forward": forward.describe(),
           "backward": backward.describe(), "accuracy": epochs[-1][0], "eval_loss": epochs[-1][1],
           "epoch_accuracy": [a for a, _ in epochs], "accuracy_with_codec": with_codec[0],
           "eval_loss_with_codec": with_codec[1], "bytes_per_step": sent / len(curve),
           "compression_ratio": raw / sent if sent else 1.0, "train_curve": curve, "seconds": seconds}
    print(f"S={stages} seed {seed} {name:20s} accuracy {row['accuracy']:.3f} (with the codec {with_codec[0]:.3f}) "
          f"loss {row['eval_loss']:.4f} {row['compression_ratio']:5.1f}x {seconds:5.0f} s", flush=True)
    return row


def summarise(rows: list[dict]) -> list[dict]:
    """Per (stages, setting): median [range] over seeds, and the gap to `none` of the same seed in
    accuracy points."""
    base = {(r["stages"], r["seed"]): r["accuracy"] for r in rows if r["setting"] == "none"}
    out = []
    for stages, name in dict.fromkeys((r["stages"], r["setting"]) for r in rows):
        mine = [r for r in rows if r["stages"] == stages and r["setting"] == name]
        gaps = [100 * (r["accuracy"] - base[stages, r["seed"]]) for r in mine if (stages, r["seed"]) in base]
        out.append({"stages": stages, "setting": name, "forward": mine[0]["forward"], "backward": mine[0]["backward"],
                    "seeds": sorted(r["seed"] for r in mine),
                    **{f"{k}{s}": f(r[k] for r in mine) for k in ("accuracy", "accuracy_with_codec", "eval_loss")
                       for s, f in (("", statistics.median), ("_min", min), ("_max", max))},
                    "gap": statistics.median(gaps) if gaps else None, "gap_min": min(gaps) if gaps else None,
                    "gap_max": max(gaps) if gaps else None,
                    "compression_ratio": statistics.median(r["compression_ratio"] for r in mine),
                    "seconds": statistics.median(r["seconds"] for r in mine)})
    return out


def write(rows: list[dict], meta: dict, name: str) -> None:
    a = meta["args"]
    write_rows(rows, meta, name, [
        "# Classifying stdlib functions by module with SmolLM2-135M through compressed boundaries", "",
        f"`benchmarks/real_model_classification.py`: SmolLM2-135M-Instruct (fp32, from its Q4_1 GGUF) with a "
        f"sequence-classification head over {len(a['modules'])} modules ({', '.join(a['modules'])}); "
        f"{meta['train_rows']} training functions ({a['train_per_class']} a module), {meta['eval_rows']} held out, "
        f"{a['seq_len']} tokens each; {a['epochs']} epochs, batch {a['batch_size']} in {a['micro_batches']} "
        f"micro-batches, AdamW lr {a['lr']}, `simulate` at the default split. Chance: "
        f"{100 / len(a['modules']):.0f}%; the pretrained model with an untrained head: "
        f"{100 * meta['accuracy_before']:.1f}%. Per seed the same batches in the same order for every setting; "
        "median [min-max] over seeds; gap: accuracy points against `none` of the same seed. 'with the codec': "
        "held-out accuracy with the training codec itself at the boundaries at inference (`inference=\"direct\"`). "
        f"{meta['machine']}.", "",
    ])


def write_rows(rows: list[dict], meta: dict, name: str, intro: list[str]) -> None:
    """The .json (rows, per-setting summary) and the .md: `intro`, then one table row a setting."""
    summary = summarise(rows)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1)
    lines = [*intro,
        "| stages | setting | fw | bw | seeds | accuracy | gap vs none | with the codec at inference | eval loss "
        "| vs fp32 | s/run |",
        "|---:|---|---|---|---|---|---|---|---|---:|---:|",
    ]
    for s in summary:
        gap = "-" if s["setting"] == "none" or s["gap"] is None else \
            f"{s['gap']:+.1f} [{s['gap_min']:+.1f}, {s['gap_max']:+.1f}]"
        lines.append(f"| {s['stages']} | {s['setting']} | {s['forward']} | {s['backward']} | {len(s['seeds'])} | "
                     f"{100 * s['accuracy']:.1f}% [{100 * s['accuracy_min']:.1f}-{100 * s['accuracy_max']:.1f}] | "
                     f"{gap} | {100 * s['accuracy_with_codec']:.1f}% | {s['eval_loss']:.3f} | "
                     f"{s['compression_ratio']:.1f}x | {s['seconds']:.0f} |")
    write_markdown(RESULTS, name, lines)


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modules", nargs="+", default=["argparse", "inspect", "pathlib", "tarfile"])
    p.add_argument("--train_per_class", type=int, default=48)
    p.add_argument("--eval_per_class", type=int, default=24)
    p.add_argument("--seq_len", type=int, default=48)
    p.add_argument("--quick", action="store_true", help="2 modules, 8 + 4 functions each, one epoch, one seed")
    add_grid_arguments(p, "real_model_classification", epochs=2, settings="all")
    p.set_defaults(stages=[2], batch_size=8, lr=5e-5)
    args = p.parse_args(argv)
    if args.quick:
        args.modules, args.train_per_class, args.eval_per_class, args.epochs, args.seeds = \
            args.modules[:2], 8, 4, 1, [0]
        args.settings = args.settings or ["none", "AQ-SGD + topk 10%"]
        args.name = "real_model_classification_quick"
    tokenizer = smollm2.load_tokenizer()
    data = datasets_of(tokenizer, args)
    keep = ("modules", "train_per_class", "eval_per_class", "seq_len", "epochs", "batch_size", "micro_batches", "lr")

    def before() -> float:
        torch.manual_seed(0)
        model = load_classifier(len(args.modules), tokenizer.pad_token_id).eval()
        return accuracy(model, DataLoader(data[1], batch_size=16, collate_fn=default_data_collator))[0]

    run_grid(p, args, args.settings or list(settings()), settings(), keep,
             {"train_rows": len(data[0]), "eval_rows": len(data[1])}, before,
             lambda name, stages, seed: finetune(name, stages, seed, data, args, tokenizer.pad_token_id),
             lambda rows, meta: write(rows, meta, args.name), before_key="accuracy_before")


if __name__ == "__main__":
    main()
