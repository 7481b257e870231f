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


def test_marsit_merge_signs_keeps_the_mean_sign():
    """The library's merge rule, applied in ring order, keeps the mean of the workers' sign bits."""
    workers, n = 4, 200_000
    g = torch.Generator().manual_seed(0)
    signs = [torch.rand(n, generator=g) < p for p in (0.1, 0.5, 0.7, 0.9)]
    merged = signs[0]
    for covered in range(1, workers):
        merged = dp.merge_signs(merged, signs[covered], covered, g)
    assert merged.float().mean().item() == pytest.approx(torch.stack(signs).float().mean().item(), abs=0.005)


def test_marsit_ring_picks_a_uniform_worker(tmp_path):
    """Through the real hook on 4 processes: every coordinate ends as exactly one worker's sign
    bit, the same on every rank, and in every ring chunk each worker owns 1/4 of the coordinates
    (each chunk starts its trip at a different worker, so a wrong keep probability at any hop
    skews the shares: with 1/2 at every hop they would be 1/8, 1/8, 1/4, 1/2)."""
    world, per_chunk = 4, 50_000
    run_workers("dp_worker.py", world, ["marsit_owners", str(tmp_path), str(per_chunk)])
    positive = [load_file(tmp_path / f"rank{r}.safetensors")["positive"] for r in range(world)]
    for r in range(1, world):
        assert torch.equal(positive[r], positive[0])  # every worker agrees on every bit
    assert torch.equal(positive[0].sum(0), torch.ones(world * per_chunk, dtype=torch.uint8))  # one owner each
    shares = positive[0].view(world, world, per_chunk).float().mean(2)  # [worker, chunk]
    # binomial std of a share over 50,000 coordinates: 0.0019; 0.01 is 5 of them
    assert torch.allclose(shares, torch.full((world, world), 0.25), atol=0.01), shares


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
        # DDP's own all-reduce gives the same average: the stats show that our hook did it, once,
        # for all 676 fp32 gradients (one bucket), with the ring all-reduce's bytes.
        stats = json.loads((tmp_path / f"rank{rank}.json").read_text())
        wire = dp.ring_allreduce_bytes(676 * 4, world)
        assert (stats["hook"], stats["steps"]) == ("allreduce", 1)
        assert stats["bytes_sent"] == stats["bytes_uncompressed"] == wire, stats


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


ALL_HOOKS = {"allreduce", "topk", "randk", "dgc", "qsgd", "ef_sign", "marsit", "powersgd"}
# topk and dgc (error feedback / momentum correction at 10% and 5%), qsgd (15 levels) and
# powersgd: little information lost per step.
NEAR_LOSSLESS = {"topk", "dgc", "qsgd", "powersgd"}


@pytest.mark.parametrize("cast", ["none", "bf16"])
def test_every_hook_trains_close_to_uncompressed(tmp_path, cast):
    """Bounds in uncompressed steps (the runs are seeded and deterministic): every hook ends at
    least where uncompressed training is after 2/3 of the steps, and the near-lossless ones after
    5/6. At 30 steps these are 0.677 and 0.582 against the uncompressed 0.505; the worst hooks
    reach 0.640 (ef_sign) and 0.542 (dgc). TopK without error feedback ends at 0.656 and fails
    the second bound; a hook that halves the average (half the step size) fails both."""
    steps = 30
    run_workers("dp_worker.py", 2, ["train", str(tmp_path), str(steps), cast], timeout=300)
    report = json.loads((tmp_path / "rank0.json").read_text())
    other = json.loads((tmp_path / "rank1.json").read_text())
    result, refused = report["runs"], report["refused"]
    # exactly these hooks ran: one dropped or refused fails here
    if cast == "bf16":  # torch refuses its bf16 wrapper without CUDA + NCCL; no other hook may be missing
        assert set(refused) == {"powersgd"} and "NCCL" in refused["powersgd"], refused
        assert set(result) == ALL_HOOKS - {"powersgd"}
    else:
        assert refused == {} and set(result) == ALL_HOOKS
    for name in result:  # the replicas stay identical
        assert result[name]["losses"] == other["runs"][name]["losses"], name
    baseline = result["allreduce"]["losses"]  # losses[i]: after step i + 1
    assert baseline[-1] < 0.45 * baseline[0]
    for name, run in result.items():
        stats, losses = run["stats"], run["losses"]
        assert stats["hook"] == name and stats["steps"] == steps and stats["bytes_sent"] > 0, (name, stats)
        assert losses[-1] <= baseline[2 * steps // 3 - 1], (name, losses[-1], baseline)
        if name in NEAR_LOSSLESS:
            assert losses[-1] <= baseline[5 * steps // 6 - 1], (name, losses[-1], baseline)
        if name == "allreduce":
            assert stats["compression_ratio"] == 1.0
        else:
            assert stats["compression_ratio"] > 2, name


def test_resume_continues_exactly(tmp_path):
    """Every stateful hook, in one launch: 2 steps, save, load into a fresh DDP, 2 steps == 4 steps."""
    names = ["topk", "randk", "dgc", "qsgd", "ef_sign", "marsit"]
    run_workers("dp_worker.py", 2, ["resume", str(tmp_path), *names])
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == dict.fromkeys(names, 0.0)


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


def test_pipeline_powersgd_equals_torchs_hook_under_ddp(tmp_path):
    """The pipeline's PowerSGD (each step's gradients as one flat buffer) gives, step by step,
    exactly what torch's PowerSGD hook gives under DDP on the same gradients (one bucket, the same
    order): the same plain average for the first 2 steps, then the same rank-2 approximation with
    its error feedback and warm start, which is not the exact mean."""
    steps = 5
    run_workers("dp_worker.py", 2, ["powersgd_like_torch", str(tmp_path), str(steps)], timeout=120)
    for rank in range(2):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        names = sorted({key.split(".", 2)[2] for key in got})
        assert names == ["0.bias", "0.weight", "2.bias", "2.weight"]
        for step in range(steps):
            for name in names:
                torch.testing.assert_close(got[f"{step}.ours.{name}"], got[f"{step}.torch.{name}"], rtol=0, atol=0)
            approximated = [not torch.allclose(got[f"{step}.ours.{n}"], got[f"{step}.exact.{n}"]) for n in names]
            # steps 0-1 all-reduce; then the 32 x 16 weight is sent as rank-2 factors (96 numbers for
            # 512); the 4 x 32 one would save less than min_compression_rate=2 (72 for 128) and the
            # biases are 1-D: those stay exact
            assert approximated == ([False] * 4 if step < 2 else [False, True, False, False]), (step, approximated)
