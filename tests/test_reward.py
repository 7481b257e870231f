"""ActCompRewardTrainer against TRL's RewardTrainer: the same logged losses, rewards, accuracies and
margins, and the same evaluation, in one process and with one stage per process; the pairwise loss
computed one micro-batch at a time on the last stage equals the batch mean."""

from __future__ import annotations

import json

import pytest
import torch
from distributed import run_workers
from trainer_cases import reward_run

pytest.importorskip("trl")
from trl import RewardTrainer  # noqa: E402

from hf_actcomp import ActCompRewardTrainer, Compression, Plan  # noqa: E402
from hf_actcomp.trainer.reward_trainer import PairwiseRewardLoss, pairs_per_micro_batch  # noqa: E402

AQSGD = Plan(num_stages=2, micro_batches=2, forward=Compression("aqsgd", bits=4))


def assert_same_logs(got: dict, expected: dict, rel: float = 1e-5, what: str = "") -> None:
    """Every logged training entry and evaluation metric of `expected`, to `rel` (`what` names the run)."""
    assert len(got["logs"]) == len(expected["logs"]) == 4, what
    for step, (mine, theirs) in enumerate(zip(got["logs"], expected["logs"], strict=True)):
        assert set(theirs) <= set(mine), f"{what} step {step}: missing {set(theirs) - set(mine)}"
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, rel=rel, abs=1e-6), f"{what} step {step}: {key}"
    assert set(got["eval"]) == set(expected["eval"]), what
    for key, value in expected["eval"].items():
        assert got["eval"][key] == pytest.approx(value, rel=rel, abs=1e-6), f"{what}: {key}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return reward_run(RewardTrainer, str(tmp_path_factory.mktemp("plain")))


def test_one_process_matches_reward_trainer(plain, tmp_path):
    """RewardTrainer's own loss on the in-process stages: the same run, metrics included."""
    got = reward_run(ActCompRewardTrainer, str(tmp_path), plan=Plan(num_stages=2, micro_batches=2))
    assert_same_logs(got, plain)
    assert {"accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"} <= set(got["logs"][0])


def test_two_processes_match_reward_trainer(plain, tmp_path):
    """One stage per process: the last stage computes the pairwise loss per micro-batch of whole
    pairs and shares the rewards; every rank logs RewardTrainer's numbers. A compressed plan
    trains on with its boundary bytes counted, and AQ-SGD keys each row of a pair."""
    runs = {"exact": {"plan": {"num_stages": 2, "micro_batches": 2}}, "aqsgd": {"plan": AQSGD.to_dict()},
            "hadamard": {"plan": Plan(num_stages=2, micro_batches=2, forward=Compression("hadamard", bits=8),
                                      backward=Compression("quantize", bits=8)).to_dict()}}
    run_workers("preference_worker.py", 2, [json.dumps({"runs": runs}), str(tmp_path)], timeout=300)
    for rank in range(2):
        exact = json.loads((tmp_path / f"exact-rank{rank}.json").read_text())
        assert_same_logs(exact, plain)
        assert exact["problem_type"] == plain["problem_type"] is None  # counting does not record a loss kind
    assert_aqsgd_first_epoch(json.loads((tmp_path / "aqsgd-rank1.json").read_text()), plain)
    compressed = json.loads((tmp_path / "hadamard-rank0.json").read_text())
    assert all(ratio > 2.5 for ratio in compressed["compression_ratio"])
    for mine, theirs in zip(compressed["logs"], plain["logs"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=0.05)


def test_pairs_stay_whole_in_every_micro_batch():
    """Chosen rows 0..3, rejected rows 4..7 (RewardTrainer's collator): two micro-batches of pairs
    (0, 1) and (2, 3), each its chosen rows then the same pairs' rejected rows; margins per row."""
    inputs = {"input_ids": torch.arange(8).unsqueeze(1), "attention_mask": torch.ones(8, 1),
              "margin": torch.tensor([0.1, 0.2, 0.3, 0.4])}
    out = pairs_per_micro_batch(inputs, 2)
    assert out["input_ids"].flatten().tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert out["labels"].tolist() == pytest.approx([0.1, 0.2, 0.1, 0.2, 0.3, 0.4, 0.3, 0.4])
    with pytest.raises(ValueError, match="A preference batch of 3 pairs cannot be cut into plan.micro_batches=2"):
        pairs_per_micro_batch({"input_ids": torch.zeros(6, 1)}, 2)


def test_the_micro_batches_losses_add_up_to_the_batch_mean():
    torch.manual_seed(0)
    chosen, rejected, margin = torch.randn(4), torch.randn(4), torch.rand(4)
    expected = -torch.nn.functional.logsigmoid(chosen - rejected - margin).mean() + 0.1 * ((chosen + rejected) ** 2).mean()
    loss = PairwiseRewardLoss(0.1)
    total = sum(loss(torch.cat([chosen[i:i + 2], rejected[i:i + 2]]).unsqueeze(1),
                     torch.cat([margin[i:i + 2], margin[i:i + 2]]), torch.tensor(8.0)) for i in (0, 2))
    torch.testing.assert_close(total, expected)
    assert loss.take_rewards().tolist() == torch.stack([chosen, rejected], 1).tolist()
    assert loss.take_rewards() is None
    alone = PairwiseRewardLoss()(torch.cat([chosen, rejected]).unsqueeze(1), torch.cat([margin, margin]), None)
    torch.testing.assert_close(alone, -torch.nn.functional.logsigmoid(chosen - rejected - margin).mean())


def assert_aqsgd_first_epoch(got: dict, plain: dict) -> None:
    """AQ-SGD keyed per row (a pair's chosen row 2i, its rejected row 2i + 1): the first epoch
    (2 steps) sends every row in full, so its losses are plain's; the second sends 4-bit deltas."""
    for mine, theirs in zip(got["logs"][:2], plain["logs"][:2], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert got["compression_ratio"][1] == pytest.approx(1.0) and got["compression_ratio"][3] > 1.2


def test_aqsgd_keys_each_row_of_a_pair(plain, tmp_path):
    assert_aqsgd_first_epoch(reward_run(ActCompRewardTrainer, str(tmp_path), plan=AQSGD), plain)


def test_aqsgd_with_replicas_is_refused_before_any_work(tmp_path):
    plan = Plan(num_stages=1, data_parallel=2, forward=Compression("aqsgd", bits=4))
    with pytest.raises(ValueError, match="takes AQ-SGD with data_parallel=1 only so far"):
        reward_run(ActCompRewardTrainer, str(tmp_path), plan=plan)


def test_replicas_match_reward_trainer_under_ddp(tmp_path):
    """2 stages x 2 replicas on 4 processes against TRL's RewardTrainer under DDP on 2 (the same
    shards): every rank logs its losses, gradient norms, rewards, accuracies, margins and token
    counts (gathered over the replicas as RewardTrainer gathers them over the processes) and
    evaluates to its metrics (each replica evaluates the 8 pairs as DDP's one global batch)."""
    config = {"per_device_eval_batch_size": 4}
    run_workers("preference_worker.py", 2, [json.dumps({"runs": {"ddp": {"trainer": "reward_ddp", "config": config,
                                                                         "eval_pairs": 8}}}), str(tmp_path)],
                timeout=300)
    plan = Plan(num_stages=2, data_parallel=2, micro_batches=2)
    run_workers("preference_worker.py", 4, [json.dumps({"runs": {"ours": {"plan": plan.to_dict(), "config": config,
                                                                          "eval_pairs": 8}}}), str(tmp_path)],
                timeout=300)
    ddp = json.loads((tmp_path / "ddp-rank0.json").read_text())
    assert {"accuracy", "margin", "min_reward", "max_reward", "num_tokens", "grad_norm"} <= set(ddp["logs"][0])
    for rank in range(4):
        assert_same_logs(json.loads((tmp_path / f"ours-rank{rank}.json").read_text()), ddp, what=f"rank {rank}")
