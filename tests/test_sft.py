"""TRL: `ActCompSFTTrainer` against plain `trl.SFTTrainer` on the unsplit model, through
recipes/sft.py in one process and on 2 processes (plain torchrun), with and without packing; and
in-process: conversational data with assistant-only loss, LoRA through peft_config, what is
refused, the missing extra, and another Trainer subclass composed the same way."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from scripts import NO_DROPOUT, ROOT, assert_same_run, run, run_side_by_side
from transformers import Trainer

from hf_actcomp import Compression, Plan
from hf_actcomp.debug import debug_model

pytest.importorskip("trl", reason="TRL is not installed: pip install 'hf-actcomp[trl]' (the dev extra has it)")

SFT = ["--bf16", "false", "--max_steps", "4", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
       "--logging_steps", "1", "--report_to", "none", "--seed", "0", "--save_strategy", "no", "--disable_tqdm", "true",
       "--learning_rate", "1e-3", "--max_length", "48", "--max_rows", "48", "--config_overrides", NO_DROPOUT,
       "--dataloader_drop_last", "true"]
SFT_CASES = {
    # packed (TRL's default strategy: padding-free rows), plain text
    "packed": ["--dataset_kind", "text", "--packing", "true"],
    # not packed: prompt-completion rows, the loss on the completion only
    "completion": ["--dataset_kind", "prompt_completion"],
}


SAVING = ["--save_strategy", "steps", "--save_steps", "2"]  # TRL writes its card at every checkpoint


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    for case, extra in SFT_CASES.items():
        run_side_by_side(("sft.py", root / case / "plain", [*SFT, *extra, "--plain"]),
                         ("sft.py", root / case / "one", [*SFT, *extra, *SAVING]))
        run("sft.py", root / case / "two", [*SFT, *extra, *SAVING], processes=2)
    # A new job on 2 processes resumes the 2-process run from its first checkpoint.
    run("sft.py", root / "completion" / "resumed",
        [*SFT, *SFT_CASES["completion"], "--resume_from_checkpoint", str(root / "completion" / "two" / "checkpoint-2")],
        processes=2)
    return root


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_script_matches_sfttrainer(sft_runs, case):
    """ActCompSFTTrainer in one process and on 2 (plain torchrun), saving a checkpoint every 2
    steps, logs SFTTrainer's losses and eval loss and ends with its weights, with and without
    packing."""
    for processes in ("one", "two"):
        assert_same_run(sft_runs / case / "plain", sft_runs / case / processes, metrics=("eval_loss",),
                        results="all_results.json")


def test_sft_checkpoints_carry_the_plan_and_card_and_resume_exactly(sft_runs):
    """SFTTrainer writes its model card at each checkpoint, before the model: here every
    checkpoint and the output folder get the plan and our card with TRL's tags, and a new
    2-process job resumed from step 2 logs the same losses and ends with the same weights as the
    run that never stopped (and as SFTTrainer's)."""
    import json

    case = sft_runs / "completion"
    for processes in ("one", "two"):
        for folder in (case / processes, case / processes / "checkpoint-2", case / processes / "checkpoint-4"):
            assert (folder / "actcomp_config.json").is_file(), folder
            card = (folder / "README.md").read_text()
            assert "hf-actcomp" in card and "- trl" in card and "- sft" in card, folder
        saved = json.loads((case / processes / "actcomp_results.json").read_text())["card"]
        assert saved["model_name"] == processes  # TRL names the card after the output folder
    assert_same_run(case / "two", case / "resumed", metrics=("eval_loss",), results="all_results.json")
    assert_same_run(case / "plain", case / "resumed", metrics=("eval_loss",), results="all_results.json")


# ----------------------------------------------------------------------------- in one process
def _sft_pieces():
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from sft import CHAT_TEMPLATE, offline_rows

    from hf_actcomp.data import build_tokenizer, offline_corpus

    tokenizer = build_tokenizer(offline_corpus()[:2000], vocab_size=512)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer, offline_rows


def _config(out, **overrides):
    from trl import SFTConfig

    kwargs = dict(output_dir=str(out), bf16=False, use_cpu=True, report_to=[], max_steps=3, per_device_train_batch_size=4,
                  logging_steps=1, learning_rate=1e-3, seed=0, save_strategy="no", disable_tqdm=True, max_length=48,
                  gradient_checkpointing=False)
    kwargs.update(overrides)
    return SFTConfig(**kwargs)


def test_conversations_with_assistant_only_loss_and_lora(tmp_path):
    """Messages through the chat template, the loss on the assistant's turns only, a LoRA
    adapter from peft_config: the same losses and adapter weights as SFTTrainer."""
    from peft import LoraConfig
    from trl import SFTTrainer

    import hf_actcomp

    tokenizer, offline_rows = _sft_pieces()
    data = offline_rows("conversational", 24)
    trainers = []
    for name, cls, extra in (("plain", SFTTrainer, {}), ("ours", hf_actcomp.ActCompSFTTrainer, {"plan": Plan(num_stages=2)})):
        model = debug_model("gpt2", seed=0, vocab_size=len(tokenizer))
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
        trainer = cls(model=model, args=_config(tmp_path / name, assistant_only_loss=True), train_dataset=data,
                      processing_class=tokenizer, peft_config=lora, **extra)
        trainer.train()
        trainers.append(trainer)
    plain, ours = trainers
    masked = ours.train_dataset[0]["labels"]
    assert -100 in masked and any(t != -100 for t in masked)  # the user's turn is not trained on
    assert [h["loss"] for h in ours.state.log_history if "loss" in h] == pytest.approx(
        [h["loss"] for h in plain.state.log_history if "loss" in h], rel=1e-5)
    reference = {n: p for n, p in plain.model.named_parameters() if p.requires_grad}
    trained = {n: p for n, p in ours.model.named_parameters() if p.requires_grad}
    assert trained.keys() == reference.keys() and any("lora_" in n for n in trained)
    for name, value in trained.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)


def test_aqsgd_with_prompt_completion_rows(tmp_path):
    """AQ-SGD keys its memory by the rows' sample ids, which TRL's collator does not carry: each
    training batch still has them, and the first epoch (every row's first visit, sent in full)
    logs the losses of the plan without a codec."""
    import hf_actcomp

    tokenizer, offline_rows = _sft_pieces()
    data = offline_rows("prompt_completion", 8)
    losses = {}
    for name, forward in (("none", Compression()), ("aqsgd", Compression("aqsgd", bits=2))):
        model = debug_model("gpt2", seed=0, vocab_size=len(tokenizer))
        trainer = hf_actcomp.ActCompSFTTrainer(
            model=model, args=_config(tmp_path / name, max_steps=2, learning_rate=1e-4), train_dataset=data,
            processing_class=tokenizer, plan=Plan(num_stages=2, micro_batches=2, forward=forward))
        if name == "aqsgd":
            batches = list(trainer.get_train_dataloader())
            assert sorted(int(i) for b in batches for i in b["sample_id"]) == list(range(8))
            assert {tuple(b["input_ids"].shape) for b in batches} == {(4, batches[0]["input_ids"].shape[1])}
        trainer.train()
        losses[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses["aqsgd"]) == 2
    assert losses["aqsgd"] == pytest.approx(losses["none"], rel=1e-5)


def test_refused_before_training(tmp_path):
    import hf_actcomp

    tokenizer, offline_rows = _sft_pieces()
    model = debug_model("gpt2", seed=0, vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match=r"does not support SFTConfig\(loss_type='dft'\).*use loss_type='nll'"):
        hf_actcomp.ActCompSFTTrainer(model=model, args=_config(tmp_path, loss_type="dft"), plan=Plan(num_stages=2),
                                     train_dataset=offline_rows("text", 16), processing_class=tokenizer)
    aqsgd = Plan(num_stages=2, forward=Compression("aqsgd", bits=4))
    with pytest.raises(ValueError, match="packing_strategy='wrapped'"):
        hf_actcomp.ActCompSFTTrainer(model=model, args=_config(tmp_path, packing=True), plan=aqsgd,
                                     train_dataset=offline_rows("text", 16), processing_class=tokenizer)


def test_model_by_name_takes_model_init_kwargs(tmp_path):
    """SFTConfig.model_init_kwargs apply to a model given by name: its dtype (float32 when unset,
    as SFTTrainer does); options a stage-by-stage load cannot apply are refused."""
    import hf_actcomp

    tokenizer, offline_rows = _sft_pieces()
    debug_model("gpt2", seed=0, vocab_size=len(tokenizer)).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    common = dict(plan=Plan(num_stages=2), train_dataset=offline_rows("text", 16), processing_class=tokenizer)
    for init, dtype in ((None, torch.float32), ({"dtype": "bfloat16"}, torch.bfloat16), ({"dtype": "auto"}, torch.bfloat16)):
        trainer = hf_actcomp.ActCompSFTTrainer(model=str(tmp_path / "model"),
                                               args=_config(tmp_path / "out", model_init_kwargs=init), **common)
        assert next(trainer.model.parameters()).dtype == dtype, init
    with pytest.raises(ValueError, match=r"takes only 'dtype' from SFTConfig.model_init_kwargs; got \['attn_implementation'\]"):
        hf_actcomp.ActCompSFTTrainer(model=str(tmp_path / "model"),
                                     args=_config(tmp_path / "out", model_init_kwargs={"attn_implementation": "eager"}),
                                     **common)


def test_without_trl_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.delitem(sys.modules, "hf_actcomp.trainer.sft_trainer", raising=False)
    import hf_actcomp

    with pytest.raises(ImportError, match=r"pip install 'hf-actcomp\[trl\]'"):
        hf_actcomp.ActCompSFTTrainer  # noqa: B018 - the lazy attribute imports TRL


class CountingTrainer(Trainer):
    """A user's own Trainer subclass: an argument of its own and a hook."""

    def __init__(self, *args, note: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.note, self.logged = note, []

    def log(self, logs, start_time=None) -> None:
        self.logged.append(dict(logs))
        super().log(logs, start_time)


def test_any_trainer_subclass_composes_the_same_way(tmp_path):
    """`class X(ActCompTrainer, CountingTrainer)`: the subclass keeps its argument and hook, and
    the run equals the subclass's own on the unsplit model."""
    from trainer_cases import pad_collator, ragged_dataset, training_args

    from hf_actcomp import ActCompTrainer

    class SplitCountingTrainer(ActCompTrainer, CountingTrainer):
        pass

    plain = CountingTrainer(model=debug_model("gpt2", seed=0), args=training_args(str(tmp_path / "plain")),
                            train_dataset=ragged_dataset(), data_collator=pad_collator, note="mine")
    ours = SplitCountingTrainer(model=debug_model("gpt2", seed=0), args=training_args(str(tmp_path / "ours")),
                                plan=Plan(num_stages=2), train_dataset=ragged_dataset(), data_collator=pad_collator,
                                note="mine")
    for trainer in (plain, ours):
        trainer.train()
    assert ours.note == "mine" and ours.sim is not None
    losses = [[h["loss"] for h in t.logged if "loss" in h] for t in (plain, ours)]
    assert len(losses[1]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert "comm/bytes_sent" in next(h for h in ours.logged if "loss" in h)
