"""Preference tuning a real pretrained LLM through compressed boundaries: SmolLM2-135M-Instruct with
`ActCompDPOTrainer` (TRL's DPOTrainer over the plan's stages, one process) on preference pairs built
from stdlib docstrings, each recommended plan beside uncompressed.

A pair: the user shows a stdlib function with its docstring taken out and asks for the docstring's
first sentence (SmolLM2's chat template); the chosen answer is that sentence, the rejected one the
next function's. Pairs from the first stdlib modules train, pairs from the last are held out. Per
(stages, setting, seed): a fresh policy and reference from the fixture (benchmarks/smollm2.py), the
same batches in the same order for every setting of a seed; the reference runs through the same
plan (its inference form). After training, DPOTrainer's held-out metrics through the plan: reward
accuracy, reward margin, loss; the policy's bytes per step by category (activations, their
gradients, the tied embedding's rows). The reference pass sends one more forward per step through
the plan's inference form, which `simulate` does not count in evaluation mode.

    python benchmarks/real_model_dpo.py --stages 2 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import datasets
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real_model_finetune as finetune  # noqa: E402  (the settings and the grid)
import smollm2  # noqa: E402
from harness import write_markdown  # noqa: E402
from real_model_sft import QUESTION, docstring_pairs  # noqa: E402

import hf_actcomp  # noqa: E402
from hf_actcomp import MemoryConfig, Plan  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SETTINGS = ("none", "hadamard_outliers fw4/bw8", "hadamard_outliers fw3/bw6", "aqsgd-h_o fw4/bw8 warm-up h_o4")


def preference_datasets(train_pairs: int, eval_pairs: int, max_files: int = 60) -> tuple[datasets.Dataset, ...]:
    """(train, held-out) conversational preference rows: the true first sentence chosen, the next
    function's rejected."""
    sources = smollm2.stdlib_sources()

    def rows(pairs):
        return datasets.Dataset.from_dict({
            "prompt": [[{"role": "user", "content": QUESTION.format(code=code)}] for code, _ in pairs[:-1]],
            "chosen": [[{"role": "assistant", "content": answer}] for _, answer in pairs[:-1]],
            "rejected": [[{"role": "assistant", "content": answer}] for _, answer in pairs[1:]]})

    train = docstring_pairs(sources[:max_files])[: train_pairs + 1]
    held_out = docstring_pairs(sources[-max_files:])[-(eval_pairs + 1):]
    if len(train) <= train_pairs or len(held_out) <= eval_pairs:
        raise ValueError(f"{max_files} stdlib modules give too few pairs for {train_pairs} / {eval_pairs}.")
    return rows(train), rows(held_out)


def dpo_config(output_dir: str, seed: int, args):
    from trl import DPOConfig

    return DPOConfig(output_dir=output_dir, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=4,
                     num_train_epochs=args.epochs, learning_rate=args.lr, lr_scheduler_type="constant",
                     max_length=args.max_length, beta=args.beta, seed=seed, data_seed=seed, save_strategy="no",
                     eval_strategy="no", logging_steps=1, report_to=[], use_cpu=True, bf16=False, disable_tqdm=True)


def run(name: str, stages: int, seed: int, data, args) -> dict:
    """One preference tune with `ActCompDPOTrainer`, then DPOTrainer's held-out metrics."""
    train, held_out = data
    forward, backward = finetune.settings()[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(smollm2.smollm2_dir(), dtype=torch.float32)
    plan = Plan(num_stages=stages, micro_batches=args.micro_batches, schedule="gpipe", forward=forward,
                backward=backward, memory=MemoryConfig(store="host", dtype="fp16"),
                tie_compression=finetune.TIES.get(name))
    with tempfile.TemporaryDirectory() as out:
        trainer = hf_actcomp.ActCompDPOTrainer(model=model, ref_model=copy.deepcopy(model),
                                               args=dpo_config(out, seed, args), train_dataset=train,
                                               eval_dataset=held_out, processing_class=smollm2.load_tokenizer(),
                                               plan=plan)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        logs = [log for log in trainer.state.log_history if "loss" in log]
        categories = trainer.sim.stats()["categories"]
        metrics = trainer.evaluate()
    steps = len(logs)
    row = {"setting": name, "stages": stages, "seed": seed, "forward": forward.describe(),
           "backward": backward.describe(), "tie": finetune.describe_tie(plan.tie_compression),
           "eval_loss": metrics["eval_loss"],
           "eval_accuracy": metrics["eval_rewards/accuracies"], "eval_margin": metrics["eval_rewards/margins"],
           "bytes_per_step": {c: v["bytes_sent"] / steps for c, v in categories.items()},
           "train_curve": [log["loss"] for log in logs], "seconds": seconds}
    print(f"S={stages} seed {seed} {name:32s} eval accuracy {row['eval_accuracy']:.3f} margin {row['eval_margin']:+.3f} "
          f"loss {row['eval_loss']:.4f} {seconds:5.0f} s", flush=True)
    return row


def write(rows: list[dict], meta: dict, name: str) -> None:
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    a = meta["args"]
    lines = ["# Preference tuning SmolLM2-135M with ActCompDPOTrainer through compressed boundaries", "",
             f"`benchmarks/real_model_dpo.py`: {meta['train_rows']} preference pairs from stdlib docstrings (the true "
             "first sentence chosen, the next function's rejected) in SmolLM2's chat template, "
             f"{a['epochs']} epochs, batch {a['batch_size']} pairs in {a['micro_batches']} micro-batches, AdamW lr "
             f"{a['lr']} constant, beta {a['beta']}, max length {a['max_length']}; the reference is the initial model "
             f"through the same plan. Held out: {meta['eval_rows']} pairs from other modules, DPOTrainer's evaluation "
             f"through the plan (reward accuracy of the untuned model: {meta['eval_accuracy_before']:.3f}). Median "
             "[min-max] over seeds. MB/step: the policy's training traffic by category (the reference pass, one more "
             "forward per step through the plan's inference form, is not counted in one process).", "",
             "| stages | setting | seeds | reward accuracy | reward margin | eval loss | MB/step: activations / "
             "gradients / tie | s/run |", "|---:|---|---|---|---|---|---|---:|"]
    for stages, setting in dict.fromkeys((r["stages"], r["setting"]) for r in rows):
        mine = [r for r in rows if (r["stages"], r["setting"]) == (stages, setting)]

        def spread(key, mine=mine):
            values = [r[key] for r in mine]
            return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"

        mb = "/".join(f"{statistics.median(r['bytes_per_step'].get(c, 0) for r in mine) / 1e6:.2f}"
                      for c in ("activations", "activation_gradients", "tie"))
        lines.append(f"| {stages} | {setting} | {len(mine)} | {spread('eval_accuracy')} | {spread('eval_margin')} | "
                     f"{spread('eval_loss')} | {mb} | {statistics.median(r['seconds'] for r in mine):.0f} |")
    write_markdown(RESULTS, name, lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_rows", type=int, default=48)
    p.add_argument("--eval_rows", type=int, default=16)
    p.add_argument("--max_length", type=int, default=192)
    p.add_argument("--beta", type=float, default=0.1)
    finetune.add_grid_arguments(p, "real_model_dpo", epochs=2, settings=str(list(SETTINGS)))
    p.set_defaults(stages=[2], lr=5e-6)
    args = p.parse_args(argv)
    names = args.settings or list(SETTINGS)
    data = preference_datasets(args.train_rows, args.eval_rows)
    keep = ("train_rows", "eval_rows", "max_length", "epochs", "batch_size", "micro_batches", "lr", "beta")

    def before() -> float:
        """The untuned model's held-out reward accuracy (its rewards are all 0 against itself: ties)."""
        model = AutoModelForCausalLM.from_pretrained(smollm2.smollm2_dir(), dtype=torch.float32)
        with tempfile.TemporaryDirectory() as out:
            trainer = hf_actcomp.ActCompDPOTrainer(model=model, ref_model=copy.deepcopy(model),
                                                   args=dpo_config(out, 0, args), train_dataset=data[0],
                                                   eval_dataset=data[1], processing_class=smollm2.load_tokenizer(),
                                                   plan=Plan(num_stages=2))
            return trainer.evaluate()["eval_rewards/accuracies"]

    finetune.run_grid(p, args, names, finetune.settings(), keep, {"train_rows": len(data[0]), "eval_rows": len(data[1])},
                      before, lambda name, stages, seed: run(name, stages, seed, data, args),
                      lambda rows, meta: write(rows, meta, args.name), before_key="eval_accuracy_before")


if __name__ == "__main__":
    main()
