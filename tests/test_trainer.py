"""ActCompTrainer against plain `transformers.Trainer` on the unsplit model: logged losses, gradient
norms and final weights (in-process, 2 processes, 2 x 2 with data parallel, LoRA), resume from a
checkpoint, AQ-SGD with dynamic padding, and what is refused before training."""

from __future__ import annotations

import glob
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from distributed import run_workers
from safetensors.torch import load_file
from trainer_cases import (
    doubled,
    extending_trainer,
    lora_model,
    pad_collator,
    ragged_dataset,
    training_args,
)
from transformers import Trainer, TrainingArguments

import hf_actcomp
from hf_actcomp import ActCompTrainer, Compression, MemoryConfig, Plan
from hf_actcomp.debug import debug_model
from hf_actcomp.trainer.actcomp_trainer import PadToLength, check_arguments
from hf_actcomp.trainer.backends import OneProcess, Pipelined
from hf_actcomp.trainer.checks import check_overrides


def _logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_loss" not in h]  # not the summary


def _reference(tmp_path, model, batch_size: int = 4, **overrides):
    """Plain Trainer on the unsplit model, with the same arguments and data."""
    trainer = Trainer(model=model, args=training_args(str(tmp_path / "reference"), batch_size=batch_size, **overrides),
                      train_dataset=ragged_dataset(), data_collator=pad_collator)
    trainer.train()
    return trainer


def _assert_same_run(reference, losses, grad_norms, weights: dict[str, torch.Tensor], model) -> None:
    assert losses == pytest.approx(_logged(reference, "loss"), rel=1e-6)
    assert grad_norms == pytest.approx(_logged(reference, "grad_norm"), rel=1e-5)
    for name, value in weights.items():
        torch.testing.assert_close(value, model.get_parameter(name).detach(), rtol=0, atol=1e-4, msg=name)


def test_in_process_matches_plain_trainer(tmp_path):
    """One process: the plan runs through simulate(); same losses, norms and weights as Trainer."""
    reference_model = debug_model("gpt2", seed=0)
    reference = _reference(tmp_path, reference_model)
    model = debug_model("gpt2", seed=0)
    trainer = ActCompTrainer(model=model, args=training_args(str(tmp_path / "ours")), plan=Plan(num_stages=2),
                             train_dataset=ragged_dataset(), eval_dataset=ragged_dataset(8, seed=1),
                             data_collator=pad_collator)
    assert trainer.sim is not None and trainer.pipe is None
    trainer.train()
    weights = {n: p.detach() for n, p in model.named_parameters()}
    _assert_same_run(reference, _logged(trainer, "loss"), _logged(trainer, "grad_norm"), weights, reference_model)
    assert trainer.state.total_flos == reference.state.total_flos  # parameters counted once, the same estimate

    # Every logging step carries the boundary bytes: identity codec, fp32, forward + backward of
    # every accumulation micro-step so far.
    loader = trainer.get_train_dataloader()
    shapes = [batch["input_ids"].shape for _, batch in zip(range(2), loader, strict=False)]
    first_step = sum(2 * rows * length * 64 * 4 for rows, length in shapes)
    first_log = trainer.state.log_history[0]
    assert first_log["comm/bytes_sent"] == first_step
    assert first_log["comm/compression_ratio"] == 1.0
    assert first_log["comm/boundary0.forward/relative_error"] == 0.0
    # per category: the activations and their gradients, half each (the same shapes, fp32)
    assert first_log["comm/activations/bytes_sent"] == first_log["comm/activation_gradients/bytes_sent"] == first_step // 2
    assert first_log["comm/activations/compression_ratio"] == 1.0

    # eval_loss is Trainer's own number (its batch mean over Trainer's token count); the mean per
    # predicted token and the perplexity stand beside it
    metrics = trainer.evaluate()
    expected = reference.evaluate(ragged_dataset(8, seed=1))
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
    assert metrics["eval_loss"] == pytest.approx(metrics["eval_plain_loss"], rel=1e-5)  # identity codec
    token_loss = _token_weighted_loss(reference_model, ragged_dataset(8, seed=1), batch_size=4)
    assert metrics["eval_token_loss"] == pytest.approx(token_loss, rel=1e-5)
    assert abs(metrics["eval_token_loss"] - metrics["eval_loss"]) > 0.01  # two different means
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_token_loss"]), rel=1e-6)


def test_logs_give_forward_and_backward_ratios_apart(tmp_path):
    """A plan's two directions compress differently; the logs say each one's bytes and ratio,
    and the categories add up to the total."""
    plan = Plan(num_stages=2, forward=Compression("quantize", bits=8), backward=Compression("quantize", bits=4))
    trainer = ActCompTrainer(model=debug_model("gpt2", seed=0), args=training_args(str(tmp_path / "ours")), plan=plan,
                             train_dataset=ragged_dataset(), data_collator=pad_collator)
    trainer.train()
    log = trainer.state.log_history[0]
    forward, backward = log["comm/activations/bytes_sent"], log["comm/activation_gradients/bytes_sent"]
    assert forward + backward == log["comm/bytes_sent"]
    half = log["comm/bytes_uncompressed"] / 2  # the same tensors' shapes both ways
    assert log["comm/activations/compression_ratio"] == pytest.approx(half / forward)
    assert log["comm/activation_gradients/compression_ratio"] == pytest.approx(half / backward)
    assert 3.5 < half / forward < 4.0 and 7.0 < half / backward < 8.0  # 8 and 4 bits of 32, plus scales


def test_backends_offer_the_same_methods():
    """ActCompTrainer calls its back-end without asking which it holds: both offer one interface."""
    def interface(cls):
        return {name for name in dir(cls) if not name.startswith("_")}

    assert interface(OneProcess) == interface(Pipelined)


def test_model_given_by_path_in_one_process(tmp_path):
    """One process loads a path whole (from_pretrained), in torch_dtype; torch_dtype with an
    in-memory model is refused."""
    debug_model("llama", seed=0).save_pretrained(tmp_path / "checkpoint")
    args = training_args(str(tmp_path / "ours"))
    trainer = ActCompTrainer(model=str(tmp_path / "checkpoint"), args=args, plan=Plan(num_stages=2),
                             torch_dtype=torch.bfloat16, train_dataset=ragged_dataset(), data_collator=pad_collator)
    assert type(trainer.model).__name__ == "LlamaForCausalLM" and trainer.sim is not None
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="torch_dtype applies when ActCompTrainer loads a checkpoint"):
        ActCompTrainer(model=debug_model("llama"), args=args, plan=Plan(num_stages=2), torch_dtype=torch.bfloat16)


def test_activation_checkpointing_in_process_is_exact(tmp_path):
    """TrainingArguments(activation_checkpointing=True): every block recomputes its activations in
    the backward (transformers' own checkpointing, inside each stage); same run as without."""
    reference_model = debug_model("llama", seed=0)
    reference = Trainer(model=reference_model, args=training_args(str(tmp_path / "reference")),
                        train_dataset=ragged_dataset(), data_collator=pad_collator)
    reference.train()
    model = debug_model("llama", seed=0)
    trainer = ActCompTrainer(model=model, args=training_args(str(tmp_path / "ours"), activation_checkpointing=True),
                             plan=Plan(num_stages=2), train_dataset=ragged_dataset(), data_collator=pad_collator)
    trainer.train()
    assert all(block.gradient_checkpointing for block in model.model.layers)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    _assert_same_run(reference, _logged(trainer, "loss"), _logged(trainer, "grad_norm"), weights, reference_model)


def test_stages_run_each_block_under_its_checkpoint():
    """The stages call the model's own blocks, so transformers' per-block checkpointing applies
    inside every stage: each block's checkpoint function runs once per micro-batch."""
    model = debug_model("llama", seed=0)
    model.activation_checkpointing_enable()
    calls = []
    for block in model.model.layers:
        inner = block._gradient_checkpointing_func
        block._gradient_checkpointing_func = lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k)
    sim = hf_actcomp.simulate(model, Plan(num_stages=2))
    sim(**pad_collator([ragged_dataset()[i] for i in range(4)])).loss.backward()
    assert len(calls) == len(model.model.layers) * 2  # 2 micro-batches
    assert all(p.grad is not None for p in model.parameters())


def test_aqsgd_with_dynamic_padding_and_save(tmp_path):
    """AQ-SGD: sample ids added, num_samples filled from the data, batches padded to one length;
    the codec's eval loss and the plain one are both reported; save_model writes a loadable model."""
    plan = Plan(num_stages=2, forward=Compression("aqsgd", bits=4), backward=Compression("quantize", bits=8))
    model = debug_model("gpt2", seed=0)
    trainer = ActCompTrainer(model=model, args=training_args(str(tmp_path), max_steps=6), plan=plan,
                             train_dataset=ragged_dataset(), eval_dataset=ragged_dataset(8, seed=1),
                             data_collator=pad_collator)
    assert plan.memory.num_samples is None and trainer.plan.memory.num_samples == 32
    assert "sample_id" in trainer.train_dataset.column_names
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[1] == 12 and "sample_id" in batch
    trainer.train()
    losses = _logged(trainer, "loss")
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert trainer.state.log_history[-2]["comm/compression_ratio"] > 1.5  # revisited samples send 4-bit deltas
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_perplexity", "eval_plain_loss", "eval_plain_perplexity"} <= set(metrics)
    assert metrics["eval_loss"] != metrics["eval_plain_loss"]  # direct 4-bit at inference
    trainer.save_model(str(tmp_path / "final"))
    assert Plan.from_pretrained(str(tmp_path / "final")) == trainer.plan
    reloaded = type(model).from_pretrained(str(tmp_path / "final"))
    for name, p in model.named_parameters():
        torch.testing.assert_close(reloaded.get_parameter(name), p.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("forward", [
    Compression("aqsgd", bits=4),
    # A stochastic warm-up codec: steps 3-4 still visit samples first, with its counter restored.
    Compression("aqsgd", bits=2, first_visit=Compression("quantize", bits=4, rounding="stochastic", seed=1)),
], ids=["full", "warm-up"])
def test_in_process_resume_continues_exactly(tmp_path, forward):
    """One process, AQ-SGD: 6 steps straight == 2 steps, checkpoint, a new trainer, resume, 4 more
    (steps 5-6 revisit samples: the memory comes back from actcomp_state/)."""
    plan = Plan(num_stages=2, forward=forward, backward=Compression("quantize", bits=8))

    def run(name, resume=None):
        model = debug_model("gpt2", seed=0)
        args = training_args(str(tmp_path / name), max_steps=6, save_strategy="steps", save_steps=2)
        trainer = ActCompTrainer(model=model, args=args, plan=plan, train_dataset=ragged_dataset(),
                                 data_collator=pad_collator)
        trainer.train(resume_from_checkpoint=resume)
        return _logged(trainer, "loss"), {n: p.detach() for n, p in model.named_parameters()}

    losses, weights = run("straight")
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    assert (checkpoint / "actcomp_state" / "rank0.safetensors").is_file()
    resumed_losses, resumed_weights = run("resumed", str(checkpoint))
    assert resumed_losses == losses
    for name, value in weights.items():
        torch.testing.assert_close(resumed_weights[name], value, rtol=0, atol=0, msg=name)


def test_auto_resume_skips_a_torn_checkpoint_and_continues_exactly(tmp_path, caplog):
    """Checkpoints are marked complete; `train(resume_from_checkpoint="auto")` takes the newest
    complete one (here checkpoint-2: checkpoint-4 lost its marker, as a kill mid-write leaves it)
    and ends with the uninterrupted run's weights."""
    import shutil

    plan = Plan(num_stages=2, forward=Compression("aqsgd", bits=4), backward=Compression("quantize", bits=8))

    def trainer_for(name):
        model = debug_model("gpt2", seed=0)
        args = training_args(str(tmp_path / name), max_steps=6, save_strategy="steps", save_steps=2)
        return model, ActCompTrainer(model=model, args=args, plan=plan, train_dataset=ragged_dataset(),
                                     data_collator=pad_collator)

    model, trainer = trainer_for("straight")
    trainer.train()
    assert all((tmp_path / "straight" / f"checkpoint-{s}" / "actcomp_complete.json").is_file() for s in (2, 4, 6))
    for step in (2, 4):
        shutil.copytree(tmp_path / "straight" / f"checkpoint-{step}", tmp_path / "killed" / f"checkpoint-{step}")
    os.remove(tmp_path / "killed" / "checkpoint-4" / "actcomp_complete.json")
    resumed_model, resumed = trainer_for("killed")
    with caplog.at_level("WARNING", logger="hf_actcomp.state.resume"):
        resumed.train(resume_from_checkpoint="auto")
    assert "Skipping the incomplete checkpoint" in caplog.text and "checkpoint-4" in caplog.text
    assert f"resuming from {tmp_path / 'killed' / 'checkpoint-2'}" in caplog.text
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)


def test_pad_to_length_changes_no_loss_or_gradient():
    model = debug_model("llama", seed=0)
    rows = [ragged_dataset()[i] for i in range(4)]
    short = pad_collator(rows)
    padded = PadToLength(pad_collator, 16, pad_token_id=0)(rows)
    assert padded["input_ids"].shape == (4, 16) and (padded["labels"][:, 12:] == -100).all()
    grads = []
    for batch in (short, padded):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="longer than pad_to_length=8"):
        PadToLength(pad_collator, 8, pad_token_id=0)(rows)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("deepspeed", "ds.json", "deepspeed=.*DeepSpeed shards"),
        ("fsdp", "full_shard", "fsdp=.*FSDP shards"),
        ("fp16", True, "fp16 needs a loss scaler"),
        ("label_smoothing_factor", 0.1, "label_smoothing_factor"),
        ("use_liger_kernel", True, "use_liger_kernel=.*replace the whole model's forward"),
        ("fp16_full_eval", True, "fp16_full_eval=.*loss scaler"),
        ("parallelism_config", object(), "parallelism_config=.*spans all ranks"),
        ("train_sampling_strategy", "batch_rebalance", "batch_rebalance.*must read the same batches"),
        ("world_size", 3, "needs 2 processes \\(or 1, to run the stages in-process\\), but this job has 3"),
    ],
)
def test_refused_before_training(name, value, message):
    args = SimpleNamespace(deepspeed=None, fsdp=None, fp16=False, torch_compile=False, gradient_checkpointing=False,
                           label_smoothing_factor=0.0, world_size=1, report_to=[], push_to_hub=False)
    setattr(args, name, value)
    with pytest.raises(ValueError, match=message):
        check_arguments(args, Plan(num_stages=2), {})


def test_refuses_optimizer_from_outside_with_several_processes():
    args = SimpleNamespace(deepspeed=None, fsdp=None, fp16=False, torch_compile=False, gradient_checkpointing=False,
                           label_smoothing_factor=0.0, world_size=2, report_to=[], push_to_hub=False)
    with pytest.raises(ValueError, match="does not take optimizers="):
        check_arguments(args, Plan(num_stages=2), {"optimizers": (torch.optim.SGD([torch.zeros(1)], lr=1), None)})


def test_refused_with_several_processes():
    """Settings that would deal one batch out over the stages, or leave zbh1 nothing to defer."""
    def args(**overrides):
        return SimpleNamespace(**{**dict(deepspeed=None, fsdp=None, fp16=False, torch_compile=False,
                                         label_smoothing_factor=0.0, world_size=2, report_to=[], push_to_hub=False,
                                         accelerator_config=SimpleNamespace(dispatch_batches=None)), **overrides})

    with pytest.raises(ValueError, match="dispatch_batches=True: it deals one batch's slices"):
        check_arguments(args(accelerator_config=SimpleNamespace(dispatch_batches=True)), Plan(num_stages=2), {})
    with pytest.raises(ValueError, match=r"torch_compile=True\)\) with Plan\(schedule='zbh1'\)"):
        check_arguments(args(torch_compile=True), Plan(num_stages=2, schedule="zbh1"), {})
    for name, value, message in (("auto_find_batch_size", True, "shrink one stage's batch alone"),
                                 ("bf16_full_eval", True, "boundary's dtype is fixed"),
                                 ("enable_jit_checkpoint", True, "at a different step"),
                                 ("ddp_bucket_cap_mb", 25, "never wraps a stage in DDP"),
                                 ("ddp_find_unused_parameters", False, "never wraps a stage in DDP")):
        with pytest.raises(ValueError, match=f"several processes does not support TrainingArguments\\({name}=.*{message}"):
            check_arguments(args(**{name: value}), Plan(num_stages=2), {})
        check_arguments(args(**{name: value}, world_size=1), Plan(num_stages=2), {})  # Trainer's in one process
    check_arguments(args(torch_compile=True), Plan(num_stages=2), {})  # 1f1b compiles
    check_arguments(args(torch_compile=True, world_size=1), Plan(num_stages=2, schedule="zbh1"), {})  # in-process


def test_evaluation_without_the_second_pass(tmp_path):
    """eval_plain_loss=False: one forward per batch (the model itself is never called), the same
    eval_loss and token loss, no plain metrics."""
    def trainer(name, **kwargs):
        return ActCompTrainer(model=debug_model("gpt2", seed=0), args=training_args(str(tmp_path / name)),
                              plan=Plan(num_stages=2, forward=Compression("quantize", bits=4)),
                              eval_dataset=ragged_dataset(8, seed=1), data_collator=pad_collator, **kwargs)

    both = trainer("both").evaluate()
    one = trainer("one", eval_plain_loss=False)
    calls = []
    one.model.register_forward_hook(lambda *args: calls.append(1))
    metrics = one.evaluate()
    assert calls == [] and "eval_plain_loss" not in metrics and "eval_plain_perplexity" not in metrics
    assert both["eval_plain_loss"] != both["eval_loss"]  # the codec costs something: two passes
    for key in ("eval_loss", "eval_token_loss", "eval_perplexity"):
        assert metrics[key] == pytest.approx(both[key], rel=1e-6), key


def test_every_trainer_and_sft_field_is_in_the_docs_table():
    """docs/trainer.md says, for each TrainingArguments and SFTConfig field, whether it is
    honoured or refused: a field a new transformers or TRL release adds fails here until it is."""
    import dataclasses
    import re

    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "trainer.md"), encoding="utf-8").read()
    table = text[text.index("## Every argument: honoured or refused"):text.index("## Limits")]
    named = set(re.findall(r"`(\w+)`", table))
    fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    trl = pytest.importorskip("trl")
    fields |= {f.name for f in dataclasses.fields(trl.SFTConfig) if f.init}
    assert sorted(fields - named) == []


def test_dataloaders_take_every_dataloader_setting(tmp_path):
    """The dataloader_* settings reach both loaders as Trainer passes them, and with persistent
    workers the evaluation loader is kept for the next evaluation (no worker is started here)."""
    trainer = ActCompTrainer(model=debug_model("gpt2", seed=0), plan=Plan(num_stages=2),
                             args=training_args(str(tmp_path), dataloader_num_workers=1,
                                                dataloader_persistent_workers=True, dataloader_prefetch_factor=3,
                                                dataloader_multiprocessing_context="spawn", dataloader_in_order=False),
                             train_dataset=ragged_dataset(), eval_dataset=ragged_dataset(8, seed=1),
                             data_collator=pad_collator)
    evaluation = trainer.get_eval_dataloader()
    assert trainer.get_eval_dataloader() is evaluation
    for loader in (evaluation, trainer.get_train_dataloader()):
        assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor, loader.in_order) == (1, True, 3,
                                                                                                          False)
        assert type(loader.multiprocessing_context).__name__ == "SpawnContext"


def test_pipelined_evaluation_hands_every_batch_key_to_the_stages():
    """Evaluation with several processes passes the batch as training does, every key, so a key
    the stages cannot take fails there with training's error instead of being dropped."""
    from hf_actcomp.batching import check_batch
    from hf_actcomp.trainer.evaluation import pipelined_prediction_step

    seen = []
    pipe = SimpleNamespace(eval_step=lambda batch, **kwargs: seen.append(sorted(batch)) or SimpleNamespace(loss=None),
                           is_last=True)
    trainer = SimpleNamespace(_prepare_inputs=lambda inputs: inputs, eval_item_count=lambda inputs: None,
                              label_names=["labels"], eval_plain_loss=False)
    batch = pad_collator([ragged_dataset()[i] for i in range(2)])
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    pipelined_prediction_step(trainer, pipe, batch, prediction_loss_only=True, preprocess=None)
    assert seen == [["attention_mask", "input_ids", "labels", "token_type_ids"]]
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    with pytest.raises(ValueError, match=r"got keys \['attention_mask', 'input_ids', 'labels', 'position_ids', 'token_type_ids'\]"):
        check_batch(batch, Plan(num_stages=2), training=False)


def test_neftune_noise_reaches_the_first_stage(tmp_path):
    """neftune_noise_alpha: Trainer's hook on the input embeddings fires inside the stages (the
    losses move), and Trainer removes it after training (evaluation is noiseless again)."""
    def run(**overrides):
        trainer = ActCompTrainer(model=debug_model("gpt2", seed=0), plan=Plan(num_stages=2),
                                 args=training_args(str(tmp_path / str(len(overrides))), max_steps=1, **overrides),
                                 train_dataset=ragged_dataset(), data_collator=pad_collator)
        trainer.train()
        return _logged(trainer, "loss")[0], trainer

    plain, _ = run()
    noisy, trainer = run(neftune_noise_alpha=50.0)
    assert noisy != pytest.approx(plain, rel=1e-4)
    assert not trainer.model.get_input_embeddings()._forward_hooks


def test_plan_must_be_a_plan(tmp_path):
    with pytest.raises(TypeError, match="plan must be a hf_actcomp.Plan"):
        ActCompTrainer(model=debug_model("gpt2"), args=TrainingArguments(str(tmp_path), use_cpu=True), plan={})


def test_data_parallel_aqsgd_needs_ids_that_are_rows(tmp_path):
    """Each replica keeps AQ-SGD memory for its contiguous shard of rows: refused before any work
    when sample ids are not the row indices, or num_samples is not the data set's length."""
    plan = Plan(num_stages=2, data_parallel=2, forward=Compression("aqsgd", bits=4))
    args = training_args(str(tmp_path))
    shuffled = ragged_dataset().add_column("sample_id", list(reversed(range(32))))
    with pytest.raises(ValueError, match=r"needs sample_id == row index \(row 0 has sample_id 31\)"):
        ActCompTrainer(model=debug_model("gpt2"), args=args, plan=plan, train_dataset=shuffled)
    larger = Plan(num_stages=2, data_parallel=2, forward=Compression("aqsgd", bits=4),
                  memory=MemoryConfig(num_samples=40))
    with pytest.raises(ValueError, match="shards memory.num_samples=40 like the 32 rows of train_dataset"):
        ActCompTrainer(model=debug_model("gpt2"), args=args, plan=larger, train_dataset=ragged_dataset())


# ----------------------------------------------------------------------------- several processes
# Every launch costs seconds of interpreter and library start-up per process, so the runs that
# need no launch of their own share one per world size (module fixtures), one after another.
@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_processes")
    debug_model("gpt2", seed=0).save_pretrained(root / "checkpoint")
    runs = {
        # with every block recomputed in the backward, and the model given as a path
        "plain": {"plan": {"num_stages": 2}, "evaluate": True, "args": {"activation_checkpointing": True},
                  "model_path": str(root / "checkpoint")},
        "lora": {"plan": {"num_stages": 2}, "lora": True, "save": str(root / "adapter")},
        "bf16_lora": {"plan": {"num_stages": 2}, "lora": True, "dtype": "bfloat16", "args": {"bf16": True}},
        # Plan.auto under Trainer: measured at the first step, saved with the model
        "auto": {"plan": Plan.auto(num_stages=2, micro_batches=2).to_dict(), "save": str(root / "auto")},
        # zero-bubble H1 under Trainer, with every block recomputed in the backward
        "zbh1": {"plan": {"num_stages": 2, "schedule": "zbh1"}, "args": {"activation_checkpointing": True}},
        # a user's subclass extending training_step, prediction_step, evaluation_loop and log
        "subclass": {"plan": {"num_stages": 2}, "subclass": True, "evaluate": True,
                     "args": {"include_num_input_tokens_seen": "non_padding"}},
        # a model that takes no loss kwargs: Trainer passes no num_items_in_batch
        "model_mean": {"plan": {"num_stages": 2}, "model_mean": True},
        # the user's loss set on the model, which replaces a compute_loss override
        "double_loss": {"plan": {"num_stages": 2}, "double_loss": True, "args": {"max_steps": 1}},
        # push_to_hub under torchrun: every stage saved, one upload with our card
        "push": {"plan": {"num_stages": 2}, "push": True,
                 "args": {"push_to_hub": True, "hub_model_id": "user/piped", "save_strategy": "steps",
                          "save_steps": 2}},
        # a sequence classifier: its loss is each call's mean, as the model's own forward
        "classifier": {"plan": {"num_stages": 2}, "family": "llama", "task": "sequence_classification",
                       "evaluate": True},
        # DeBERTa-v2: the relative-position embeddings on both stages (their gradients summed over
        # the stages at each accumulation step, counted once in the clip norm, the copies kept equal)
        "deberta": {"plan": {"num_stages": 2}, "family": "deberta-v2", "task": "sequence_classification",
                    "evaluate": True, "config": {"hidden_dropout_prob": 0.0}},
        # Trainer's evaluation contract: compute_metrics on what include_for_metrics adds, predict()
        "predict": {"plan": {"num_stages": 2}, "predict": True,
                    "args": {"include_for_metrics": ["inputs", "loss"], "eval_accumulation_steps": 1,
                             "metric_for_best_model": "mean_prediction"}},
    }
    run_workers("trainer_worker.py", 2, [json.dumps({"runs": runs}), str(root)], timeout=600)
    return root


# Trainer's two ways with a classifier under DDP: by default it multiplies the classifier's mean by
# the number of processes (it takes any model with **kwargs to divide by the global item count).
CLASSIFIER_DDP_ARGS = {"": {}, "_own_tokens": {"average_tokens_across_devices": False}}


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    root = tmp_path_factory.mktemp("four_processes")
    runs = {
        "plain": {"plan": {"num_stages": 2, "data_parallel": 2}, "evaluate": True},
        "zbh1": {"plan": {"num_stages": 2, "data_parallel": 2, "schedule": "zbh1"}},
        "aqsgd": {"plan": Plan(num_stages=2, data_parallel=2, forward=Compression("aqsgd", bits=4)).to_dict(),
                  "args": {"max_steps": 4}},
        # each replica normalises by its own tokens, as DDP does with this setting
        "own_tokens": {"plan": {"num_stages": 2, "data_parallel": 2}, "args": {"average_tokens_across_devices": False}},
        # sequence classifiers: each replica's mean, as under DDP (times the replicas by default, as Trainer)
        **{f"classifier{suffix}": {"plan": {"num_stages": 2, "data_parallel": 2}, "family": "llama",
                                   "task": "sequence_classification", "evaluate": True, "args": args}
           for suffix, args in CLASSIFIER_DDP_ARGS.items()},
    }
    run_workers("trainer_worker.py", 4, [json.dumps({"runs": runs}), str(root)], timeout=600)
    return root


def _results(root, name: str, world: int) -> tuple[str, list[dict]]:
    out = root / name
    return str(out), [json.loads((out / f"losses-rank{r}.json").read_text()) for r in range(world)]


def _run(tmp_path, name: str, world: int, spec: dict) -> tuple[str, list[dict]]:
    out = tmp_path / name
    out.mkdir()
    run_workers("trainer_worker.py", world, [json.dumps(spec), str(out)], timeout=300)
    results = [json.loads((out / f"losses-rank{r}.json").read_text()) for r in range(world)]
    return str(out), results


def _stage_weights(out: str, world: int, num_stages: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's stage parameters, without the first stage's copy of a tied embedding (the
    last stage owns it; the copy holds only the rows of the latest batch)."""
    parts = []
    for rank in range(world):
        weights = load_file(os.path.join(out, f"weights-rank{rank}.safetensors"))
        if rank % num_stages == 0 and num_stages > 1:
            weights.pop("transformer.wte.weight", None)
        parts.append(weights)
    return parts


@pytest.mark.parametrize("data_parallel", [1, 2], ids=["2-stages", "2x2-data-parallel"])
def test_distributed_zbh1_matches_plain_trainer(tmp_path, request, data_parallel):
    """Plan(schedule="zbh1") under ActCompTrainer, codec none (2 stages with activation
    checkpointing; 2 x 2 with data parallel): plain Trainer's losses, norms and final weights."""
    world = 2 * data_parallel
    root = request.getfixturevalue("two_processes" if data_parallel == 1 else "four_processes")
    reference_model = debug_model("gpt2", seed=0)
    reference = _reference(tmp_path, reference_model, batch_size=4 * data_parallel)
    out, results = _results(root, "zbh1", world)
    for rank, result in enumerate(results):
        norms = [h["grad_norm"] for h in result["logs"]]
        _assert_same_run(reference, result["losses"], norms, _stage_weights(out, world, 2)[rank], reference_model)


@pytest.mark.parametrize("data_parallel", [1, 2], ids=["2-stages", "2x2-data-parallel"])
def test_distributed_matches_plain_trainer(tmp_path, request, data_parallel):
    """Codec none on 2 (or 2 x 2) processes: the logged losses and norms, and every stage's final
    weights, equal plain Trainer's on the unsplit model with the replicas' global batch (2 stages:
    with activation checkpointing on, and the model given as a checkpoint path: each rank loads
    only its stage)."""
    world = 2 * data_parallel
    root = request.getfixturevalue("two_processes" if data_parallel == 1 else "four_processes")
    reference_model = debug_model("gpt2", seed=0)
    reference = _reference(tmp_path, reference_model, batch_size=4 * data_parallel)
    out, results = _results(root, "plain", world)
    if data_parallel == 1:  # the other stage's blocks were never loaded
        assert all(result["meta_parameters"] > 0 for result in results)
    expected_eval = reference.evaluate(ragged_dataset(8, seed=1))["eval_loss"]  # Trainer's own number
    token_loss = _token_weighted_loss(reference_model, ragged_dataset(8, seed=1), batch_size=4)
    for rank, result in enumerate(results):
        norms = [h["grad_norm"] for h in result["logs"]]
        _assert_same_run(reference, result["losses"], norms, _stage_weights(out, world, 2)[rank], reference_model)
        assert result["metrics"]["eval_loss"] == pytest.approx(expected_eval, rel=1e-5)
        assert result["metrics"]["eval_plain_loss"] == pytest.approx(expected_eval, rel=1e-5)  # identity codec
        assert result["metrics"]["eval_token_loss"] == pytest.approx(token_loss, rel=1e-5)
        if data_parallel == 1:  # replicas pad their own half-batches, so their token counts differ
            # Trainer sums the ranks' flop estimates: each rank counts its stage's share, once.
            assert result["total_flos"] == pytest.approx(reference.state.total_flos, rel=1e-9)


def test_subclass_extending_trainer_runs_alike_on_every_process_count(tmp_path, two_processes):
    """A subclass overriding training_step, prediction_step, evaluation_loop and log, each through
    super(), has the same effect in one process and on 2: the logged losses and the eval loss
    doubled, its metric added, every training log seen (on every rank); the weights and
    the input tokens seen are plain Trainer's."""
    reference_model = debug_model("gpt2", seed=0)
    reference = _reference(tmp_path, reference_model, include_num_input_tokens_seen="non_padding")
    expected_eval = reference.evaluate(ragged_dataset(8, seed=1))["eval_loss"]
    model = debug_model("gpt2", seed=0)
    trainer = extending_trainer()(
        model=model, args=training_args(str(tmp_path / "one"), include_num_input_tokens_seen="non_padding"),
        plan=Plan(num_stages=2), train_dataset=ragged_dataset(), eval_dataset=ragged_dataset(8, seed=1),
        data_collator=pad_collator)
    trainer.train()
    runs = [(_logged(trainer, "loss"), trainer.evaluate(), trainer.state.num_input_tokens_seen, trainer.seen_logs,
             {n: p.detach() for n, p in model.named_parameters()})]
    out, results = _results(two_processes, "subclass", 2)
    for rank, result in enumerate(results):
        runs.append((result["losses"], result["metrics"], result["tokens_seen"], result["seen_logs"],
                     _stage_weights(out, 2, 2)[rank]))
    for losses, metrics, tokens_seen, logs, weights in runs:
        assert losses == pytest.approx([2 * x for x in _logged(reference, "loss")], rel=1e-6)
        assert metrics["eval_loss"] == pytest.approx(2 * expected_eval, rel=1e-5)
        assert metrics["eval_extended"] == 1.0
        assert tokens_seen == reference.state.num_input_tokens_seen  # not once per stage
        assert [log["loss"] for log in logs if "loss" in log] == pytest.approx(losses)  # every training log
        for name, value in weights.items():
            torch.testing.assert_close(value, reference_model.get_parameter(name).detach(), rtol=0, atol=1e-4, msg=name)


def test_distributed_model_taking_its_own_mean_matches_plain_trainer(tmp_path, two_processes):
    """A model that takes no loss kwargs: Trainer passes no num_items_in_batch and divides each
    batch's mean by the accumulation steps; 2 processes give the same losses, norms, weights."""
    reference_model = debug_model("gpt2", seed=0)
    reference_model.accepts_loss_kwargs = False
    reference = _reference(tmp_path, reference_model)
    assert reference.model_accepts_loss_kwargs is False
    out, results = _results(two_processes, "model_mean", 2)
    for rank, result in enumerate(results):
        norms = [h["grad_norm"] for h in result["logs"]]
        _assert_same_run(reference, result["losses"], norms, _stage_weights(out, 2, 2)[rank], reference_model)


class _DoublingLoss(ActCompTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class _ReplacingStep(ActCompTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        return torch.zeros(())


def test_overrides_the_stages_would_bypass_are_refused_with_several_processes(tmp_path, monkeypatch):
    """With several processes a compute_loss override, or a step override that never calls the
    parent's, stops construction naming the method and what to do; in one process compute_loss
    is honoured as Trainer honours it."""
    with pytest.raises(ValueError, match=r"_DoublingLoss.compute_loss would be bypassed.*model.loss_function"):
        check_overrides(_DoublingLoss, pipelined=True)
    with pytest.raises(ValueError, match=r"_ReplacingStep.training_step does not call super\(\).training_step"):
        check_overrides(_ReplacingStep, pipelined=True)
    check_overrides(extending_trainer(), pipelined=True)  # every override calls super()
    # Construction itself refuses, before any process group or model work.
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="compute_loss would be bypassed"):
        _DoublingLoss(model=debug_model("gpt2"), args=training_args(str(tmp_path / "two")), plan=Plan(num_stages=2))
    monkeypatch.undo()
    reference = _reference(tmp_path, debug_model("gpt2", seed=0))
    trainer = _DoublingLoss(model=debug_model("gpt2", seed=0), args=training_args(str(tmp_path / "one"), max_steps=1),
                            plan=Plan(num_stages=2), train_dataset=ragged_dataset(), data_collator=pad_collator)
    trainer.train()
    assert _logged(trainer, "loss")[0] == pytest.approx(2 * _logged(reference, "loss")[0], rel=1e-6)


def test_a_loss_set_on_the_model_runs_on_every_process_count(tmp_path, two_processes):
    """What the refusal of compute_loss points to: `model.loss_function = fn` is what the stages
    call, in one process and on 2 (here the model's own loss, doubled)."""
    reference = _reference(tmp_path, debug_model("gpt2", seed=0))
    model = debug_model("gpt2", seed=0)
    model.loss_function = doubled(model.loss_function)
    trainer = ActCompTrainer(model=model, args=training_args(str(tmp_path / "one"), max_steps=1),
                             plan=Plan(num_stages=2), train_dataset=ragged_dataset(), data_collator=pad_collator)
    trainer.train()
    _, results = _results(two_processes, "double_loss", 2)
    expected = 2 * _logged(reference, "loss")[0]
    for first in (_logged(trainer, "loss")[0], *(r["losses"][0] for r in results)):
        assert first == pytest.approx(expected, rel=1e-6)


def test_distributed_tokens_per_replica_match_trainer_under_ddp(tmp_path, four_processes):
    """average_tokens_across_devices=False on 2 stages x 2 replicas: each replica divides by its
    own label tokens and the gradients are averaged, as plain Trainer under DDP on 2 processes
    (same data shards): the same losses, norms and final weights, which differ from the default's."""
    reference, ddp = _run(tmp_path, "ddp", 2, {"plain": True, "args": {"average_tokens_across_devices": False}})
    expected = load_file(os.path.join(reference, "weights-rank0.safetensors"))
    out, results = _results(four_processes, "own_tokens", 4)
    _, default = _results(four_processes, "plain", 4)
    assert results[0]["losses"] != pytest.approx(default[0]["losses"], rel=1e-6)  # the setting matters here
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-6)
        assert [h["grad_norm"] for h in result["logs"]] == pytest.approx([h["grad_norm"] for h in ddp[0]["logs"]],
                                                                          rel=1e-5)
        for name, value in _stage_weights(out, 4, 2)[rank].items():
            tied = "transformer.wte.weight" if name == "lm_head.weight" else name  # saved once by the whole model
            torch.testing.assert_close(value, expected[tied], rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("suffix", list(CLASSIFIER_DDP_ARGS), ids=["default", "own-tokens"])
def test_distributed_classifier_with_replicas_matches_trainer_under_ddp(tmp_path, four_processes, suffix):
    """A Llama sequence classifier on 2 stages x 2 replicas logs the losses and gradient norms of
    plain Trainer under DDP on 2 processes (the same data shards), ends with its weights and
    evaluates to its loss; with Trainer's default (`average_tokens_across_devices`) those losses
    are twice the replicas' mean, as Trainer's own, and the setting changes the run."""
    args = CLASSIFIER_DDP_ARGS[suffix]
    reference, ddp = _run(tmp_path, "ddp", 2, {"plain": True, "family": "llama", "task": "sequence_classification",
                                                "evaluate": True, "args": args})
    expected = load_file(os.path.join(reference, "weights-rank0.safetensors"))
    out, results = _results(four_processes, f"classifier{suffix}", 4)
    _, other = _results(four_processes, "classifier" if suffix else "classifier_own_tokens", 4)
    assert results[0]["losses"] != pytest.approx(other[0]["losses"], rel=1e-3)  # the setting matters
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-6)
        assert [h["grad_norm"] for h in result["logs"]] == pytest.approx([h["grad_norm"] for h in ddp[0]["logs"]],
                                                                          rel=1e-5)
        assert result["metrics"]["eval_loss"] == pytest.approx(ddp[0]["metrics"]["eval_loss"], rel=1e-5)
        for name, value in _stage_weights(out, 4, 2)[rank].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-4, msg=name)


def test_distributed_push_to_hub_uploads_once_with_every_stage(two_processes):
    """push_to_hub=True on 2 processes (checkpoints every 2 steps, each pushed, then
    Trainer.push_to_hub with card arguments): rank 0 creates the repo and uploads; every upload
    holds the plan and our card, the final one both stages' shards and the card's arguments; rank
    1 never talks to the Hub."""
    uploads = [json.loads((two_processes / "push" / f"uploads-rank{r}.json").read_text()) for r in range(2)]
    assert uploads[1] == []
    assert uploads[0][0] == {"call": "create_repo", "repo_id": "user/piped"}
    # Trainer's pushes at the checkpoints (steps 2 and 4) carry the plan and our card too
    checkpoints = uploads[0][1:-1]
    assert len(checkpoints) == 2 and all({"actcomp_config.json", "README.md"} <= set(u["files"]) and
                                         "hf-actcomp" in u["card"] for u in checkpoints)
    final = uploads[0][-1]
    assert final["call"] == "upload_folder" and final["repo_id"] == "user/piped"
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
            "actcomp_config.json", "actcomp_results.json", "README.md"} <= set(final["files"])
    assert "hf-actcomp" in final["card"] and "language: en" in final["card"] and "- pushed" in final["card"]
    assert 'from_pretrained("user/piped")' in final["card"]


def test_distributed_plan_auto_is_measured_and_saved(two_processes):
    """ActCompTrainer with Plan.auto on 2 processes: both ranks trained under the same chosen
    codecs, and the saved plan and card hold the decision."""
    out, results = _results(two_processes, "auto", 2)
    assert all(r["losses"] and all(math.isfinite(x) for x in r["losses"]) for r in results)
    saved = Plan.from_pretrained(two_processes / "auto")
    assert saved.autotune is not None and saved.autotune.decision is not None
    assert saved.boundaries is not None and len(saved.boundaries) == 1
    chosen = saved.autotune.decision["boundaries"][0]["forward"]["codec"]
    assert saved.forward_at(0).describe() == chosen
    card = (two_processes / "auto" / "README.md").read_text()
    assert "codecs chosen by | `Plan.auto` (quality safe) from measured links (boundary 0:" in card


def _token_weighted_loss(model, dataset, batch_size: int) -> float:
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            batch = pad_collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += model(**batch).loss.item() * n
            tokens += n
    return total / tokens


def test_distributed_lora_matches_and_saves_adapter(tmp_path, two_processes):
    """LoRA through the stages: same run as Trainer on the unsplit PEFT model; the adapter saved
    from both stages reloads with PeftModel.from_pretrained and gives the same logits."""
    from peft import PeftModel

    reference_model = lora_model(debug_model("gpt2", seed=0))
    reference = _reference(tmp_path, reference_model)
    saved = str(two_processes / "adapter")
    out, results = _results(two_processes, "lora", 2)
    base = reference_model.get_base_model()
    for rank, result in enumerate(results):
        weights = _stage_weights(out, 2, 2)[rank]
        trained = {n: w for n, w in weights.items() if "lora_" in n}
        assert trained, "every stage holds LoRA weights"
        norms = [h["grad_norm"] for h in result["logs"]]
        _assert_same_run(reference, result["losses"], norms, trained, base)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(saved))
    assert "model.safetensors" not in os.listdir(saved)
    reloaded = PeftModel.from_pretrained(debug_model("gpt2", seed=0), saved)
    batch = pad_collator([ragged_dataset()[i] for i in range(4)])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, reference_model(**batch).logits, rtol=0, atol=1e-4)


def test_distributed_resume_continues_exactly(tmp_path):
    """AQ-SGD fw4/bw8, AdamW, accumulation 2: 6 steps straight == 2 or 4 steps, checkpoint, new
    processes, resume, the rest (steps 5-6 revisit samples: the AQ-SGD memory must come back).
    With evaluation every 2 steps, save_total_limit=2 and load_best_model_at_end."""
    plan = Plan(num_stages=2, forward=Compression("aqsgd", bits=4), backward=Compression("quantize", bits=8))
    args = {"max_steps": 6, "save_strategy": "steps", "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2,
            "save_total_limit": 2, "load_best_model_at_end": True}
    straight, full = _run(tmp_path, "straight", 2, {"plan": plan.to_dict(), "args": args})
    run_dir = os.path.join(straight, "run")
    state = json.loads(open(os.path.join(run_dir, "checkpoint-6", "trainer_state.json")).read())
    best = state["best_model_checkpoint"]
    kept = sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint-"))
    assert len(kept) == 2 and os.path.basename(best) in kept and "checkpoint-6" in kept  # limit 2, best kept
    checkpoint = os.path.join(run_dir, kept[0])  # checkpoint-2 or checkpoint-4
    files = set(os.listdir(checkpoint))
    assert {"optimizer-rank0.pt", "optimizer-rank1.pt", "scheduler.pt", "trainer_state.json",
            "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "rng_state_0.pth", "rng_state_1.pth", "actcomp_state"} <= files
    # load_best_model_at_end: every stage ends with the best checkpoint's weights.
    best_weights = {}
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):  # one per stage
        best_weights.update(load_file(os.path.join(best, shard)))
    for weights in _stage_weights(straight, 2, 2):
        for name, value in weights.items():
            expected = best_weights[name if name in best_weights else "transformer.wte.weight"]
            torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)

    resumed, part = _run(tmp_path, "resumed", 2, {"plan": plan.to_dict(), "args": args, "resume": checkpoint})
    for rank in range(2):
        assert part[rank]["losses"] == full[rank]["losses"]  # the first steps come from the checkpoint's history
        for name, value in _stage_weights(resumed, 2, 2)[rank].items():
            torch.testing.assert_close(value, _stage_weights(straight, 2, 2)[rank][name], rtol=0, atol=0, msg=name)


def test_distributed_diloco_resumes_exactly(tmp_path):
    """DiLoCo (1 stage x 2 replicas, H=3, int8 pseudo-gradients, Nesterov outer step) under
    ActCompTrainer with nothing else changed: 8 steps straight == 4 steps, checkpoint, new
    processes, resume, the rest. The checkpoint falls between syncs, when the replicas differ:
    each one's weights, anchor, outer momentum and error feedback come back from its own state."""
    plan = Plan(num_stages=1, data_parallel=2, dp_compression={
        "method": "diloco", "sync_every": 3, "compression": {"method": "quantize", "bits": 8}})
    args = {"max_steps": 8, "save_strategy": "steps", "save_steps": 4}
    straight, full = _run(tmp_path, "straight", 2, {"plan": plan.to_dict(), "args": args})
    checkpoint = os.path.join(straight, "run", "checkpoint-4")
    saved = {key.split(".")[1] for key in _saved_state_keys(checkpoint, rank=1) if key.startswith("data_parallel.")}
    assert {"anchor", "weights", "momentum", "pseudo_gradient", "inner_step", "outer_step"} <= saved
    resumed, part = _run(tmp_path, "resumed", 2, {"plan": plan.to_dict(), "args": args, "resume": checkpoint})
    final = [_stage_weights(straight, 2, 1)[rank] for rank in range(2)]
    assert any(not torch.equal(final[0][n], final[1][n]) for n in final[0])  # step 8 is not a sync step
    for rank in range(2):
        assert part[rank]["losses"] == full[rank]["losses"]
        for name, value in _stage_weights(resumed, 2, 1)[rank].items():
            torch.testing.assert_close(value, final[rank][name], rtol=0, atol=0, msg=name)


def _saved_state_keys(checkpoint: str, rank: int) -> set[str]:
    """Names of the compression-state tensors rank `rank` saved in `checkpoint`."""
    from safetensors import safe_open

    from hf_actcomp.state.compression import COMPRESSION_STATE_DIR

    keys: set[str] = set()
    for path in glob.glob(os.path.join(checkpoint, COMPRESSION_STATE_DIR, f"rank{rank}*.safetensors")):
        with safe_open(path, "pt") as f:
            keys |= set(f.keys())
    return keys


def test_distributed_aqsgd_keeps_each_replicas_shard_only(four_processes):
    """2 stages x 2 replicas with AQ-SGD: each replica trains on a fixed contiguous half of the 32
    rows (shuffled within it), keeps memory for those 16 ids only, and visits all of them."""
    _, results = _results(four_processes, "aqsgd", 4)
    for rank, result in enumerate(results):
        start = 16 * (rank // 2)
        assert result["memory"] == {"sample_range": list(range(start, start + 16)), "rows": 16, "seen": 16}
        assert all(math.isfinite(loss) for loss in result["losses"])
    assert results[0]["losses"] == results[1]["losses"]  # one pipeline, one loss


def test_distributed_bf16_base_with_fp32_lora(tmp_path, two_processes):
    """A bf16 base model with fp32 LoRA weights, under bf16 autocast, on 2 processes: trains, and
    only the adapter changes; losses follow plain Trainer's on the same model within bf16 noise."""
    reference_model = lora_model(debug_model("gpt2", seed=0).to(torch.bfloat16))
    reference = _reference(tmp_path, reference_model, bf16=True)
    out, results = _results(two_processes, "bf16_lora", 2)
    untouched = lora_model(debug_model("gpt2", seed=0).to(torch.bfloat16)).get_base_model()
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(_logged(reference, "loss"), rel=2e-2)
        for name, value in _stage_weights(out, 2, 2)[rank].items():
            before = untouched.get_parameter(name)
            if "lora_" in name:
                assert value.dtype == torch.float32
                if "lora_B" in name:
                    assert not torch.equal(value, before), name
            else:
                assert value.dtype == torch.bfloat16 and torch.equal(value, before), name


def test_prepare_accepts_peft_model_in_simulation():
    model = lora_model(debug_model("gpt2", seed=0))
    sim = hf_actcomp.simulate(model, Plan(num_stages=2))
    batch = pad_collator([ragged_dataset()[i] for i in range(4)])
    sim(**batch).loss.backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())


def test_distributed_predict_and_metrics_equal_plain_trainer(tmp_path, two_processes):
    """2 processes, codec none: predict() and evaluate() with compute_metrics reading the argmax
    (run on the last stage), the inputs and the losses (include_for_metrics), moved to the CPU
    after every batch (eval_accumulation_steps=1): every rank returns plain Trainer's predictions,
    labels and metrics. The predictions crossed once per batch, from the last stage, counted under
    `predictions`: per batch an 8-byte length, a 12 x int64 header and the int64 token ids."""
    from trainer_cases import argmax_logits, token_metrics

    reference = Trainer(model=debug_model("gpt2", seed=0), compute_metrics=token_metrics,
                        preprocess_logits_for_metrics=argmax_logits, train_dataset=ragged_dataset(),
                        data_collator=pad_collator, args=training_args(
                            str(tmp_path / "reference"), include_for_metrics=["inputs", "loss"],
                            eval_accumulation_steps=1))
    reference.train()
    expected = reference.predict(ragged_dataset(8, seed=1))
    evaluated = reference.evaluate(ragged_dataset(8, seed=1))
    out, results = _results(two_processes, "predict", 2)
    batches = [pad_collator([ragged_dataset(8, seed=1)[i] for i in range(b, b + 4)]) for b in (0, 4)]
    for rank, result in enumerate(results):
        got = load_file(os.path.join(out, f"predict-rank{rank}.safetensors"))
        assert torch.equal(got["predictions"], torch.from_numpy(expected.predictions)), rank
        assert torch.equal(got["label_ids"], torch.from_numpy(expected.label_ids)), rank
        for key, value in expected.metrics.items():
            if not key.endswith(("_runtime", "_per_second", "_preparation_time")):
                assert result["predict"]["metrics"][key] == pytest.approx(value, rel=1e-5), key
        for key in ("eval_loss", "eval_accuracy", "eval_mean_prediction", "eval_inputs_sum", "eval_losses_mean"):
            assert result["predict"]["evaluate"][key] == pytest.approx(evaluated[key], rel=1e-5), key
        # read after predict(): once over the two batches
        assert result["predict"]["bytes"] == sum(8 + 12 * 8 + b["input_ids"].numel() * 8 for b in batches)


@pytest.mark.parametrize("run", ["classifier", "deberta"])
def test_distributed_classifier_matches_plain_trainer(tmp_path, two_processes, run):
    """A Llama and a DeBERTa-v2 sequence classifier on 2 processes: plain Trainer's logged losses
    (each call's mean, undivided under accumulation, as Trainer treats a model that ignores
    `num_items_in_batch`), gradient norms, final weights and evaluation loss. (A ViT under
    ActCompTrainer on 2 processes: tests/test_scripts.py's run_image_classification against plain
    Trainer.)"""
    from trainer_cases import class_collator, classification_rows

    family, overrides = ("llama", {}) if run == "classifier" else ("deberta-v2", {"hidden_dropout_prob": 0.0})
    rows, collator = classification_rows, class_collator
    reference_model = debug_model(family, seed=0, task="sequence_classification", **overrides)
    reference = Trainer(model=reference_model, args=training_args(str(tmp_path / "reference")),
                        train_dataset=rows(), data_collator=collator)
    reference.train()
    expected_eval = reference.evaluate(rows(8))["eval_loss"]
    out, results = _results(two_processes, run, 2)
    for rank, result in enumerate(results):
        norms = [h["grad_norm"] for h in result["logs"]]
        _assert_same_run(reference, result["losses"], norms, _stage_weights(out, 2, 2)[rank], reference_model)
        assert result["metrics"]["eval_loss"] == pytest.approx(expected_eval, rel=1e-5)
        assert "eval_token_loss" not in result["metrics"]
