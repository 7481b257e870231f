"""Per-stage loading (`prepare("name-or-path", plan)`): each rank reads only its stage's tensors,
and the result equals a full `from_pretrained` load, tied and untied, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers
from pipeline_cases import check_stage_grads, padded_batch, tie_partners
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_actcomp.debug import debug_model


@pytest.mark.parametrize(
    "family, num_stages, dtype",
    [("gpt2", 2, "float32"), ("llama", 3, "float32"), ("gpt2", 3, "bfloat16")],
    ids=["gpt2-tied-2", "llama-untied-3", "gpt2-tied-3-bf16"],
)
def test_per_stage_loading_equals_full_load(tmp_path, family, num_stages, dtype):
    checkpoint = tmp_path / "checkpoint"
    debug_model(family, seed=0).save_pretrained(checkpoint, max_shard_size="100KB")  # sharded, with an index
    assert (checkpoint / "model.safetensors.index.json").is_file()
    out = tmp_path / "out"
    out.mkdir()
    run_workers("loading_worker.py", num_stages, [str(checkpoint), str(out), dtype], timeout=300)

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
    batch = padded_batch(reference.config.vocab_size)
    loss = reference(**{k: v for k, v in batch.items() if k != "sample_id"}).loss
    loss.backward()
    params = dict(reference.named_parameters(remove_duplicate=False))
    partners = tie_partners(reference)
    if family == "gpt2":
        assert partners, "GPT-2 ties its head to the input embedding"
    seen: set[str] = set()
    total = sum(p.numel() for p in reference.parameters())
    for rank in range(num_stages):
        got = load_file(out / f"rank{rank}.safetensors")
        for key, value in got.items():
            if key.startswith("param."):
                name = key[len("param."):]
                assert value.dtype == params[name].dtype
                torch.testing.assert_close(value, params[name].detach(), rtol=0, atol=0, msg=name)
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == "bfloat16" else dict(atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got["loss"][0], loss.detach().float(), **tol)
        if dtype == "float32":
            check_stage_grads(got, params, partners, f"{family}/rank{rank}", seen)
        # Only this stage was materialised: at most its own parameters (tied copies counted once).
        assert got["held"].item() <= got["stage_numel"].item() < total
    if dtype == "float32":
        assert seen == set(params), f"parameters missing on every stage: {set(params) - seen}"

    # save_pretrained from the per-stage pipeline (no model= argument): one shard per stage, written
    # by its own rank, and an index; from_pretrained loads it.
    shards = sorted(p.name for p in (out / "saved").glob("model-*.safetensors"))
    assert shards == [f"model-{s + 1:05d}-of-{num_stages:05d}.safetensors" for s in range(num_stages)]
    saved = AutoModelForCausalLM.from_pretrained(out / "saved", dtype=getattr(torch, dtype))
    for name, p in saved.named_parameters():
        torch.testing.assert_close(p, params[name].detach(), rtol=0, atol=0, msg=name)


def test_wrong_world_size_fails_before_loading(tmp_path, monkeypatch):
    import torch.distributed as dist
    from distributed import free_port

    import hf_actcomp
    from hf_actcomp import Plan
    from hf_actcomp.pipeline import engine

    debug_model("gpt2").save_pretrained(tmp_path)
    monkeypatch.setattr(engine, "load_stage_model", lambda *a, **k: pytest.fail("weights were read"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="needs exactly 2 processes .* but the world size is 1"):
            hf_actcomp.prepare(str(tmp_path), Plan(num_stages=2))
    finally:
        dist.destroy_process_group()
