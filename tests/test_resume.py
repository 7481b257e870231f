"""Checkpoints a kill cannot tear, `auto` resume, exact continuation, and clear errors for bad state."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from distributed import run_workers
from pipeline_cases import NUM_SAMPLES, training_batches

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan, simulate
from hf_actcomp.debug import debug_model
from hf_actcomp.state.resume import (
    COMPLETE_MARKER,
    checkpoint_dir,
    latest_checkpoint,
    resolve_resume_from_checkpoint,
    writing_checkpoint,
)
from hf_actcomp.state.training_state import load_training_state, save_training_state

AQSGD = Plan(num_stages=2, micro_batches=2, forward=Compression("aqsgd", bits=4),
             backward=Compression("quantize", bits=8, feedback="ef"),
             memory=MemoryConfig(num_samples=NUM_SAMPLES), tie_compression=Compression("quantize", bits=8))


def write(output_dir, step: int, payload: bytes = b"x" * 10) -> str:
    with writing_checkpoint(checkpoint_dir(output_dir, step)) as d:
        with open(os.path.join(d, "part.bin"), "wb") as f:
            f.write(payload)
    return d


def test_auto_picks_the_newest_complete_checkpoint_and_says_which_it_skips(tmp_path, caplog):
    assert latest_checkpoint(tmp_path) is None
    write(tmp_path, 2)
    write(tmp_path, 4)
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 4)
    # torn at step 6: files written, no marker (killed before every rank finished)
    os.makedirs(checkpoint_dir(tmp_path, 6))
    (tmp_path / "checkpoint-6" / "part.bin").write_bytes(b"half")
    # torn at step 8: marker present, but a file was cut short afterwards
    torn = write(tmp_path, 8)
    with open(os.path.join(torn, "part.bin"), "wb") as f:
        f.write(b"x" * 3)
    with caplog.at_level(logging.WARNING, logger="hf_actcomp.state.resume"):
        assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 4)
    assert "checkpoint-8" in caplog.text and "has 3 bytes, 10 when it was written" in caplog.text
    assert "checkpoint-6" in caplog.text and f"no {COMPLETE_MARKER}" in caplog.text
    assert resolve_resume_from_checkpoint("auto", tmp_path) == checkpoint_dir(tmp_path, 4)
    with pytest.raises(ValueError, match="checkpoint-8 is incomplete: .*part.bin has 3 bytes"):
        resolve_resume_from_checkpoint(torn, tmp_path)


def test_rewriting_a_checkpoint_removes_its_marker_first(tmp_path):
    path = write(tmp_path, 2)
    with pytest.raises(RuntimeError, match="killed"):
        with writing_checkpoint(path):
            assert not os.path.exists(os.path.join(path, COMPLETE_MARKER))
            raise RuntimeError("killed while writing")
    assert latest_checkpoint(tmp_path) is None


def test_auto_is_the_default_after_a_restart(tmp_path, monkeypatch):
    write(tmp_path, 3)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert resolve_resume_from_checkpoint(None, tmp_path) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resolve_resume_from_checkpoint(None, tmp_path) == checkpoint_dir(tmp_path, 3)
    assert resolve_resume_from_checkpoint(None, tmp_path / "empty") is None
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        resolve_resume_from_checkpoint(str(tmp_path / "nowhere"), tmp_path)


def train(sim, optimizer, batches) -> None:
    for batch in batches:
        sim(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def fresh(plan: Plan = AQSGD, **config):
    torch.manual_seed(0)
    sim = simulate(debug_model("gpt2", seed=0, **config), plan)
    return sim, torch.optim.AdamW(sim.parameters(), lr=1e-3)


def save(sim, optimizer, directory, step: int = 3) -> None:
    with writing_checkpoint(directory) as d:
        save_training_state(d, rank=0, module=sim.model, optimizer=optimizer, compression=sim.compression,
                            progress={"step": step})


DROPOUT = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}


def test_a_resumed_simulation_continues_bit_for_bit(tmp_path):
    """Weights, AdamW, AQ-SGD memory, error feedback, tie tables and the RNG (dropout) all come back."""
    batches = list(training_batches(debug_model("gpt2").config.vocab_size, 6))
    sim, optimizer = fresh(**DROPOUT)
    assert sim.model.training and any(isinstance(m, torch.nn.Dropout) and m.p == 0.1 for m in sim.model.modules())
    train(sim, optimizer, batches[:3])
    save(sim, optimizer, tmp_path / "checkpoint-3")
    train(sim, optimizer, batches[3:])
    expected = {n: p.detach().clone() for n, p in sim.model.named_parameters()}

    def resumed(ignore_saved_rng: bool) -> dict[str, torch.Tensor]:
        other, other_optimizer = fresh(**DROPOUT)
        torch.manual_seed(123)  # the RNG must come from the checkpoint, not from here
        progress = load_training_state(tmp_path / "checkpoint-3", rank=0, module=other.model,
                                       optimizer=other_optimizer, compression=other.compression)
        assert progress == {"step": 3}
        if ignore_saved_rng:
            torch.manual_seed(123)
        train(other, other_optimizer, batches[3:])
        return dict(other.model.named_parameters())

    # the dropout masks depend on the RNG: without the checkpoint's, the run differs
    assert not all(torch.equal(p, expected[n]) for n, p in resumed(ignore_saved_rng=True).items())
    for name, p in resumed(ignore_saved_rng=False).items():
        assert torch.equal(p, expected[name]), name


@pytest.mark.parametrize("what, match", [
    ("plan", "plan.forward: saved"),
    ("num_samples", "plan.memory: saved"),
    ("model", "model: saved"),
])
def test_state_from_another_run_is_refused_before_anything_changes(tmp_path, what, match):
    sim, optimizer = fresh()
    save(sim, optimizer, tmp_path / "c")
    plan, config = AQSGD, {}
    if what == "plan":
        plan = Plan(**{**AQSGD.to_dict(), "forward": Compression("aqsgd", bits=2)})
    elif what == "num_samples":
        plan = Plan(**{**AQSGD.to_dict(), "memory": MemoryConfig(num_samples=NUM_SAMPLES + 1)})
    else:
        config = {"vocab_size": 300}
    other, other_optimizer = fresh(plan, **config)
    before = {n: p.detach().clone() for n, p in other.model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        load_training_state(tmp_path / "c", rank=0, module=other.model, optimizer=other_optimizer,
                            compression=other.compression)
    assert all(torch.equal(p, before[n]) for n, p in other.model.named_parameters())


@pytest.mark.parametrize("victim", ["weights-rank0.safetensors", "actcomp_state/rank0.safetensors",
                                    "rng-rank0.safetensors", "optimizer-rank0.pt"])
def test_a_truncated_file_is_an_error_naming_it(tmp_path, victim):
    sim, optimizer = fresh()
    directory = checkpoint_dir(tmp_path, 3)
    save(sim, optimizer, directory)
    assert latest_checkpoint(tmp_path) == directory
    path = tmp_path / "checkpoint-3" / victim
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    other, other_optimizer = fresh()
    with pytest.raises(ValueError, match=f"{path}.*(truncated|damaged)"):
        load_training_state(directory, rank=0, module=other.model, optimizer=other_optimizer,
                            compression=other.compression)
    assert latest_checkpoint(tmp_path) is None  # and `auto` would not have picked it


def test_a_missing_rank_file_is_an_error_naming_it(tmp_path):
    sim, optimizer = fresh()
    save(sim, optimizer, tmp_path / "c")
    other, other_optimizer = fresh()
    with pytest.raises(FileNotFoundError, match="weights-rank1.safetensors is missing"):
        load_training_state(tmp_path / "c", rank=1, module=other.model, optimizer=other_optimizer,
                            compression=other.compression)
    os.remove(tmp_path / "c" / "actcomp_state" / "rank0.safetensors")
    with pytest.raises(FileNotFoundError, match="rank0.safetensors is missing"):
        load_training_state(tmp_path / "c", rank=0, module=other.model, optimizer=other_optimizer,
                            compression=other.compression)


def test_a_non_finite_payload_names_its_boundary_and_micro_batch():
    sim, _ = fresh(Plan(num_stages=2, micro_batches=2, forward=Compression("quantize", bits=8)))
    batch = next(training_batches(sim.config.vocab_size, 1))
    with torch.no_grad():
        sim.model.transformer.h[0].mlp.c_fc.weight.fill_(float("inf"))
    with pytest.raises(hf_actcomp.NonFiniteError,
                       match=r"activations sent by stage 0 to stage 1 \(boundary0.forward\), micro-batch 0"):
        sim(**batch)


def test_a_non_finite_payload_stops_the_pipeline_naming_step_and_stage(tmp_path):
    results = run_workers("pipeline_worker.py", 2, ["non_finite", str(tmp_path)], timeout=120, check=False)
    assert [r.returncode for r in results] == [5, 5], [r.stderr[-2000:] for r in results]
    receiver = json.loads((tmp_path / "rank1.json").read_text())
    assert receiver["type"] == "NonFiniteError"
    assert receiver["error"].startswith("Training step 2, stage 1: Non-finite values")
    assert "activations sent by stage 0 to stage 1 (boundary0.forward), micro-batch 0" in receiver["error"]
    sender = json.loads((tmp_path / "rank0.json").read_text())
    assert sender["type"] == "PeerTimeoutError" and "with rank 1" in sender["error"]
