"""The pipeline with CUDA tensors: two processes sharing one GPU over gloo (one GPU cannot host two
NCCL ranks), payloads staged through the host by the transport. Skipped where CUDA is absent, as on
CI; `make test-cuda` runs this file on a GPU machine (docs/gpu.md).

Exactness against the unsplit model on the same GPU, AQ-SGD and TopK runs against `simulate` on
the GPU, `simulate` on the GPU against the CPU, and the transport's timeouts with CUDA buffers.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from distributed import run_workers
from pipeline_cases import (
    COMPRESSED_PLANS,
    EXACT_CASES,
    check_stage_grads,
    padded_batch,
    reference_loss,
    simulated_sgd_losses,
    tie_partners,
)
from safetensors.torch import load_file

from hf_actcomp import simulate
from hf_actcomp.debug import debug_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (none here); `make test-cuda` on a GPU machine")

CUDA = {"HF_ACTCOMP_TEST_DEVICE": "cuda"}


def on_cuda(batch: dict) -> dict:
    return {k: v.cuda() for k, v in batch.items()}


def test_identity_codec_on_cuda_matches_unsplit_model(tmp_path):
    """Every family and schedule of the CPU exactness test on 2 stages, both on the GPU: loss, eval
    loss and every parameter's gradient equal the unsplit model's on the same GPU."""
    run_workers("pipeline_worker.py", 2, ["exact", str(tmp_path), "2"], timeout=600, env=CUDA)
    from pipeline_cases import exact_runs

    runs = exact_runs(2)
    for case in dict.fromkeys(case for case, _ in runs):
        family, overrides = EXACT_CASES[case]
        reference = debug_model(family, seed=0, **overrides).cuda()
        batch = on_cuda(padded_batch(reference.config.vocab_size))
        loss = reference_loss(reference, batch, micro_batches=2)
        loss.backward()
        ref_grads = {n: SimpleNamespace(grad=p.grad.cpu()) for n, p in reference.named_parameters(remove_duplicate=False)}
        partners = tie_partners(reference)
        for schedule in (s for c, s in runs if c == case):
            seen = set()
            for rank in range(2):
                got = load_file(tmp_path / f"{case}-{schedule}-rank{rank}.safetensors")
                torch.testing.assert_close(got["loss"][0], loss.detach().cpu(), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got["eval_loss"][0], loss.detach().cpu(), atol=1e-5, rtol=1e-5)
                check_stage_grads(got, ref_grads, partners, f"cuda/{case}/{schedule}", seen)
            assert seen == set(ref_grads), f"{case}: parameters missing on every stage: {set(ref_grads) - seen}"


@pytest.mark.parametrize("plan_name, schedule", [("aqsgd", "1f1b"), ("topk_ef", "zbh1")])
def test_compressed_run_on_cuda_matches_simulation_on_cuda(tmp_path, plan_name, schedule):
    """AQ-SGD fw4/bw8 and TopK 10% + error feedback on the GPU: the 2-process losses equal
    simulate()'s on the GPU, the AQ-SGD memories of sender and receiver stay equal, and the bytes
    sent are the simulation's."""
    steps = 6
    run_workers("pipeline_worker.py", 2, ["compressed", str(tmp_path), plan_name, str(steps), schedule], env=CUDA)
    result = json.loads((tmp_path / "rank0.json").read_text())
    sim = simulate(debug_model("gpt2", seed=0).cuda(), COMPRESSED_PLANS[plan_name]("1f1b"))
    expected = simulated_sgd_losses(sim, steps)
    assert result["losses"] == pytest.approx(expected, rel=1e-4)
    assert result["losses"][-1] < result["losses"][0]
    if plan_name == "aqsgd":
        for sums in result["checksums"]:
            assert sums["boundary0.sender"] == sums["boundary0.receiver"] != 0.0
    for channel in ("boundary0.forward", "boundary0.backward"):
        assert result["stats"]["channels"][channel]["bytes_sent"] == sim.stats()["channels"][channel]["bytes_sent"]


@pytest.mark.parametrize("plan_name", ["aqsgd", "topk_ef"])
def test_simulate_on_cuda_matches_cpu(plan_name):
    """The same plan, seed and batches give the CPU's losses on the GPU, to a float tolerance (the
    kernels differ, so bits may not)."""
    losses = {}
    for device in ("cpu", "cuda"):
        sim = simulate(debug_model("gpt2", seed=0).to(device), COMPRESSED_PLANS[plan_name]("1f1b"))
        losses[device] = simulated_sgd_losses(sim, steps=6)
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=2e-3)
    assert losses["cuda"][-1] < losses["cuda"][0]


def test_hung_peer_times_out_with_cuda_buffers(tmp_path):
    """A receive into a CUDA stage fails after its timeout, waiting, polling or posted early."""
    run_workers("pipeline_worker.py", 2, ["hung_peer", str(tmp_path)], timeout=120, env=CUDA)
    for name in ("poll0", "poll1", "early"):
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert "Rank 0 failed receiving a message that never comes (16 bytes) with rank 1 (timeout 2s)" in report["error"]
        assert 1.5 < report["seconds"] < 10 and report["waiting"] >= 1.5



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, params", [("quantize", dict(bits=4)), ("quantize", dict(bits=8)),
                                          ("hadamard", dict(bits=4))], ids=["quantize4", "quantize8", "hadamard4"])
def test_fused_quantizers_on_cuda(name, params, dtype):
    """Inductor's fused quantizers (`compile=True`): the decoder of a payload is eager's to float
    tolerance (both ends of a boundary decode alike), and a fused encoder's payload differs from
    eager's by at most one quantization level where a value lies on a rounding step."""
    from hf_actcomp.codecs import make_codec
    from hf_actcomp.codecs.fused import fuse

    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(4, 256, 1024, device="cuda", generator=g) * 3).to(dtype)
    eager, fused = make_codec(name, **params), fuse(make_codec(name, **params), {})
    payload = eager.encode(x)
    torch.testing.assert_close(fused.decode(payload, x.shape, x.dtype), eager.decode(payload, x.shape, x.dtype))
    reference = eager.decode(payload, x.shape, x.dtype).float()
    mine = fused.decode(fused.encode(x), x.shape, x.dtype).float()
    # A level of the widest group (Hadamard: of the rotated tile, within a factor of its block),
    # plus the output dtype's rounding of the largest value.
    top = float(x.float().abs().max())
    level = top / ((1 << (params["bits"] - 1)) - 1) * (2 if name == "hadamard" else 1)
    assert float((mine - reference).abs().max()) <= level * 1.01 + top * torch.finfo(dtype).eps
    assert float((mine - x.float()).norm() / x.float().norm()) <= 1.01 * float((reference - x.float()).norm()
                                                                              / x.float().norm())
