"""simulate(): exact with the identity codec, compressed otherwise, usable like the model."""

import copy

import pytest
import torch
from pipeline_cases import padded_batch

from hf_actcomp import Compression, MemoryConfig, Plan, simulate
from hf_actcomp.debug import DEBUG_FAMILIES, debug_model


def assert_same_grads(model_a, model_b, atol=1e-5, rtol=1e-4):
    grads_b = dict(model_b.named_parameters())
    checked = 0
    for name, p in model_a.named_parameters():
        q = grads_b[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
            checked += 1
    assert checked == len(grads_b)


@pytest.mark.parametrize("family", DEBUG_FAMILIES)
@pytest.mark.parametrize("num_stages, micro_batches", [(2, 1), (3, 2)])
def test_identity_codec_matches_unsplit_model(family, num_stages, micro_batches):
    model = debug_model(family, seed=0)
    reference = copy.deepcopy(model)
    batch = padded_batch(model.config.vocab_size)
    plan = Plan(num_stages=num_stages, micro_batches=micro_batches, schedule="gpipe")
    sim = simulate(model, plan)
    out = sim(**batch)
    ref = reference(**{k: v for k, v in batch.items() if k != "sample_id"})
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    assert_same_grads(model, reference)
    stats = sim.stats()
    assert stats["compression_ratio"] == 1.0
    assert stats["relative_error"]["boundary0.forward"] == 0.0
    assert stats["relative_error"]["boundary0.backward"] == 0.0
    assert stats["bytes_sent"] == stats["bytes_uncompressed"] > 0


def test_counted_bytes_are_the_payload_bytes():
    model = debug_model("gpt2")
    hidden = model.config.hidden_size
    plan = Plan(
        num_stages=3, micro_batches=4, split_points=[1, 2],
        forward=Compression("quantize", bits=4), backward=Compression("quantize", bits=8),
    )
    sim = simulate(model, plan)
    batch = padded_batch(model.config.vocab_size, batch=8, length=16)
    sim(**batch).loss.backward()
    stats = sim.stats()
    numel = 2 * 16 * hidden  # per micro-batch of 2 rows
    fwd = stats["channels"]["boundary0.forward"]
    assert fwd["messages"] == 4
    assert fwd["bytes_sent"] == 4 * (4 * numel // 128 + numel * 4 // 8)
    assert fwd["bytes_uncompressed"] == 4 * numel * 4
    bwd = stats["channels"]["boundary1.backward"]
    assert bwd["bytes_sent"] == 4 * (4 * numel // 128 + numel)
    assert stats["bytes_sent"] == sum(c["bytes_sent"] for c in stats["channels"].values())
    assert 0 < stats["relative_error"]["boundary0.forward"] < 0.2
    assert 0 < stats["relative_error"]["boundary0.backward"] < 0.02
    # Eval-mode forwards (evaluation, a DPO reference pass) send the inference form (quantize 4 is
    # measured to break on a real LLM: hadamard_outliers 6 there), counted under `evaluation`.
    sim.eval()
    with torch.no_grad():
        sim(**batch)
    inference = sim.boundaries["boundary0.forward"].inference
    evaluation = sim.stats()["categories"]["evaluation"]
    assert evaluation["bytes_sent"] == 2 * 4 * inference.payload_nbytes((2, 16, hidden), torch.float32)
    assert evaluation["bytes_uncompressed"] == 2 * 4 * numel * 4
    assert sim.stats()["channels"]["boundary0.forward"]["bytes_sent"] == fwd["bytes_sent"]  # training's unchanged


def test_backward_compression_changes_gradients_only_upstream():
    model = debug_model("llama")
    reference = copy.deepcopy(model)
    plan = Plan(num_stages=2, split_points=[2], backward=Compression("quantize", bits=4))
    batch = padded_batch(model.config.vocab_size)
    out = simulate(model, plan)(**batch)
    ref = reference(**{k: v for k, v in batch.items() if k != "sample_id"})
    torch.testing.assert_close(out.loss, ref.loss)  # forward untouched
    out.loss.backward()
    ref.loss.backward()
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if "layers.3." in name or name.startswith("lm_head"):
            torch.testing.assert_close(p.grad, grads[name].grad)  # downstream of the boundary: exact
    first = "model.layers.0.mlp.up_proj.weight"
    p, q = dict(model.named_parameters())[first].grad, grads[first].grad
    assert not torch.equal(p, q)
    assert float((p - q).norm() / q.norm()) < 0.2


def train_aqsgd(forward, num_samples=8, epochs=4):
    """A tiny GPT-2 trained by `simulate` on a learnable pattern, 2 stages x 2 micro-batches, batches
    of 4 sample ids: (sim, forward bytes of each epoch, loss of each step)."""
    torch.manual_seed(0)
    model = debug_model("gpt2")
    plan = Plan(
        num_stages=2, micro_batches=2, forward=forward, backward=Compression("quantize", bits=4),
        memory=MemoryConfig(num_samples=num_samples, store="host", dtype="fp16"),
    )
    sim = simulate(model, plan)
    data = (torch.arange(num_samples)[:, None] * 7 + torch.arange(16)[None, :] * 3) % 64  # learnable
    optimizer = torch.optim.AdamW(sim.parameters(), lr=1e-2)
    epoch_bytes, losses = [], []
    for _ in range(epochs):
        sim.reset_stats()
        for start in range(0, num_samples, 4):
            ids = torch.arange(start, start + 4)
            out = sim(input_ids=data[ids], labels=data[ids], sample_id=ids)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(out.loss.item())
        epoch_bytes.append(sim.stats()["channels"]["boundary0.forward"]["bytes_sent"])
    forward = sim.boundaries["boundary0.forward"]
    assert torch.equal(forward.sender.mirror.memory.values, forward.receiver.memory.values)
    return sim, epoch_bytes, losses


def test_aqsgd_training_reduces_loss_and_bytes():
    num_samples = 8
    sim, epoch_bytes, losses = train_aqsgd(Compression("aqsgd", bits=2), num_samples)
    hidden = sim.model.config.hidden_size
    assert epoch_bytes[0] == num_samples * 16 * hidden * 4  # first visit: uncompressed fp32
    assert epoch_bytes[1] == num_samples * 16 * hidden * 2 // 8 + num_samples * 16 * hidden // 128 * 4
    assert losses[-1] < losses[0] * 0.8


def test_aqsgd_compressed_warm_up_training_reduces_loss():
    from hf_actcomp.feedback import build_codec

    warm_up = Compression("hadamard", bits=4)
    forward = Compression("aqsgd", bits=2, first_visit=warm_up)
    sim, epoch_bytes, losses = train_aqsgd(forward)
    micro = (2, 16, sim.model.config.hidden_size)  # 4 micro-batches of 2 rows per epoch
    assert epoch_bytes[0] == 4 * build_codec(warm_up).payload_nbytes(micro, torch.float32)  # first visits: warm-up
    assert epoch_bytes[1] == 4 * build_codec(forward).payload_nbytes(micro, torch.float32)  # 2-bit deltas
    assert losses[-1] < losses[0] * 0.8


def test_eval_mode_is_stateless():
    model = debug_model("opt")
    plan = Plan(
        forward=Compression("aqsgd", bits=4), memory=MemoryConfig(num_samples=4),
    )
    sim = simulate(model, plan).eval()
    batch = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        a = sim(**batch).logits
        b = sim(**{k: v for k, v in batch.items() if k != "sample_id"}).logits
    assert torch.equal(a, b)  # AQ-SGD falls back to direct 4-bit quantization, no memory
    assert not sim.boundaries["boundary0.forward"].receiver.memory.seen.any()
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert not torch.equal(a, full)


def test_works_with_accelerate():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = debug_model("qwen2")
    sim = simulate(model, Plan(forward=Compression("topk", ratio=0.3, feedback="ef")))
    optimizer = torch.optim.SGD(sim.parameters(), lr=0.1)
    sim, optimizer = accelerator.prepare(sim, optimizer)
    batch = padded_batch(model.config.vocab_size)
    before = sim(**batch).loss.item()
    for _ in range(3):
        loss = sim(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert sim(**batch).loss.item() < before


def test_bad_calls_fail_clearly():
    model = debug_model("gpt2")
    sim = simulate(model, Plan(num_stages=2, micro_batches=4, schedule="gpipe"))
    batch = padded_batch(model.config.vocab_size, batch=3)
    with pytest.raises(ValueError, match="batch of 3 rows cannot be split into plan.micro_batches=4"):
        sim(**batch)
    sim.eval()  # evaluation (e.g. the last, short batch of a set): one micro-batch per row
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():
        torch.testing.assert_close(sim(**inputs).loss, model(**inputs).loss)
    sim.train()
    with pytest.raises(TypeError, match=r"unsupported arguments \['inputs_embeds'\]"):
        sim(**padded_batch(model.config.vocab_size), inputs_embeds=1)
    with pytest.raises(ValueError, match="both input_ids and pixel_values"):
        sim(**padded_batch(model.config.vocab_size), pixel_values=torch.zeros(3, 1, 8, 8))
    aq = simulate(model, Plan(forward=Compression("aqsgd", bits=4), memory=MemoryConfig(num_samples=4)))
    with pytest.raises(ValueError, match="sample_id"):
        aq(input_ids=batch["input_ids"], labels=batch["labels"])
    with pytest.raises(TypeError, match="plan must be a hf_actcomp.Plan"):
        simulate(model, {"num_stages": 2})
    with pytest.raises(ValueError, match="more than the model's 4 blocks"):
        simulate(model, Plan(num_stages=5, schedule="gpipe"))


def test_ef21_two_forwards_then_one_backward():
    """The EF21 receiver's estimate is updated in place on every forward: what it hands to autograd
    must be a copy, or the first forward's graph is invalidated by the second."""
    model = debug_model("gpt2")
    plan = Plan(num_stages=2, forward=Compression("quantize", bits=4, feedback="ef21"),
                backward=Compression("quantize", bits=8, feedback="ef21"))
    sim = simulate(model, plan)
    batch = padded_batch(model.config.vocab_size)
    first = sim(**batch).loss
    second = sim(**batch).loss
    (first + second).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_num_items_in_batch_normalises_like_the_model(micro_batches):
    model = debug_model("llama", seed=0)
    reference = copy.deepcopy(model)
    batch = padded_batch(model.config.vocab_size)
    num_items = torch.tensor(50)  # e.g. the token count of the whole accumulated step
    sim = simulate(model, Plan(num_stages=2, micro_batches=micro_batches, schedule="gpipe"))
    out = sim(**batch, num_items_in_batch=num_items)
    ref = reference(**{k: v for k, v in batch.items() if k != "sample_id"}, num_items_in_batch=num_items)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-5)
    out.loss.backward()
    ref.loss.backward()
    assert_same_grads(model, reference)


def test_trains_with_transformers_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = debug_model("gpt2")
    plan = Plan(num_stages=2, micro_batches=2, forward=Compression("aqsgd", bits=4),
                backward=Compression("quantize", bits=8), memory=MemoryConfig(num_samples=8, dtype="fp32"))
    sim = simulate(model, plan)
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(), "sample_id": torch.tensor(i)}
        for i, ids in enumerate(torch.randint(0, model.config.vocab_size, (8, 12), generator=g))
    ]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
    before = copy.deepcopy(model.state_dict())
    trainer = Trainer(model=sim, args=args, train_dataset=data)
    assert trainer.model_accepts_loss_kwargs  # so Trainer passes num_items_in_batch to sim
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sim.boundaries["boundary0.forward"].receiver.memory.seen.all()  # both steps went through the boundary
