"""The README's main job: the recipe under `accelerate launch`, then real loading code on local files."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from distributed import free_port
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from hf_actcomp import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")


PROMPTS = ["The", "def "]  # for --sample_prompts


def _greedy_samples(out, model, plan, new_tokens: int = 8) -> list[dict]:
    """The saved model's greedy completions of PROMPTS (left-padded) under the plan's inference codec."""
    from transformers import AutoTokenizer

    from hf_actcomp import compressed_inference

    tokenizer = AutoTokenizer.from_pretrained(out, padding_side="left")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad(), compressed_inference(model.eval(), plan) as inference:
        ids = inference.generate(**batch, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, completions, strict=True)]


def launch(args: list[str], config: str = "cpu_2stage.yaml", timeout: int = 300,
           extra_launch_args: tuple[str, ...] = (), script: str = "finetune_gpt2.py",
           extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **(extra_env or {}))
    cmd = [ACCELERATE, "launch", "--config_file", os.path.join(ROOT, "recipes/configs", config),
           "--main_process_port", str(free_port()), *extra_launch_args, os.path.join(ROOT, "recipes", script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("plan_file", ["plan_aqsgd_fw4_bw8.yaml"])
def test_recipe_trains_saves_and_reloads(tmp_path, plan_file):
    out = tmp_path / "run1"
    launch(["--output_dir", str(out), "--max_train_samples", "32", "--epochs", "2", "--seq_len", "64",
            "--batch_size", "8", "--plan", os.path.join(ROOT, "recipes/configs", plan_file),
            "--sample_prompts", *PROMPTS, "--sample_max_new_tokens", "8"])
    result = json.loads((out / "results.json").read_text())
    assert result["steps"] == 8 and result["processes"] == 2
    assert set(result["seconds"]) == {"0", "1"}
    assert sorted(p.name for p in (out / "actcomp_state").iterdir()) == [
        "rank0.json", "rank0.safetensors", "rank1.json", "rank1.safetensors"]
    plan = Plan.from_pretrained(out)
    assert plan.forward.method == "aqsgd" and plan.memory.num_samples == 32
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.n_layer == 4
    # --sample_prompts: greedy completions by the model still split over the 2 processes, equal to
    # the saved model's own generate under the plan's inference codec (4-bit direct), in one process.
    assert result["samples"] == _greedy_samples(out, model, plan)
    assert json.loads((out / "actcomp_results.json").read_text())["samples"] == result["samples"]
    # The card, results and curves of the run (#11): metadata and the measured boundary bytes.
    card = ModelCard.load(out / "README.md")
    assert {"hf-actcomp", "pipeline-parallel", "aq-sgd"} <= set(card.data.tags)
    assert card.data.eval_results[0].metric_value == round(result["eval_loss"], 4)
    assert "| boundary0.forward |" in card.text and (out / "training_curves.png").is_file()
    assert abs(result["eval_plain_loss"] - result["eval_loss"]) < 0.1  # 4-bit direct at inference vs none
    # Training helped: the untrained model's loss on the same evaluation data (random init: about
    # ln 1024 = 6.93; the recipe evaluates it before the first step) drops clearly (by ~0.45).
    assert abs(result["initial_eval_loss"] - math.log(model.config.vocab_size)) < 0.1
    assert result["eval_loss"] < result["initial_eval_loss"] - 0.25
    # Boundary bytes, exactly, from the plan: 4 steps per epoch of 8 rows x 64 tokens x 128 fp32
    # values, sent as 2 micro-batches. Forward (AQ-SGD, first_visit "full"): epoch 1 sees every
    # row first, so uncompressed; epoch 2 sends Q4(a - m): one fp32 scale per group of 128 values
    # and 4-bit codes. Backward: 8-bit quantize every step.
    assert (plan.forward.first_visit, plan.forward.bits, plan.backward.method, plan.backward.bits) == (
        "full", 4, "quantize", 8)
    values = 8 * 64 * model.config.n_embd  # per step
    raw = 4 * values

    def quantized(bits, group_size):  # bytes of one step, both micro-batches
        per_micro = values // plan.micro_batches
        return plan.micro_batches * (4 * math.ceil(per_micro / group_size) + math.ceil(per_micro / 8) * bits)

    forward = 4 * raw + 4 * quantized(4, plan.forward.group_size)
    backward = 8 * quantized(8, plan.backward.group_size)
    assert result["categories"]["activations"] == {
        "bytes_sent": forward, "bytes_uncompressed": 8 * raw, "compression_ratio": 8 * raw / forward}
    assert result["categories"]["activation_gradients"] == {
        "bytes_sent": backward, "bytes_uncompressed": 8 * raw, "compression_ratio": 8 * raw / backward}
    assert (round(8 * raw / forward, 3), round(8 * raw / backward, 3)) == (1.766, 3.879)  # epoch 2 alone: 7.53x
    # The total also counts the tied embedding's rows (lossless), the small collectives and evaluation.
    assert result["categories"]["tie"]["bytes_sent"] > 0
    assert result["bytes_sent"] == sum(c["bytes_sent"] for c in result["categories"].values())

    # Real loading code on local files: from_pretrained on the saved model and tokenizer,
    # load_dataset("text") on a local text file, a TopK + EF plan from flags, one process (simulate).
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(400)))
    out2 = tmp_path / "run2"
    launch(["--model", str(out), "--dataset", "text", "--data_files", str(corpus), "--output_dir", str(out2),
            "--max_train_samples", "16", "--epochs", "1", "--seq_len", "32", "--batch_size", "4",
            "--forward", "topk,ratio=0.1,feedback=ef", "--schedule", "gpipe"], config="cpu_single.yaml")
    result2 = json.loads((out2 / "results.json").read_text())
    assert "samples" not in result2  # none asked for
    assert result2["steps"] == 4 and result2["processes"] == 1 and result2["compression_ratio"] > 3
    plan2 = Plan.from_pretrained(out2)
    assert (plan2.forward.method, plan2.forward.ratio, plan2.forward.feedback, plan2.schedule) == (
        "topk", 0.1, "ef", "gpipe")
    tuned = AutoModelForCausalLM.from_pretrained(out2)
    assert not torch.equal(tuned.transformer.h[0].mlp.c_fc.weight, model.transformer.h[0].mlp.c_fc.weight)


def test_recipe_pipeline_x_data_parallel(tmp_path):
    """4 processes: 2 stages x 2 replicas, TopK on the data-parallel gradients, from flags."""
    out = tmp_path / "run"
    env_args = ["--output_dir", str(out), "--max_train_samples", "32", "--epochs", "1", "--seq_len", "32",
                "--batch_size", "4", "--data_parallel", "2", "--dp_compression", "topk,ratio=0.1"]
    launch(env_args, extra_launch_args=["--num_processes", "4"])
    result = json.loads((out / "results.json").read_text())
    assert result["processes"] == 4 and result["steps"] == 4  # 16 rows per replica / batch 4
    assert result["data_parallel"]["hook"] == "topk" and result["data_parallel"]["compression_ratio"] > 2
    plan = Plan.from_pretrained(out)
    assert plan.data_parallel == 2 and plan.dp_compression == {"method": "topk", "ratio": 0.1}
    assert sorted(p.name for p in (out / "actcomp_state").glob("*.json")) == [f"rank{r}.json" for r in range(4)]


def _saved_weights(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("model*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def test_recipe_resumes_a_plan_auto_run_with_its_codecs(tmp_path):
    """Plan.auto under the recipe, its link faked at 1 Mbit/s (so it chooses AQ-SGD activations
    and quantized gradients), a checkpoint every 2 steps. A second run resumed from checkpoint-2
    without the fake (a fast link now, where Plan.auto would choose `none`) takes the first run's
    codecs back with their AQ-SGD memory and ends with the same weights, bit for bit."""
    from hf_actcomp.pipeline.probe import FAKE_LINKS_ENV

    slow = {"0": {"forward": {"bandwidth_mbit_s": 1}, "backward": {"bandwidth_mbit_s": 1}}, "compute_ms": 10}
    common = ["--max_train_samples", "16", "--max_eval_samples", "8", "--epochs", "2", "--seq_len", "32",
              "--batch_size", "4", "--plan", os.path.join(ROOT, "recipes/configs/plan_auto.yaml")]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    launch([*common, "--output_dir", str(first), "--save_steps", "2"], extra_env={FAKE_LINKS_ENV: json.dumps(slow)})
    proc = launch([*common, "--output_dir", str(resumed), "--resume_from_checkpoint", str(first / "checkpoint-2")])
    assert "at step 2" in proc.stdout + proc.stderr
    chosen, again = Plan.from_pretrained(first), Plan.from_pretrained(resumed)
    codecs = (chosen.forward_at(0).describe(), chosen.backward_at(0).describe(), chosen.tie_compression.describe())
    assert codecs[0].startswith("aqsgd-") and codecs[1].startswith("quantize"), codecs
    assert (again.forward_at(0).describe(), again.backward_at(0).describe(), again.tie_compression.describe()) == codecs
    expected, got = _saved_weights(first), _saved_weights(resumed)
    assert expected and got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_trainer_recipe_with_lora(tmp_path):
    """`recipes/finetune_trainer.py --lora` on 2 processes: ActCompTrainer, AQ-SGD fw4/bw8, and the
    adapter (not the model) saved with the plan."""
    out = tmp_path / "lora"
    launch(["--output_dir", str(out), "--max_train_samples", "32", "--epochs", "2", "--seq_len", "64",
            "--batch_size", "8", "--lora", "--logging_steps", "1", "--warmup_steps", "0",
            "--sample_prompts", *PROMPTS, "--sample_max_new_tokens", "4"], script="finetune_trainer.py")
    result = json.loads((out / "results.json").read_text())
    # LogSamplesCallback: both prompts at each epoch's evaluation (steps 4 and 8; the final evaluate
    # at step 8 is not sampled twice), kept in actcomp_results.json by save_model.
    samples = json.loads((out / "actcomp_results.json").read_text())["samples"]
    assert [(s["step"], s["prompt"]) for s in samples] == [(4, p) for p in PROMPTS] + [(8, p) for p in PROMPTS]
    assert result["processes"] == 2 and result["steps"] == 8
    assert {"adapter_model.safetensors", "adapter_config.json", "actcomp_config.json"} <= set(os.listdir(out))
    assert "model.safetensors" not in os.listdir(out)
    assert math.isfinite(result["eval_loss"]) and math.isfinite(result["eval_plain_loss"])
    assert result["comm/compression_ratio"] > 1.2  # epoch 2 sends 4-bit AQ-SGD deltas
    assert Plan.from_pretrained(out).memory.num_samples == 32
