"""Instruction tuning a real pretrained LLM through compressed boundaries: SmolLM2-135M-Instruct
with `ActCompSFTTrainer` (TRL's SFTTrainer over the plan's stages, one process) on prompt/completion
pairs built from stdlib docstrings, each recommended plan beside uncompressed.

A pair: the user shows a stdlib function with its docstring taken out and asks for the docstring's
first sentence; the assistant answers with it. Rows are conversational prompt/completion rows, so
TRL renders them with SmolLM2's chat template and trains on the completion only (SFTTrainer's
default for such rows). Pairs from the first stdlib modules train, pairs from the last modules
are held out. Per (stages, setting, seed): a fresh copy of the model from the fixture
(benchmarks/smollm2.py), the same batches in the same order for every setting of a seed (Trainer's
seeded sampler); after training, the held-out completion-only eval loss with plain inference and
through the plan's inference form (`compressed_inference`, `Compression.inference="auto"`).

    python benchmarks/real_model_sft.py --stages 2 --seeds 0 1 2          # ~2 min per run here
    python benchmarks/real_model_sft.py --stages 4 --seeds 0 1 2 --merge  # add rows to the file
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import tempfile
import textwrap
import time

import datasets
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import real_model_finetune as finetune  # noqa: E402  (the settings, the summary and the results file)
import smollm2  # noqa: E402
from convergence import eval_loss  # noqa: E402

import hf_actcomp  # noqa: E402
from hf_actcomp import MemoryConfig, Plan  # noqa: E402

QUESTION = "Write the first sentence of this Python function's docstring.\n\n```python\n{code}\n```"
SETTINGS = ("none", "aqsgd fw4/bw8 warm-up h_o4", "aqsgd-h_o fw4/bw8 warm-up h_o4", "aqsgd-h_o fw2/bw4 warm-up h_o4",
            "hadamard_outliers fw4/bw8", "hadamard_outliers fw3/bw6")


def docstring_pairs(sources: list[str], max_code_lines: int = 8) -> list[tuple[str, str]]:
    """(function source without its docstring, first 8 lines; the docstring's first sentence) for
    every function in `sources` whose docstring opens with a sentence of 20-200 characters."""
    pairs = []
    for text in sources:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node)
            if not doc or not node.body or node.end_lineno is None:
                continue
            first = re.split(r"(?<=\.)\s", " ".join(doc.split("\n\n")[0].split()), maxsplit=1)[0]
            if not 20 <= len(first) <= 200:
                continue
            body = node.body[1:]  # the docstring's statement left out
            code = lines[node.lineno - 1:node.body[0].lineno - 1] + (
                lines[body[0].lineno - 1:node.end_lineno] if body else [])
            pairs.append((textwrap.dedent("\n".join(line[:100] for line in code[:max_code_lines])), first))
    return pairs


def pair_datasets(train_pairs: int, eval_pairs: int, max_files: int = 60) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Conversational prompt/completion rows: train from the first stdlib modules, eval from the last."""
    sources = smollm2.stdlib_sources()
    train = docstring_pairs(sources[:max_files])[:train_pairs]
    held_out = docstring_pairs(sources[-max_files:])[-eval_pairs:]
    if len(train) < train_pairs or len(held_out) < eval_pairs:
        raise ValueError(f"{max_files} stdlib modules give {len(train)} / {len(held_out)} pairs; asked for "
                         f"{train_pairs} / {eval_pairs}: raise max_files.")

    def rows(pairs):
        return datasets.Dataset.from_dict({
            "prompt": [[{"role": "user", "content": QUESTION.format(code=code)}] for code, _ in pairs],
            "completion": [[{"role": "assistant", "content": answer}] for _, answer in pairs]})

    return rows(train), rows(held_out)


def sft_config(output_dir: str, seed: int, args):
    from trl import SFTConfig

    return SFTConfig(output_dir=output_dir, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=8,
                     num_train_epochs=args.epochs, learning_rate=args.lr, lr_scheduler_type="constant",
                     max_length=args.max_length, seed=seed, data_seed=seed, save_strategy="no", eval_strategy="no",
                     logging_steps=1, report_to=[], use_cpu=True, bf16=False, disable_tqdm=True)


def eval_batches(trainer) -> list[dict]:
    """The held-out completion-only batches, as the trainer's collator makes them."""
    return [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask", "labels")}
            for b in trainer.get_eval_dataloader()]


def run(name: str, stages: int, seed: int, data, args) -> dict:
    """One fine-tune: train with `ActCompSFTTrainer`, then the held-out eval losses."""
    train, held_out = data
    forward, backward = finetune.settings()[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(smollm2.smollm2_dir(), dtype=torch.float32)
    tokenizer = smollm2.load_tokenizer()
    plan = Plan(num_stages=stages, micro_batches=args.micro_batches, schedule="gpipe", forward=forward,
                backward=backward, memory=MemoryConfig(store="host", dtype="fp16"),
                tie_compression=finetune.TIES.get(name))
    with tempfile.TemporaryDirectory() as out:
        trainer = hf_actcomp.ActCompSFTTrainer(model=model, args=sft_config(out, seed, args), train_dataset=train,
                                               eval_dataset=held_out, processing_class=tokenizer, plan=plan)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        curve = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        comm = trainer.communication_logs()
        evaluation = eval_batches(trainer)
    model.eval()
    plain = eval_loss(model, DataLoader(evaluation, batch_size=None))
    with hf_actcomp.compressed_inference(model, plan) as inf:
        inference_form = eval_loss(inf, DataLoader(evaluation, batch_size=None))
    steps = len(curve)
    row = {"setting": name, "stages": stages, "seed": seed, "forward": forward.describe(),
           "backward": backward.describe(), "tie": finetune.describe_tie(plan.tie_compression),
           "eval_loss": plain, "eval_loss_inference_form": inference_form,
           "bytes_per_step": comm["comm/bytes_sent"] / steps, "bytes_per_step_uncompressed":
           comm["comm/bytes_uncompressed"] / steps, "compression_ratio": comm["comm/compression_ratio"],
           "forward_compression_ratio": comm["comm/activations/compression_ratio"],
           "backward_compression_ratio": comm["comm/activation_gradients/compression_ratio"],
           "train_curve": curve, "seconds": seconds}
    print(f"S={stages} seed {seed} {name:28s} eval {plain:.4f} (inference form {inference_form:.4f}) "
          f"{row['bytes_per_step'] / 1e6:6.3f} MB/step {row['compression_ratio']:5.1f}x {seconds:5.0f} s", flush=True)
    return row


def describe(meta: dict) -> str:
    a = meta["args"]
    return (f"`benchmarks/real_model_sft.py`: SmolLM2-135M-Instruct (fp32, from its Q4_1 GGUF) instruction-tuned "
            f"with `ActCompSFTTrainer` (one process) on {meta['train_rows']} prompt/completion pairs from stdlib "
            "docstrings (a function without its docstring -> the docstring's first sentence) in SmolLM2's chat "
            f"template, loss on the completion only, {a['epochs']} epochs, batch {a['batch_size']} in "
            f"{a['micro_batches']} micro-batches, AdamW lr {a['lr']} constant, max length {a['max_length']}; eval: "
            f"the completion-only loss on {meta['eval_rows']} pairs from other stdlib modules (the model before "
            f"tuning: {meta['eval_loss_before']:.4f}). MB/step: all traffic between the stages (activations, their "
            "gradients and the tied embedding's rows).")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_rows", type=int, default=48)
    p.add_argument("--eval_rows", type=int, default=16)
    p.add_argument("--max_length", type=int, default=160)
    finetune.add_grid_arguments(p, "real_model_sft", epochs=2, settings=str(list(SETTINGS)))
    args = p.parse_args(argv)
    names = args.settings or list(SETTINGS)
    data = pair_datasets(args.train_rows, args.eval_rows)
    keep = ("train_rows", "eval_rows", "max_length", "epochs", "batch_size", "micro_batches", "lr")

    def before() -> float:
        """The untuned model's held-out loss: the eval batches of a trainer that never trains."""
        model, tokenizer = smollm2.load()
        with tempfile.TemporaryDirectory() as out:
            trainer = hf_actcomp.ActCompSFTTrainer(model=model, args=sft_config(out, 0, args), train_dataset=data[0],
                                                   eval_dataset=data[1], processing_class=tokenizer,
                                                   plan=Plan(num_stages=2))
            batches = eval_batches(trainer)
        return eval_loss(model, DataLoader(batches, batch_size=None))

    finetune.run_grid(p, args, names, finetune.settings(), keep, {"train_rows": len(data[0]), "eval_rows": len(data[1])},
                      before, lambda name, stages, seed: run(name, stages, seed, data, args),
                      lambda rows, meta: finetune.write(rows, meta, args.name, "Instruction tuning SmolLM2-135M "
                                                        "through compressed boundaries", describe(meta)))


if __name__ == "__main__":
    main()
