"""Text samples from a model that may be split across processes, to see what training does.

`complete` turns prompts into completions through any `generate(input_ids, attention_mask=...,
**kwargs)`: `Pipeline.generate` (the model still split, every rank calls it) or, in one process, a
model under `compressed_inference` (the same inference codec at the boundaries).
`LogSamplesCallback` does it at every evaluation of `ActCompTrainer` and writes the samples to
TensorBoard / Weights & Biases and to `actcomp_results.json`; `recipes/finetune_gpt2.py
--sample_prompts` after training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback, WandbCallback

from . import hub
from .models import unwrap_peft
from .split_generation import check_split_generation

SAMPLES_KEY = "samples"  # where actcomp_results.json keeps them


def check_prompts(prompts: Any) -> list[str]:
    """`prompts` as a non-empty list of strings, or a ValueError naming what was given."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"Sample prompts must be a non-empty list of non-empty strings, got {prompts!r}.")
    return list(prompts)


def complete(generate: Callable[..., torch.Tensor], tokenizer, prompts: list[str], *,
             device: torch.device | str = "cpu", **generate_kwargs: Any) -> list[str]:
    """The completions of `prompts` (the new text only), batched with left padding, as decoder
    models generate. `generate_kwargs` go to `generate` (`max_new_tokens`, `do_sample`, ...); the
    tokenizer's pad token (or, without one, its end-of-text token) pads."""
    prompts = check_prompts(prompts)
    if tokenizer is None:
        raise ValueError("Generating samples needs a tokenizer: pass processing_class= to the trainer.")
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if pad is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    ids = batch["input_ids"].to(device)
    out = generate(ids, attention_mask=batch["attention_mask"].to(device), **generate_kwargs)
    return tokenizer.batch_decode(out[:, ids.shape[1]:].cpu(), skip_special_tokens=True)


def markdown_table(rows: list[dict]) -> str:
    """Prompt | completion, one row per sample (TensorBoard renders text as markdown)."""
    cell = lambda text: text.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return "\n".join(["| prompt | completion |", "|---|---|",
                      *(f"| {cell(r['prompt'])} | {cell(r['completion'])} |" for r in rows)])


class LogSamplesCallback(TrainerCallback):
    """Complete a few prompts at every evaluation of an `ActCompTrainer`, with the model still split.

    Every rank generates (with several processes `Pipeline.generate` is collective over the
    pipeline; in one process the model runs under `compressed_inference`, the same codec); the
    main process writes a prompt/completion table to TensorBoard (`add_text("samples")`) and to
    Weights & Biases (a `wandb.Table`) when they are in `report_to`, and every evaluation's
    samples to `actcomp_results.json` in `output_dir` (key `"samples"`, also kept by
    `save_model`). Other trackers get the results file only.

        trainer = ActCompTrainer(..., plan=plan, processing_class=tokenizer)
        trainer.add_callback(LogSamplesCallback(trainer, ["def fibonacci(n):"], max_new_tokens=32))

    Args:
        trainer: the `ActCompTrainer` (it generates, and its tokenizer encodes).
        prompts: the texts to complete, the same at every evaluation.
        **generate_kwargs: for `generate` (default: greedy, 32 new tokens). Only what
            `Pipeline.generate` runs (greedy decoding or multinomial sampling, one sequence per
            prompt), with one process too, so that a run samples alike on 1 and N processes:
            anything else (`num_beams=4`, `num_return_sequences=2`, ..., also from the model's
            `generation_config`) raises a ValueError here, before training.
    """

    def __init__(self, trainer, prompts: list[str], **generate_kwargs: Any) -> None:
        if not hasattr(trainer, "generate_samples"):
            raise TypeError(f"LogSamplesCallback needs an ActCompTrainer, got {type(trainer).__name__}.")
        if trainer.processing_class is None:
            raise ValueError("LogSamplesCallback needs the trainer's tokenizer: pass processing_class= to it.")
        self.trainer = trainer
        self.prompts = check_prompts(prompts)
        self.generate_kwargs = {"max_new_tokens": 32, "do_sample": False, **generate_kwargs}
        try:  # now rather than at the first evaluation, on every rank alike
            check_split_generation(unwrap_peft(trainer.model), **self.generate_kwargs)
        except ValueError as err:
            raise ValueError(f"LogSamplesCallback samples with what Pipeline.generate runs, in one process too "
                             f"(the same samples on 1 and N processes): {err}") from None
        self.samples: list[dict] = []  # {"step", "prompt", "completion"} of every evaluation so far

    def on_evaluate(self, args, state, control, **kwargs) -> None:
        if self.samples and self.samples[-1]["step"] == state.global_step:
            return  # one evaluation of several datasets: sampled once
        completions = self.trainer.generate_samples(self.prompts, **self.generate_kwargs)
        rows = [{"step": state.global_step, "prompt": p, "completion": c}
                for p, c in zip(self.prompts, completions, strict=True)]
        self.samples.extend(rows)
        if self.trainer.is_world_process_zero():
            log_to_trackers(self.trainer.callback_handler.callbacks, rows, state.global_step)
            if args.should_save:
                results = hub.load_results(args.output_dir)
                hub.save_results(args.output_dir, **{**results, SAMPLES_KEY: self.samples})


def log_to_trackers(callbacks: list, rows: list[dict], step: int) -> None:
    """Write `rows` to the TensorBoard and Weights & Biases trackers among `callbacks` (those
    that have started: a tracker starts with training)."""
    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
            callback.tb_writer.add_text(SAMPLES_KEY, markdown_table(rows), global_step=step)
            callback.tb_writer.flush()
        # WandbCallback keeps its `wandb` module private; it is the run the callback logs to.
        elif isinstance(callback, WandbCallback) and getattr(callback._wandb, "run", None) is not None:
            table = callback._wandb.Table(columns=["step", "prompt", "completion"],
                                          data=[[r["step"], r["prompt"], r["completion"]] for r in rows])
            callback._wandb.log({SAMPLES_KEY: table})
