"""The `hf-actcomp` command (inspect, estimate, card) and the tracker check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from huggingface_hub import ModelCard
from trainer_cases import pad_collator, ragged_dataset, training_args

from hf_actcomp import ActCompTrainer, Compression, Plan, trackers
from hf_actcomp.cli import main
from hf_actcomp.cli.estimate import parse_link
from hf_actcomp.debug import debug_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of an in-process AQ-SGD run: weights, card, results and compression state."""
    out = tmp_path_factory.mktemp("run")
    plan = Plan(num_stages=2, forward=Compression("aqsgd", bits=4), backward=Compression("topk", ratio=0.3,
                                                                                          feedback="ef"))
    trainer = ActCompTrainer(model=debug_model("gpt2"), plan=plan,
                             args=training_args(str(out), max_steps=4, save_strategy="steps", save_steps=4),
                             train_dataset=ragged_dataset(), data_collator=pad_collator)
    trainer.train()
    return out / "checkpoint-4"


def test_inspect(checkpoint, capsys):
    assert main(["inspect", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "method: aqsgd" in out and "num_samples: 32" in out
    # 4 steps x 8 rows = the whole data set once: every memory row filled.
    assert "AQ-SGD memory 32/32 samples filled (100%)" in out
    assert "boundary0.backward.sender.error.0: F32 [2, 12, 64]" in out and ", norm " in out
    assert "measured traffic:" in out and "tags: ['hf-actcomp', 'pipeline-parallel', 'aq-sgd'" in out


def test_inspect_missing_directory(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_estimate_bytes_and_time(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4}))
    plan = Plan(num_stages=3, micro_batches=4, forward=Compression("aqsgd", bits=4),
                backward=Compression("quantize", bits=8))
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(plan.to_yaml_string())
    args = ["estimate", "--model", str(tmp_path / "config.json"), "--plan", str(plan_path), "--batch-size", "8",
            "--seq-len", "16", "--link", "10mbit", "--num-samples", "1000", "--compute-seconds", "0.5", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    raw = 8 * 16 * 64 * 4
    assert len(result["boundaries"]) == 2
    first = result["boundaries"][0]
    assert first["uncompressed_bytes"] == raw and first["first_epoch_forward_bytes"] == raw  # first visit: full
    # 4-bit codes plus one fp16 scale per group of 128 values, per micro-batch of 2 x 16 x 64.
    per_micro = 2 * 16 * 64
    assert first["forward_bytes"] == 4 * (per_micro * 4 // 8 + per_micro // 128 * 4)
    assert first["link_seconds"] == pytest.approx((first["forward_bytes"] + first["backward_bytes"]) * 8 / 10e6)
    assert first["aqsgd_memory_bytes"] == 1000 * 16 * 64 * 2 and first["aqsgd_memory_store"] == "host of stage 1"
    assert result["expected_speedup"] == pytest.approx(
        (0.5 + 2 * 2 * raw * 8 / 10e6) / (0.5 + result["link_seconds_per_step"]))
    # Overlapped at 10 Mbit/s both steps are compute-bound: compression buys nothing there.
    assert result["step_seconds_overlapped"] == result["step_seconds_overlapped_uncompressed"] == 0.5
    assert main([*args[:9], "--link", "50kbit", *args[11:]]) == 0  # link-bound: 5.2 s of fp32 one way
    slow = json.loads(capsys.readouterr().out)
    assert slow["step_seconds_overlapped_uncompressed"] == pytest.approx(raw * 8 / 50e3)
    busiest = first["backward_bytes"]  # 8-bit gradients outweigh 4-bit activations
    assert busiest > first["forward_bytes"] and busiest * 8 / 50e3 > 0.5
    assert slow["step_seconds_overlapped"] == pytest.approx(busiest * 8 / 50e3)
    assert slow["expected_speedup_overlapped"] == pytest.approx(raw / busiest)
    assert main(args[:-1]) == 0  # the table
    out = capsys.readouterr().out
    assert "expected step time" in out and "first visits uncompressed" in out


def test_estimate_compressed_warm_up(tmp_path, capsys):
    import torch

    from hf_actcomp.codecs import HadamardCodec

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4}))
    plan = Plan(num_stages=2, micro_batches=2, backward=Compression("quantize", bits=4),
                forward=Compression("aqsgd", bits=2, first_visit=Compression("hadamard", bits=4)))
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json_string())
    args = ["estimate", "--model", str(tmp_path / "config.json"), "--plan", str(plan_path), "--batch-size", "64",
            "--seq-len", "64", "--link", "10mbit", "--num-samples", "1000"]
    assert main([*args, "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["boundaries"][0]
    warm_up = 2 * HadamardCodec(bits=4).payload_nbytes((32, 64, 64), torch.float32)  # 2 micro-batches of 32 rows
    assert entry["first_epoch_forward_bytes"] == warm_up
    assert entry["forward_bytes"] < warm_up < entry["uncompressed_bytes"] / 7
    assert entry["first_visit"] == "warm-up hadamard4"
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "forward aqsgd-quantize2 (warm-up hadamard4)" in out
    kib = warm_up / 1024
    assert f"(first epoch {kib:.1f} KiB, warm-up hadamard4)" in out
    # Deltas on every third revisit: a revisit's step sends a third of them on average.
    lazy = Plan(num_stages=2, micro_batches=2, backward=Compression("quantize", bits=4),
                forward=Compression("aqsgd", bits=2, first_visit=Compression("hadamard", bits=4), refresh_every=3))
    plan_path.write_text(lazy.to_json_string())
    assert main([*args, "--json"]) == 0
    lazy_entry = json.loads(capsys.readouterr().out)["boundaries"][0]
    assert lazy_entry["forward_bytes"] == -(-entry["forward_bytes"] // 3)
    assert lazy_entry["first_epoch_forward_bytes"] == warm_up
    # Drift deltas: bf16 rank-2 factors of each micro-batch's (32 x 64 tokens) x 64 matrix, and the
    # sender's record beside the receiver's memory.
    drift = Plan(num_stages=2, micro_batches=2, backward=Compression("quantize", bits=4), forward=Compression(
        "aqsgd", inner="lowrank", rank=2, deltas="drift", first_visit=Compression("hadamard", bits=4)))
    plan_path.write_text(drift.to_json_string())
    assert main([*args, "--json"]) == 0
    drift_entry = json.loads(capsys.readouterr().out)["boundaries"][0]
    assert drift_entry["forward_bytes"] == 2 * (2 * 2 * (32 * 64 + 64))
    assert drift_entry["aqsgd_memory_store"].endswith("of stage 1; as much again on stage 0 for its drift record")


def test_estimate_diloco_bytes_per_sync_and_step(tmp_path, capsys):
    """The pseudo-gradient bytes the estimate gives are the bytes a run counts: the debug GPT-2 on
    2 stages with int8 pseudo-gradients sends 111,540 and 120,120 bytes per sync (counted in
    tests/test_diloco.py's 2 x 2 run); DDP's fp32 all-reduce every step sends 124x more."""
    from hf_actcomp.debug import debug_model

    debug_model("gpt2").config.save_pretrained(tmp_path)
    plan = Plan(num_stages=2, micro_batches=2, data_parallel=2, dp_compression={
        "method": "diloco", "sync_every": 32, "compression": {"method": "quantize", "bits": 8}})
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json_string())
    args = ["estimate", "--model", str(tmp_path), "--plan", str(plan_path), "--batch-size", "8", "--seq-len", "16"]
    assert main([*args, "--json"]) == 0
    diloco = json.loads(capsys.readouterr().out)["diloco"]
    assert diloco["method"] == "diloco-H32-quantize8"
    assert [e["bytes_per_sync"] for e in diloco["stages"]] == [111540, 120120]
    assert [e["parameters"] for e in diloco["stages"]] == [108160, 116480]  # the tied embedding on the last stage
    for e in diloco["stages"]:
        assert e["bytes_per_step"] == e["bytes_per_sync"] / 32
        assert e["ddp_bytes_per_step"] == 4 * e["parameters"]  # ring all-reduce of fp32 over 2 replicas
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| 0 | 108,160 | 108.9 KiB | 3.4 KiB | 124x fewer |" in out


def test_estimate_streaming_diloco_sends_the_largest_fragment_per_sync(tmp_path, capsys):
    """With Streaming DiLoCo's fragments the estimate splits each stage as the run does: the debug
    GPT-2 on 2 stages, H=4 in 2 fragments, fp32: a sync sends at most 231,936 and 265,472 bytes
    (the largest fragment's ring all-reduce, as tests/test_diloco.py's 2 x 2 run counts them),
    and per H steps the whole stage once."""
    from hf_actcomp.debug import debug_model

    debug_model("gpt2").config.save_pretrained(tmp_path)
    plan = Plan(num_stages=2, micro_batches=2, data_parallel=2,
                dp_compression={"method": "diloco", "sync_every": 4, "fragments": 2})
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json_string())
    args = ["estimate", "--model", str(tmp_path), "--plan", str(plan_path), "--batch-size", "8", "--seq-len", "16"]
    assert main([*args, "--json"]) == 0
    diloco = json.loads(capsys.readouterr().out)["diloco"]
    assert diloco["method"] == "diloco-H4-F2-fp32" and diloco["fragments"] == 2
    assert [e["bytes_per_sync"] for e in diloco["stages"]] == [231936, 265472]
    for e in diloco["stages"]:
        assert e["bytes_per_step"] == e["ddp_bytes_per_step"] / 4 and e["ratio_vs_ddp"] == 4
    assert main(args) == 0
    assert "2 fragments in turn, one every 2 steps: bytes per sync are the largest fragment's" in capsys.readouterr().out


def test_estimate_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="'fast' is not a rate"):
        parse_link("fast")
    assert parse_link("1gbit") == 1e9 and parse_link("50mbps") == 400e6
    assert main(["estimate", "--model", str(tmp_path), "--plan", str(tmp_path), "--batch-size", "1",
                 "--seq-len", "1"]) == 2
    assert "error:" in capsys.readouterr().err


def test_card_rerenders(checkpoint, capsys):
    os.remove(checkpoint / "README.md")
    assert main(["card", str(checkpoint), "--repo-id", "me/model", "--dataset", "wikitext"]) == 0
    card = ModelCard.load(checkpoint / "README.md")
    assert card.data.datasets == ["wikitext"] and 'from_pretrained("me/model")' in card.text
    assert "wrote" in capsys.readouterr().out


def test_console_script_and_help(capsys):
    script = os.path.join(os.path.dirname(sys.executable), "hf-actcomp")  # installed by pyproject's [project.scripts]
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: hf-actcomp" in proc.stdout
    for command in ("inspect", "estimate", "card"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0 and f"usage: hf-actcomp {command}" in capsys.readouterr().out


def test_missing_tracker_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard",
                        (("no_such_module_for_test",), "pip install 'hf-actcomp[tensorboard]'"))
    with pytest.raises(ImportError, match=r"'tensorboard' \(pip install 'hf-actcomp\[tensorboard\]'\)"):
        trackers.check_trackers(["tensorboard", "none"])
    trackers.check_trackers("none")
    with pytest.raises(ImportError, match="hf-actcomp\\[tensorboard\\]"):
        ActCompTrainer(model=debug_model("gpt2"), plan=Plan(num_stages=2),
                       args=training_args(str(tmp_path), report_to="tensorboard"),
                       train_dataset=ragged_dataset(), data_collator=pad_collator)
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from finetune_gpt2 import check_hub_args, parse_args

    with pytest.raises(ImportError, match="hf-actcomp\\[tensorboard\\]"):
        check_hub_args(parse_args(["--report_to", "tensorboard"]))
    with pytest.raises(ValueError, match="--push_to_hub needs --hub_model_id"):
        check_hub_args(parse_args(["--push_to_hub"]))
