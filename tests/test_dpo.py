"""ActCompDPOTrainer against TRL's DPOTrainer in one process: the same logged losses, rewards,
margins, log-probabilities, logits and entropies and the same evaluation, with a reference model,
precomputed reference log-probabilities and a LoRA policy; the per-token fields computed from the
stages' logits equal TRL's fused LM head."""

from __future__ import annotations

import copy

import pytest
import torch
from trainer_cases import PREFERENCE_VOCAB, dpo_run

pytest.importorskip("trl")
from test_reward import assert_same_logs  # noqa: E402
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


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return dpo_run(DPOTrainer, str(tmp_path_factory.mktemp("plain")))


@pytest.mark.parametrize("reference", ["model", "precompute", "lora"])
def test_matches_dpo_trainer(plain, tmp_path, reference):
    """Codec none: every metric DPOTrainer logs, at every step and in evaluation. Precomputed
    reference log-probabilities and a copy of the initial model as the reference give the same
    run; the LoRA run is compared with DPOTrainer's own LoRA run."""
    expected = dpo_run(DPOTrainer, str(tmp_path / "lora-plain"), "lora") if reference == "lora" else plain
    got = dpo_run(ActCompDPOTrainer, str(tmp_path / "ours"), reference, plan=PLAN)
    assert_same_logs(got, expected)
    assert {"rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen", "entropy"} <= set(got["logs"][0])


def test_the_reference_runs_through_the_plan(plain, tmp_path):
    """The reference pass takes the plan's inference form: exact (`inference="none"`) while the
    policy trains through quantize-2, so the first step's rewards are no longer exactly 0 (plain
    DPO's are: the policy is the reference), and the training boundary's bytes are counted."""
    plan = Plan(num_stages=2, micro_batches=2, forward=Compression("quantize", bits=2, inference="none"))
    got = dpo_run(ActCompDPOTrainer, str(tmp_path), plan=plan)
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


def test_refused_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not take AQ-SGD plans yet"):
        dpo_run(ActCompDPOTrainer, str(tmp_path), plan=Plan(num_stages=2, micro_batches=2,
                                                            forward=Compression("aqsgd", bits=4)))
    from trl import DPOConfig

    monkeypatch.setattr(DPOConfig, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="ActCompDPOTrainer runs in one process so far"):
        dpo_run(ActCompDPOTrainer, str(tmp_path), plan=PLAN)
