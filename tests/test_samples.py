"""Samples while training: `LogSamplesCallback` on ActCompTrainer (one process, and the model
split over 2 processes), to TensorBoard and actcomp_results.json; and what is refused."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from distributed import run_workers
from trainer_cases import (
    SAMPLE_PROMPTS,
    pad_collator,
    ragged_dataset,
    sample_tokenizer,
    training_args,
)

from hf_actcomp import ActCompTrainer, LogSamplesCallback, Plan
from hf_actcomp.debug import debug_model
from hf_actcomp.samples import complete

SAMPLING = {"eval_strategy": "steps", "eval_steps": 2}  # evaluations at steps 2 and 4 of 4


def _trainer(tmp_path, tokenizer, **overrides) -> ActCompTrainer:
    model = debug_model("gpt2", seed=0, vocab_size=len(tokenizer))
    return ActCompTrainer(model=model, args=training_args(str(tmp_path / "run"), **{**SAMPLING, **overrides}),
                          plan=Plan(num_stages=2), train_dataset=ragged_dataset(),
                          eval_dataset=ragged_dataset(8, seed=1), data_collator=pad_collator,
                          processing_class=tokenizer)


def _greedy_completions(model, tokenizer, new_tokens: int) -> list[str]:
    """The reference, independent of generate() and of the callback's path: the unsplit model's
    argmax, one prompt at a time (no padding, no cache), stopping at the end-of-text token."""
    model.eval()
    completions = []
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        new = []
        with torch.no_grad():
            for _ in range(new_tokens):
                so_far = torch.cat([ids, torch.tensor([new], dtype=ids.dtype)], 1)
                token = int(model(input_ids=so_far).logits[0, -1].argmax())
                new.append(token)
                if token == tokenizer.eos_token_id:
                    break
        completions.append(tokenizer.decode(new, skip_special_tokens=True))
    return completions


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """One process (with TensorBoard where it is installed): the samples of both evaluations, and
    the final model's own."""
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    tmp_path = tmp_path_factory.mktemp("samples")
    tokenizer = sample_tokenizer()
    trainer = _trainer(tmp_path, tokenizer, report_to=["tensorboard"] if tensorboard else [])  # events in run/runs/<date>
    sampler = LogSamplesCallback(trainer, SAMPLE_PROMPTS, max_new_tokens=6)
    trainer.add_callback(sampler)
    trainer.train()
    expected = _greedy_completions(trainer.model, tokenizer, 6)
    results = json.loads((tmp_path / "run" / "actcomp_results.json").read_text())
    trainer.save_model(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "actcomp_results.json").read_text())
    return {"samples": sampler.samples, "expected": expected, "results": results, "saved": saved,
            "tensorboard": next((tmp_path / "run" / "runs").iterdir()) if tensorboard else None,
            "padding_side": tokenizer.padding_side}


def test_samples_at_every_evaluation_in_one_process(in_process):
    """Both evaluations sampled both prompts; the last ones are the trained model's own greedy
    completions; the results file holds them after each evaluation and after save_model."""
    samples = in_process["samples"]
    assert [(s["step"], s["prompt"]) for s in samples] == [(2, p) for p in SAMPLE_PROMPTS] + [(4, p) for p in SAMPLE_PROMPTS]
    assert [s["completion"] for s in samples[2:]] == in_process["expected"]
    assert all(s["completion"] for s in samples)  # 6 new tokens of a 300-token vocabulary: never empty
    assert in_process["results"]["samples"] == samples
    assert in_process["saved"]["samples"] == samples
    assert in_process["padding_side"] == "right"  # the tokenizer is left as it was


def test_samples_reach_tensorboard(in_process):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (the `dev` extra has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(in_process["tensorboard"]), size_guidance={"tensors": 0}).Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("samples/text_summary")}
    assert sorted(texts) == [2, 4]
    for sample in in_process["samples"]:
        assert sample["prompt"] in texts[sample["step"]]
        assert sample["completion"].replace("\n", " ").replace("|", "\\|") in texts[sample["step"]]


def test_samples_with_the_model_split_over_two_processes(tmp_path, in_process):
    """Codec none on 2 processes: every rank samples the same completions as the one-process run
    (both train exactly as plain Trainer does), and rank 0 writes them to the results file."""
    spec = {"plan": {"num_stages": 2}, "samples": SAMPLE_PROMPTS, "args": SAMPLING}
    run_workers("trainer_worker.py", 2, [json.dumps(spec), str(tmp_path)], timeout=300)
    for rank in range(2):
        got = json.loads((tmp_path / f"losses-rank{rank}.json").read_text())["samples"]
        assert got == in_process["samples"], rank
    assert json.loads((tmp_path / "run" / "actcomp_results.json").read_text())["samples"] == in_process["samples"]


def test_refused_without_a_tokenizer_or_prompts(tmp_path):
    tokenizer = sample_tokenizer()
    trainer = _trainer(tmp_path, tokenizer)
    with pytest.raises(ValueError, match="non-empty list of non-empty strings, got \\[\\]"):
        LogSamplesCallback(trainer, [])
    trainer.processing_class = None
    with pytest.raises(ValueError, match="needs the trainer's tokenizer: pass processing_class="):
        LogSamplesCallback(trainer, SAMPLE_PROMPTS)
    with pytest.raises(TypeError, match="needs an ActCompTrainer, got str"):
        LogSamplesCallback("trainer", SAMPLE_PROMPTS)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        complete(lambda *a, **k: None, None, SAMPLE_PROMPTS)


def test_samples_reach_weights_and_biases_as_a_table():
    """The W&B branch, with a stand-in for the `wandb` module (not installed here): a Table of
    step, prompt and completion, logged under "samples"; a run not started gets nothing."""
    from types import SimpleNamespace

    from transformers.integrations import WandbCallback

    from hf_actcomp.samples import log_to_trackers

    logged = []
    table = lambda columns, data: {"columns": columns, "data": data}  # noqa: E731
    callback = WandbCallback.__new__(WandbCallback)  # its __init__ imports wandb
    rows = [{"step": 3, "prompt": "The", "completion": " end"}]
    callback._wandb = SimpleNamespace(run=None, Table=table, log=logged.append)
    log_to_trackers([callback], rows, 3)
    assert logged == []
    callback._wandb.run = object()
    log_to_trackers([callback], rows, 3)
    assert logged == [{"samples": {"columns": ["step", "prompt", "completion"], "data": [[3, "The", " end"]]}}]
