"""Data-parallel gradient hooks (gloo, 2 and 4 processes; pure parts in-process)."""

import json

import pytest
import torch
from distributed import run_workers
from safetensors.torch import load_file

from hf_actcomp import dp


# ------------------------------------------------------------------ in-process: the estimators
def test_qsgd_is_unbiased_and_sized_exactly():
    x = torch.randn(1000) * torch.linspace(0.1, 3, 1000)
    g = torch.Generator().manual_seed(0)
    payload = dp.qsgd_encode(x, levels=3, bucket_size=128, generator=g)
    buckets = 8  # ceil(1000 / 128)
    assert payload.numel() == 4 * buckets + 125 * 3  # fp32 norms + 3-bit codes (2 level bits + sign)
    mean = sum(dp.qsgd_decode(dp.qsgd_encode(x, 3, 128, g), 1000, 3, 128) for _ in range(4000)) / 4000
    # Per-element std of one draw is at most norm / levels / 2; 4000 draws shrink it 63x.
    tolerance = 4 * x.view(-1)[:896].view(-1, 128).norm(dim=1).max() / 3 / 2 / 4000**0.5
    assert (mean - x).abs().max() < tolerance


def test_marsit_merge_picks_a_uniform_worker():
    """After merging W workers' bits in ring order, each coordinate is worker w's bit w.p. 1/W."""
    workers, n = 4, 200_000
    g = torch.Generator().manual_seed(0)
    owner = [torch.full((n,), w) for w in range(workers)]
    aggregate = owner[0]
    for covered in range(1, workers):
        keep = torch.rand(n, generator=g) < covered / (covered + 1)
        aggregate = torch.where(keep, aggregate, owner[covered])
    shares = torch.bincount(aggregate, minlength=workers).float() / n
    assert torch.allclose(shares, torch.full((workers,), 0.25), atol=0.005)
    # the same rule through the library function, on sign bits
    signs = [torch.rand(n, generator=g) < p for p in (0.1, 0.5, 0.7, 0.9)]
    merged = signs[0]
    for covered in range(1, workers):
        merged = dp.merge_signs(merged, signs[covered], covered, g)
    assert merged.float().mean().item() == pytest.approx(torch.stack(signs).float().mean().item(), abs=0.005)


def test_available_hooks():
    assert dp.available_hooks() == ["allreduce", "dgc", "ef_sign", "marsit", "powersgd", "qsgd", "randk", "topk"]


# ------------------------------------------------------------------ processes
@pytest.mark.parametrize("world", [2, 4])
def test_allreduce_hook_is_the_exact_average(tmp_path, world):
    run_workers("dp_worker.py", world, ["exact_average", str(tmp_path)])
    import sys

    sys.path.insert(0, str(tmp_path.parent))
    from workers.dp_worker import shard, small_model

    grads = []
    for rank in range(world):
        model = small_model()
        x, y = shard(rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for rank in range(world):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        for name in got:
            expected = torch.stack([g[name] for g in grads]).mean(0)
            torch.testing.assert_close(got[name], expected, atol=1e-6, rtol=1e-5)


def test_error_feedback_accounting_is_exact(tmp_path):
    """sent + new residual == gradient + old residual on every rank, and the hook's output is
    exactly the average of what the ranks sent (topk, randk, ef_sign, marsit)."""
    run_workers("dp_worker.py", 2, ["accounting", str(tmp_path)])
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, errors in report.items():
            assert max(errors) < 1e-5, (name, errors)


def test_qsgd_randk_marsit_are_unbiased_across_4_workers(tmp_path):
    repeats = 300
    run_workers("dp_worker.py", 4, ["unbiased", str(tmp_path), str(repeats)], timeout=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    g = torch.tensor([r["g"] for r in reports])
    mean = g.mean(0)
    for name in ("qsgd", "randk"):
        est = torch.tensor(reports[0][name])
        assert torch.equal(est, torch.tensor(reports[3][name]))  # every worker gets the same average
        # relative error of the mean over 300 draws; a biased estimator misses by far more
        assert (est - mean).norm() / mean.norm() < 0.12, name
    scale = g.abs().mean(1).mean()
    est = torch.tensor(reports[0]["marsit"])
    expected = scale * torch.sign(g).mean(0)
    assert (est - expected).norm() / expected.norm() < 0.12
    stats = reports[0]["marsit.stats"]
    # 1 bit per element per hop, 2 (W - 1) hops of n / W elements, plus the 4-byte scale all-reduce
    assert stats["bytes_sent"] == repeats * (2 * 3 * (64 // 8) + ((2 * 3 * 4) // 4))


@pytest.mark.parametrize("cast", ["none", "bf16"])
def test_every_hook_trains_close_to_uncompressed(tmp_path, cast):
    steps = 30
    run_workers("dp_worker.py", 2, ["train", str(tmp_path), str(steps), cast], timeout=300)
    result = json.loads((tmp_path / "rank0.json").read_text())
    other = json.loads((tmp_path / "rank1.json").read_text())
    for name in result:  # the replicas stay identical
        assert result[name]["losses"] == other[name]["losses"], name
    baseline = result["allreduce"]["losses"]
    assert baseline[-1] < 0.6 * baseline[0]
    for name, run in result.items():
        losses = run["losses"]
        assert losses[-1] < 0.75 * losses[0], name
        assert losses[-1] < baseline[-1] + 0.2, name
        if name != "allreduce":
            assert run["stats"]["compression_ratio"] > 2, name


@pytest.mark.parametrize("name", ["topk", "randk", "dgc", "qsgd", "ef_sign", "marsit"])
def test_resume_continues_exactly(tmp_path, name):
    run_workers("dp_worker.py", 2, ["resume", str(tmp_path), name])
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["max_diff"] == 0.0


def test_bad_input_errors(tmp_path):
    run_workers("dp_worker.py", 2, ["errors", str(tmp_path)])
    messages = json.loads((tmp_path / "rank0.json").read_text())
    assert "Unknown data-parallel hook 'top-k'. Available hooks: allreduce, dgc" in messages["unknown"]
    assert "needs 0 < ratio <= 1, got ratio=1.5" in messages["ratio"]
    assert "cast='int8' is not valid. Allowed values: fp16, bf16" in messages["cast"]
    assert "needs a torch DistributedDataParallel model" in messages["not_ddp"]
    assert "already has the hf-actcomp hook 'topk'" in messages["twice"]
    assert "process group of 1 process" in messages["solo"]


def test_register_on_the_model_accelerate_prepares(tmp_path):
    run_workers("dp_worker.py", 2, ["accelerate", str(tmp_path)])
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["type"] == "DistributedDataParallel"
    assert report["stats"]["steps"] == 20 and report["stats"]["compression_ratio"] > 5
    assert sum(report["losses"][-5:]) < 0.8 * sum(report["losses"][:5])
