"""ResNet image classifiers through the stages (models/resnet.py): feature maps whose channels and
resolution change with depth cross the boundaries, sized before data arrives; chained stages are
the unsplit model bit for bit; micro-batches normalise as the unsplit model does under gradient
accumulation (BatchNorm's batch statistics); the two-process case is in tests/test_heads.py."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import hf_actcomp
from hf_actcomp import Compression, Plan
from hf_actcomp.debug import debug_model
from hf_actcomp.models import check_adapter, get_adapter

CLOSE = dict(atol=1e-6, rtol=1e-5)
TASK = "image_classification"
WHOLE = dict(num_stages=2, micro_batches=1, schedule="gpipe")  # one micro-batch: BatchNorm over the whole batch
PROBLEMS = {"single_label_classification": ({}, torch.tensor([0, 2, 1, 1])),
            "regression": ({"num_labels": 1}, torch.tensor([0.5, -1.0, 2.0, 0.25])),
            "multi_label_classification": ({"problem_type": "multi_label_classification"},
                                           torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0]]))}


def resnet_batch(rows: int = 4, labels: torch.Tensor | None = None, size: tuple[int, int] = (16, 16)) -> dict:
    """`rows` random one-channel images of `size` with single-label classes by default."""
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(rows, 1, *size, generator=g),
            "labels": torch.arange(rows) % 3 if labels is None else labels}


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def batch_norm_stats(model) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if "running" in n or "num_batches" in n}


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]], ids=["2-stage", "3-stage"])
def test_chained_stages_match_the_unsplit_resnet(problem, ranges):
    """Logits, loss and every gradient bit for bit, cuts inside a ResNet stage included."""
    overrides, labels = PROBLEMS[problem]
    model = debug_model("resnet", task=TASK, **overrides)
    check_adapter(model, stage_ranges=ranges, batch=resnet_batch(labels=labels))
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient to compare"


@pytest.mark.parametrize("size", [(16, 16), (15, 17), (9, 32)])
@pytest.mark.parametrize("layers", [dict(layer_type="basic"), dict(layer_type="bottleneck", downsample_in_first_stage=True),
                                    dict(layer_type="bottleneck", downsample_in_bottleneck=True)],
                         ids=["basic", "bottleneck-first-stage", "bottleneck-1x1"])
def test_boundary_shapes_follow_the_feature_maps(size, layers):
    """What crosses each boundary, worked out from the images' size and the config, is the shape of
    the feature map the model computes there (odd and uneven sizes too)."""
    model = debug_model("resnet", task=TASK, **layers).eval()
    adapter = get_adapter(model)
    images = resnet_batch(size=size)["pixel_values"]
    hidden, shapes = model.resnet.embedder(images), []
    shapes.append(tuple(hidden.shape))
    for block in adapter.blocks():
        hidden = block(hidden)
        shapes.append(tuple(hidden.shape))
    assert [adapter.boundary_shape(images, b) for b in range(adapter.num_blocks + 1)] == shapes
    assert len({s[1:] for s in shapes}) >= 2  # channels and resolution change with depth


def test_micro_batches_normalise_as_gradient_accumulation():
    """BatchNorm uses the batch it is given: in 2 micro-batches through simulate, the loss, logits,
    every gradient and the running statistics are the unsplit model's over the two halves in turn
    (gradient accumulation); in one micro-batch, the unsplit model's over the whole batch."""
    batch = resnet_batch()
    for micro in (1, 2):
        model = debug_model("resnet", task=TASK)
        reference = copy.deepcopy(model)
        out = hf_actcomp.simulate(model, Plan(num_stages=2, micro_batches=micro, schedule="gpipe"))(**batch)
        out.loss.backward()
        halves = [{k: v.tensor_split(micro)[i] for k, v in batch.items()} for i in range(micro)]
        parts = [reference(**half) for half in halves]
        loss = sum(p.loss for p in parts) / micro
        loss.backward()
        torch.testing.assert_close(out.loss, loss, **CLOSE)
        torch.testing.assert_close(out.logits, torch.cat([p.logits for p in parts]), **CLOSE)
        want = grads(reference)
        assert set(grads(model)) == set(want)
        for name, grad in grads(model).items():
            torch.testing.assert_close(grad, want[name], **CLOSE, msg=lambda m, n=name: f"{n}: {m}")
        stats = batch_norm_stats(reference)
        for name, value in batch_norm_stats(model).items():
            torch.testing.assert_close(value, stats[name], **CLOSE, msg=lambda m, n=name: f"{n}: {m}")
        assert int(stats["resnet.embedder.embedder.normalization.num_batches_tracked"]) == micro


def test_codecs_lora_and_inference_take_a_resnet():
    """A compressed plan trains on feature maps (8-bit forward: fewer bytes, a loss close to the
    model's), compressed_inference with the identity codec gives the model's logits in eval mode,
    and a PEFT LoRA ResNet (adapters on the convolutions, the classifier trained in full) through
    simulate gives the model's gradients."""
    from peft import LoraConfig, get_peft_model

    batch = resnet_batch()
    model = debug_model("resnet", task=TASK)
    expected = copy.deepcopy(model)(**batch).loss
    plan = Plan(**WHOLE, forward=Compression("quantize", bits=8), backward=Compression("quantize", bits=8))
    sim = hf_actcomp.simulate(model, plan)
    loss = sim(**batch).loss
    assert sim.stats()["channels"]["boundary0.forward"]["compression_ratio"] > 3
    torch.testing.assert_close(loss, expected, atol=0.02, rtol=0)
    model.eval()
    with hf_actcomp.compressed_inference(model, Plan(num_stages=2)) as inference:
        assert torch.equal(inference(**batch).logits, model(**batch).logits)

    def lora():
        torch.manual_seed(0)
        config = LoraConfig(r=2, target_modules=["convolution"], modules_to_save=["classifier"])
        return get_peft_model(debug_model("resnet", task=TASK), config)

    ours, reference = lora(), lora()
    reference(**batch).loss.backward()
    hf_actcomp.simulate(ours, Plan(**WHOLE))(**batch).loss.backward()
    want = grads(reference)
    assert set(grads(ours)) == set(want) and any("lora_A" in n for n in want)
    for name, grad in grads(ours).items():
        torch.testing.assert_close(grad, want[name], **CLOSE, msg=lambda m, n=name: f"{n}: {m}")


def test_aqsgd_keys_feature_maps_by_sample_id():
    """AQ-SGD on a feature-map boundary: an image's first visit crosses in full (the model's loss),
    its second as a 4-bit delta against its memory (a fifth of the bytes, the same loss: a zero
    delta decodes exactly)."""
    plan = Plan(**WHOLE, forward=Compression("aqsgd", bits=4), memory=hf_actcomp.MemoryConfig(num_samples=8))
    model = debug_model("resnet", task=TASK)
    reference = copy.deepcopy(model)
    sim = hf_actcomp.simulate(model, plan)
    batch, ids = resnet_batch(), torch.tensor([0, 1, 2, 3])
    first = sim(**batch, sample_id=ids).loss
    torch.testing.assert_close(first, reference(**batch).loss, **CLOSE)
    sent = sim.stats()["channels"]["boundary0.forward"]["bytes_sent"]
    second = sim(**batch, sample_id=ids).loss
    assert sim.stats()["channels"]["boundary0.forward"]["bytes_sent"] - sent < sent / 5
    torch.testing.assert_close(second, first, atol=1e-4, rtol=0)


def test_resnet_refusals_name_the_problem():
    """Plan.auto (one shape for every boundary), the estimate (which prices (rows, tokens, hidden)),
    the bare backbone, a mask."""
    model = debug_model("resnet", task=TASK)
    with pytest.raises(ValueError, match="Plan.auto assumes every boundary carries the same shape; "
                                         "ResNetForImageClassification's boundaries change with depth"):
        hf_actcomp.pipeline.construction.split_model(model, Plan.auto(num_stages=2))
    with pytest.raises(ValueError, match="hf-actcomp splits ResNet as an image classifier"):
        get_adapter(transformers.ResNetModel(model.config))
    from hf_actcomp.plan.estimate import estimate

    with pytest.raises(ValueError, match="model type 'resnet' has no hidden_size"):
        estimate(model.config, Plan(num_stages=2), batch_size=4, seq_len=1, link_bits_per_second=1e7)
    sim = hf_actcomp.simulate(model, Plan(num_stages=2))
    with pytest.raises(ValueError, match="ResNetForImageClassification takes no attention_mask"):
        sim(**resnet_batch(), attention_mask=torch.ones(4, 16))


def test_trainer_in_one_process_matches_plain_trainer_for_a_resnet(tmp_path):
    """ActCompTrainer in one process, one micro-batch (BatchNorm over the whole batch, as the
    model): plain Trainer's logged losses, gradient norms, final weights, running statistics and
    evaluation."""
    from trainer_cases import image_collator, image_rows, training_args
    from transformers import Trainer

    rows = image_rows(16, size=16)

    def run(trainer_class, output_dir, **kwargs):
        model = debug_model("resnet", task=TASK)
        trainer = trainer_class(model=model, args=training_args(str(tmp_path / output_dir)), train_dataset=rows,
                                eval_dataset=rows.select(range(8)), data_collator=image_collator, **kwargs)
        trainer.train()
        logged = [v for h in trainer.state.log_history if "loss" in h and "train_loss" not in h
                  for v in (h["loss"], h["grad_norm"])]
        return model, logged, trainer.evaluate()

    reference, want, want_eval = run(Trainer, "reference")
    model, got, got_eval = run(hf_actcomp.ActCompTrainer, "ours", plan=Plan(**WHOLE))
    assert got == pytest.approx(want, rel=1e-5)
    assert got_eval["eval_loss"] == pytest.approx(want_eval["eval_loss"], rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), reference.get_parameter(name).detach(), rtol=0, atol=1e-5, msg=name)
    stats = batch_norm_stats(reference)
    for name, value in batch_norm_stats(model).items():
        torch.testing.assert_close(value, stats[name], rtol=0, atol=1e-5, msg=name)
