"""ActCompDPOTrainer against TRL's DPOTrainer: the same logged losses, rewards, margins,
log-probabilities, logits and entropies and the same evaluation, in one process (a reference model,
precomputed reference log-probabilities, a LoRA policy) and with one stage per process (a reference
model split by the same plan, a LoRA policy); the per-token fields computed from the stages'
logits equal TRL's fused LM head."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from distributed import run_workers
from trainer_cases import PREFERENCE_VOCAB, dpo_run

pytest.importorskip("trl")
from test_reward import assert_aqsgd_first_epoch, assert_same_logs  # noqa: E402
from trl import DPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from hf_actcomp import (  # noqa: E402
    ActCompDPOTrainer,  # noqa: E402
    Compression,
    Plan,
)
from hf_actcomp.debug import debug_model  # noqa: E402
from hf_actcomp.trainer.dpo_trainer import fused_head_fields  # noqa: E402

PLAN = Plan(num_stages=2, micro_batches=2)
# The reference pass exact (AQ-SGD's default inference form would send Hadamard-6 there).
AQSGD_EXACT_REFERENCE = Plan(num_stages=2, micro_batches=2, forward=Compression("aqsgd", bits=4, inference="none"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return dpo_run(DPOTrainer, str(tmp_path_factory.mktemp("plain")))


@pytest.fixture(scope="module")
def plain_lora(tmp_path_factory):
    return dpo_run(DPOTrainer, str(tmp_path_factory.mktemp("plain_lora")), "lora")


@pytest.mark.parametrize("reference", ["model", "precompute", "lora"])
def test_matches_dpo_trainer(plain, plain_lora, tmp_path, reference):
    """Codec none: every metric DPOTrainer logs, at every step and in evaluation. Precomputed
    reference log-probabilities and a copy of the initial model as the reference give the same
    run; the LoRA run is compared with DPOTrainer's own LoRA run."""
    expected = plain_lora if reference == "lora" else plain
    got = dpo_run(ActCompDPOTrainer, str(tmp_path / "ours"), reference, plan=PLAN)
    assert_same_logs(got, expected)
    assert {"rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen", "entropy"} <= set(got["logs"][0])


def test_two_processes_match_dpo_trainer(plain, plain_lora, tmp_path):
    """One stage per process: the reference pass through the pipeline (a reference model split by
    the same plan; the LoRA policy without its adapters), the pairwise loss on the last stage per
    micro-batch of whole pairs, DPOTrainer's metrics on every rank; ipo as the loss too; AQ-SGD
    keyed per row."""
    runs = {"model": {"trainer": "dpo", "plan": PLAN.to_dict()},
            "lora": {"trainer": "dpo", "plan": PLAN.to_dict(), "reference": "lora"},
            "ipo": {"trainer": "dpo", "plan": PLAN.to_dict(), "config": {"loss_type": ["ipo"]}},
            "aqsgd": {"trainer": "dpo", "plan": AQSGD_EXACT_REFERENCE.to_dict()}}
    run_workers("preference_worker.py", 2, [json.dumps({"runs": runs}), str(tmp_path)], timeout=400)
    ipo = dpo_run(DPOTrainer, str(tmp_path / "ipo-plain"), config={"loss_type": ["ipo"]})
    for name, expected in (("model", plain), ("lora", plain_lora), ("ipo", ipo)):
        for rank in range(2):
            assert_same_logs(json.loads((tmp_path / f"{name}-rank{rank}.json").read_text()), expected, what=name)
    assert_aqsgd_first_epoch(json.loads((tmp_path / "aqsgd-rank0.json").read_text()), plain)


def test_the_reference_runs_through_the_plan(plain, tmp_path):
    """The reference pass takes the plan's inference form: exact (`inference="none"`) while the
    policy trains through quantize-2, so the first step's rewards are no longer exactly 0 (plain
    DPO's are: the policy is the reference), and the training boundary's bytes are counted."""
    plan = Plan(num_stages=2, micro_batches=2, forward=Compression("quantize", bits=2, inference="none"))
    got = dpo_run(ActCompDPOTrainer, str(tmp_path), config={"max_steps": 1}, plan=plan)
    assert got["logs"][0]["rewards/chosen"] != 0.0 == plain["logs"][0]["rewards/chosen"]


def test_fused_head_fields_equal_trls_fused_head():
    model = debug_model("llama", seed=0, vocab_size=PREFERENCE_VOCAB)
    fused = copy.deepcopy(model)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))
    ids = torch.randint(3, PREFERENCE_VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    theirs = fused(input_ids=ids, labels=labels, fused_lm_head=True)
    ours = fused_head_fields(model(input_ids=ids).logits, labels, weighting=True)
    for field in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        torch.testing.assert_close(getattr(ours, field), getattr(theirs, field), atol=1e-5, rtol=1e-5, msg=field)
    assert torch.equal(ours.is_top1, theirs.is_top1) and torch.equal(ours.label_mask, theirs.label_mask)
    torch.testing.assert_close(ours.loss, theirs.loss)


def test_aqsgd_keys_each_row_of_a_pair(plain, tmp_path):
    """With the reference pass exact, the first epoch is plain DPO's."""
    assert_aqsgd_first_epoch(dpo_run(ActCompDPOTrainer, str(tmp_path), plan=AQSGD_EXACT_REFERENCE), plain)


def test_refused_before_any_work(tmp_path, monkeypatch):
    from trl import DPOConfig

    monkeypatch.setattr(DPOConfig, "world_size", property(lambda self: 2))  # as under torchrun, before any work
    with pytest.raises(ValueError, match=r"several processes does not take DPOConfig\(loss_type=\['robust'\]\): "
                                         "the last stage computes sigmoid, hinge, ipo"):
        dpo_run(ActCompDPOTrainer, str(tmp_path), config={"loss_type": ["robust"]}, plan=PLAN)
    with pytest.raises(ValueError, match="precompute_ref_log_probs=True.*runs through the pipeline at every step"):
        dpo_run(ActCompDPOTrainer, str(tmp_path), "precompute", plan=PLAN)


DPO_RECIPE = ["--bf16", "false", "--max_steps", "3", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size",
              "4", "--logging_steps", "1", "--report_to", "none", "--seed", "0", "--save_strategy", "no",
              "--disable_tqdm", "true", "--learning_rate", "1e-3", "--max_rows", "24",
              "--config_overrides", "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0"]


def test_the_recipe_on_two_processes_matches_plain_dpo(tmp_path):
    """recipes/dpo.py as users run it: plain DPOTrainer in one process against ActCompDPOTrainer
    under plain torchrun with one stage per process: losses, reward margins, evaluation, weights."""
    from scripts import assert_same_run, run

    run("dpo.py", tmp_path / "plain", [*DPO_RECIPE, "--plain"])
    run("dpo.py", tmp_path / "two", DPO_RECIPE, processes=2)
    assert_same_run(tmp_path / "plain", tmp_path / "two", losses=("loss", "rewards/margins", "logps/chosen"),
                    metrics=("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"), results="all_results.json")


def test_checkpoints_resume_exactly_on_two_processes(tmp_path):
    """ActCompDPOTrainer and ActCompRewardTrainer under 2 processes with AQ-SGD (whose memory the
    second epoch reads): a checkpoint every 2 steps holds the plan and each stage's state, and a
    new trainer resumed from step 2 logs the same steps 3-4 and evaluation as the run that never
    stopped (DPO's policy and reference through the pipeline, the reward model's pairwise loss)."""
    saving = {"save_strategy": "steps", "save_steps": 2}
    reward_plan = Plan(num_stages=2, micro_batches=2, forward=Compression("aqsgd", bits=4)).to_dict()
    runs = {"dpo": {"trainer": "dpo", "plan": AQSGD_EXACT_REFERENCE.to_dict(), "config": saving},
            "dpo_resumed": {"trainer": "dpo", "plan": AQSGD_EXACT_REFERENCE.to_dict(), "config": saving,
                            "resume": "dpo/checkpoint-2"},
            "reward": {"plan": reward_plan, "config": saving},
            "reward_resumed": {"plan": reward_plan, "config": saving, "resume": "reward/checkpoint-2"}}
    run_workers("preference_worker.py", 2, [json.dumps({"runs": runs}), str(tmp_path)], timeout=400)
    for name in ("dpo", "reward"):
        for step in (2, 4):
            checkpoint = tmp_path / name / f"checkpoint-{step}"
            saved = Plan.from_pretrained(str(checkpoint))  # with AQ-SGD's rows: chosen and rejected of 16 pairs
            assert saved.forward == AQSGD_EXACT_REFERENCE.forward if name == "dpo" else saved.forward.method == "aqsgd"
            assert saved.memory.num_samples == 32, checkpoint
        for rank in range(2):
            full, resumed = (json.loads((tmp_path / f"{run}-rank{rank}.json").read_text())
                             for run in (name, f"{name}_resumed"))
            assert resumed["compression_ratio"][2:] == pytest.approx(full["compression_ratio"][2:])
            assert full["compression_ratio"][3] > 1.2  # the resumed steps read AQ-SGD's restored memory
            # TRL's `num_tokens` counts from the trainer's construction, not from the checkpoint
            # (DPOTrainer and RewardTrainer start `_total_train_tokens` at 0); so does ours.
            tokens = [entry.pop("num_tokens") for entry in resumed["logs"]]
            full_tokens = [entry.pop("num_tokens") for entry in full["logs"]]
            assert tokens[2:] == [t - full_tokens[1] for t in full_tokens[2:]]
            assert resumed["eval"].pop("eval_num_tokens") == full["eval"].pop("eval_num_tokens") - full_tokens[1]
            assert_same_logs(resumed, full, rel=1e-6, what=f"{name} rank {rank}")
