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
        assert got["checkpointed"].item() == (num_stages == 3)  # prepare(activation_checkpointing=True)
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


def test_stages_loaded_separately_chain_to_the_full_model(tmp_path):
    """Gemma 3 in one process: its tied head, embedding scale buffer and two rotary tables come
    out right when each stage is loaded on its own skeleton, and the chained stages give the
    full load's logits."""
    from hf_actcomp import Plan
    from hf_actcomp.models import get_adapter
    from hf_actcomp.models.check import padded_batch as batch_of
    from hf_actcomp.pipeline.loading import load_stage_model

    debug_model("gemma3_text", seed=0).save_pretrained(tmp_path, max_shard_size="100KB")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    plan = Plan(num_stages=2)
    batch = batch_of(256, "left")
    hidden = batch["input_ids"]
    for stage, (start, stop) in enumerate([(0, 2), (2, 4)]):
        model = load_stage_model(tmp_path, plan, stage=stage)
        module = get_adapter(model).build_stage(start, stop, first=stage == 0, last=stage == 1)
        assert all(p.device.type == "cpu" for p in module.parameters())
        assert any(p.device.type == "meta" for p in model.parameters())  # the other stage's
        reference_buffers = dict(reference.named_buffers())
        for name, buffer in module.named_buffers():
            torch.testing.assert_close(buffer, reference_buffers[name], rtol=0, atol=0, msg=name)
        hidden = module(hidden, batch["attention_mask"])
    torch.testing.assert_close(hidden, reference(**batch, use_cache=False).logits, rtol=0, atol=0)


def test_converted_checkpoints_are_refused_with_the_alternative(tmp_path):
    from hf_actcomp import Plan
    from hf_actcomp.pipeline.loading import load_stage_model

    debug_model("mixtral").save_pretrained(tmp_path)  # per-expert w1/w2/w3 on disk
    with pytest.raises(ValueError, match="has no tensor for 'model.layers.0.mlp.gate.weight'.* mixtral "
                       "checkpoints store some weights under names that from_pretrained converts"):
        load_stage_model(tmp_path, Plan(num_stages=2), stage=0)
