"""The scripts users run, end to end: a restated transformers `run_clm.py` (compute_metrics,
preprocess_logits_for_metrics, checkpoints, metric_for_best_model) with plain Trainer on the unsplit
model beside ActCompTrainer in one process and on 2 processes launched by plain `torchrun` with no
extra environment (no ACCELERATE_USE_CPU): the same logged losses, metrics and final weights,
codec `none`."""

from __future__ import annotations

import json
import os

import pytest
from scripts import NO_DROPOUT, assert_same_run, run, run_side_by_side

# ----------------------------------------------------------------------------- run_clm
CLM = ["--do_train", "--do_eval", "--max_texts", "400", "--max_train_samples", "32", "--max_eval_samples", "16",
       "--block_size", "32", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
       "--max_steps", "6", "--learning_rate", "1e-3", "--logging_steps", "1", "--report_to", "none", "--seed", "0",
       "--disable_tqdm", "true", "--config_overrides", NO_DROPOUT,
       # an evaluation with the metric, and a checkpoint, every 3 steps; the best by accuracy at the end
       "--eval_strategy", "steps", "--eval_steps", "3", "--save_strategy", "steps", "--save_steps", "3",
       "--metric_for_best_model", "accuracy", "--load_best_model_at_end", "true"]


@pytest.fixture(scope="module")
def clm_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_clm")
    logs = dict(zip(("plain", "one"), run_side_by_side(("run_clm.py", root / "plain", [*CLM, "--plain"]),
                                                        ("run_clm.py", root / "one", CLM)), strict=True))
    logs.update({"two": run("run_clm.py", root / "two", CLM, processes=2),
            "accelerate": run("run_clm.py", root / "accelerate", CLM, processes=2, launcher="accelerate")})
    return root, logs


def test_run_clm_reports_trainers_metrics_on_every_process_count(clm_runs):
    """compute_metrics with preprocess_logits_for_metrics (the argmax, on the last stage) gives
    plain Trainer's eval_accuracy at every evaluation, and eval_loss is Trainer's number."""
    root, _ = clm_runs
    for name in ("one", "two", "accelerate"):
        assert_same_run(root / "plain", root / name, losses=("loss", "eval_loss", "eval_accuracy"),
                        metrics=("eval_loss", "eval_accuracy", "perplexity"))
        evaluated = json.loads((root / name / "eval_results.json").read_text())
        assert {"eval_plain_loss", "eval_token_loss", "eval_perplexity"} <= set(evaluated)
        # the best checkpoint by the computed metric, as Trainer picked it
        state, reference = (json.loads((root / d / "trainer_state.json").read_text()) for d in (name, "plain"))
        assert state["best_metric"] == pytest.approx(reference["best_metric"], rel=1e-6)
        assert os.path.basename(state["best_model_checkpoint"]) == os.path.basename(reference["best_model_checkpoint"])


@pytest.mark.parametrize("launcher", ["two", "accelerate"])
def test_launchers_on_cpu_need_no_environment(clm_runs, launcher):
    """torchrun, and accelerate launch without a config or --cpu, with no ACCELERATE_USE_CPU:
    Trainer counts both processes (one main process, one checkpoint each time, marked complete),
    and says once what it set."""
    root, logs = clm_runs
    assert logs[launcher].count("TrainingArguments(use_cpu=True) was set") == 1
    for step in (3, 6):
        checkpoint = root / launcher / f"checkpoint-{step}"
        assert (checkpoint / "actcomp_complete.json").is_file()
        assert {"optimizer-rank0.pt", "optimizer-rank1.pt"} <= set(os.listdir(checkpoint))
    assert "use_cpu=True" not in logs["one"]


# ----------------------------------------------------------------------------- run_glue, run_image_classification
SMALL = ["--do_train", "--do_eval", "--max_train_samples", "32", "--max_eval_samples", "16",
         "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_steps", "4",
         "--learning_rate", "1e-3", "--logging_steps", "1", "--report_to", "none", "--seed", "0",
         "--disable_tqdm", "true"]
GLUE = [*SMALL, "--max_seq_length", "32", "--config_overrides", "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0"]


@pytest.mark.parametrize("script, args, metrics", [
    ("run_glue.py", GLUE, ("eval_loss", "eval_accuracy", "eval_f1")),  # BERT, sentence pairs with segments
    ("run_image_classification.py", SMALL, ("eval_loss", "eval_accuracy")),  # ViT, pixel_values
], ids=["glue", "image_classification"])
def test_classification_scripts_on_two_processes_match_plain_trainer(tmp_path, script, args, metrics):
    """transformers' run_glue and run_image_classification, restated with two lines changed: plain
    Trainer on the unsplit model against ActCompTrainer under plain torchrun with one stage per
    process: the same logged losses, evaluation metrics (compute_metrics) and final weights."""
    run(script, tmp_path / "plain", [*args, "--plain"])
    run(script, tmp_path / "two", args, processes=2)
    # transformers writes ViT's weights under their pre-5.0 names, the stages under the model's own:
    # both load with from_pretrained into the same model
    load = loaded_image_classifier if script == "run_image_classification.py" else None
    assert_same_run(tmp_path / "plain", tmp_path / "two", losses=("loss", "grad_norm"), metrics=metrics, load=load)


def loaded_image_classifier(folder) -> dict:
    from transformers import AutoModelForImageClassification

    return dict(AutoModelForImageClassification.from_pretrained(folder).state_dict())
