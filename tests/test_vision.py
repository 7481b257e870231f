"""ViT image classifiers through the stages (models/vision.py): `pixel_values` in place of
`input_ids`, boundaries sized from the patches, the sequence classifier's losses, AQ-SGD keyed
by sample id, LoRA and compressed inference; the two-process case is in tests/test_heads.py."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan
from hf_actcomp.debug import debug_model
from hf_actcomp.models import get_adapter

CLOSE = dict(atol=1e-6, rtol=1e-5)
TASK = "image_classification"


def image_batch(rows: int = 4, labels: torch.Tensor | None = None, seed: int = 0) -> dict:
    """`rows` random 1 x 8 x 8 images (the debug ViT's) with single-label classes by default."""
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(rows, 1, 8, 8, generator=g),
            "labels": torch.arange(rows) % 3 if labels is None else labels}


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


PROBLEMS = {"single_label_classification": ({}, torch.tensor([0, 2, -100, 1])),
            "regression": ({"num_labels": 1}, torch.tensor([0.5, -1.0, 2.0, 0.25])),
            "multi_label_classification": ({"problem_type": "multi_label_classification"},
                                           torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0]]))}


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("num_stages", [2, 3])
def test_simulate_matches_the_unsplit_vit(problem, num_stages):
    """Loss, logits and every parameter's gradient of the unsplit ViT, over micro-batches."""
    overrides, labels = PROBLEMS[problem]
    model = debug_model("vit", task=TASK, **overrides)
    reference = copy.deepcopy(model)
    batch = image_batch(labels=labels)
    expected = reference(**batch)
    expected.loss.backward()
    sim = hf_actcomp.simulate(model, Plan(num_stages=num_stages, micro_batches=4 if num_stages == 3 else 2))
    out = sim(**batch)
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, **CLOSE)
    torch.testing.assert_close(out.logits, expected.logits, **CLOSE)
    want = grads(reference)
    assert set(grads(model)) == set(want)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, want[name], **CLOSE, msg=lambda m, n=name: f"{n}: {m}")
    assert model.config.problem_type == reference.config.problem_type


def test_boundaries_carry_the_patches():
    """What crosses a boundary is (images, patches + 1, hidden): 16 patches of 2 x 2 and [CLS]."""
    model = debug_model("vit", task=TASK)
    adapter = get_adapter(model)
    assert adapter.hidden_shape(torch.zeros(5, 1, 8, 8)) == (5, 17)
    sim = hf_actcomp.simulate(model, Plan(num_stages=2, micro_batches=2))
    sim(**image_batch()).loss.backward()
    channel = sim.stats()["channels"]["boundary0.forward"]
    assert channel["bytes_sent"] == 4 * 17 * model.config.hidden_size * 4  # 4 images, fp32, identity codec


def test_aqsgd_keys_images_by_sample_id():
    """AQ-SGD: an image's first visit crosses in full (the unsplit model's loss), its second as a
    4-bit delta against the memory of that image (fewer bytes, a loss close to the model's)."""
    plan = Plan(num_stages=2, micro_batches=2, forward=Compression("aqsgd", bits=4),
                memory=MemoryConfig(num_samples=8))
    model = debug_model("vit", task=TASK)
    reference = copy.deepcopy(model)
    sim = hf_actcomp.simulate(model, plan)
    batch = image_batch()
    first = sim(**batch, sample_id=torch.tensor([0, 1, 2, 3])).loss
    torch.testing.assert_close(first, reference(**batch).loss, **CLOSE)
    sent = sim.stats()["channels"]["boundary0.forward"]["bytes_sent"]
    second = sim(**batch, sample_id=torch.tensor([0, 1, 2, 3])).loss
    again = sim.stats()["channels"]["boundary0.forward"]["bytes_sent"] - sent
    assert again < sent / 5
    torch.testing.assert_close(second, first, atol=1e-4, rtol=0)  # the same images: a zero delta decodes exactly
    with pytest.raises(ValueError, match="sample_id"):
        sim(**batch)


def test_lora_and_compressed_inference_take_a_vit():
    """A PEFT LoRA ViT (query/value adapters, the classifier trained in full) through simulate
    gives the model's gradients; compressed_inference with the identity codec gives its logits."""
    from peft import LoraConfig, get_peft_model

    def lora():
        torch.manual_seed(0)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["classifier"])
        return get_peft_model(debug_model("vit", task=TASK), config)

    batch = image_batch()
    ours, reference = lora(), lora()
    reference(**batch).loss.backward()
    hf_actcomp.simulate(ours, Plan(num_stages=2, micro_batches=2))(**batch).loss.backward()
    want = grads(reference)
    assert set(grads(ours)) == set(want) and any("lora_A" in n for n in want)
    for name, grad in grads(ours).items():
        torch.testing.assert_close(grad, want[name], **CLOSE, msg=lambda m, n=name: f"{n}: {m}")
    model = debug_model("vit", task=TASK).eval()
    with hf_actcomp.compressed_inference(model, Plan(num_stages=2)) as inference:
        assert torch.equal(inference(**batch).logits, model(**batch).logits)


def test_image_batches_are_checked_before_any_work():
    sim = hf_actcomp.simulate(debug_model("vit", task=TASK), Plan(num_stages=2, micro_batches=2))
    with pytest.raises(ValueError, match=r"takes pixel_values of shape \(images, channels, height, width\) as floats"):
        sim(pixel_values=torch.zeros(4, 8, 8, dtype=torch.long), labels=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="ViTForImageClassification takes no attention_mask"):
        sim(pixel_values=torch.zeros(4, 1, 8, 8), attention_mask=torch.ones(4, 17), labels=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="both input_ids and pixel_values"):
        sim(input_ids=torch.zeros(4, 3, dtype=torch.long), pixel_values=torch.zeros(4, 1, 8, 8))
    with pytest.raises(ValueError, match="image models \\(vit, resnet\\) build image_classification only"):
        debug_model("vit")


def test_trainer_in_one_process_matches_plain_trainer_for_a_vit(tmp_path):
    """ActCompTrainer in one process on an image dataset (pixel_values, labels): plain Trainer's
    logged losses, gradient norms, final weights and evaluation; AQ-SGD adds the sample ids."""
    from trainer_cases import image_collator, image_rows, training_args
    from transformers import Trainer

    def run(trainer_class, output_dir, **kwargs):
        model = debug_model("vit", task=TASK)
        trainer = trainer_class(model=model, args=training_args(str(tmp_path / output_dir)), train_dataset=image_rows(),
                                eval_dataset=image_rows(8, seed=1), data_collator=image_collator, **kwargs)
        trainer.train()
        logged = [v for h in trainer.state.log_history if "loss" in h and "train_loss" not in h
                  for v in (h["loss"], h["grad_norm"])]
        return model, logged, trainer.evaluate()

    reference, want, want_eval = run(Trainer, "reference")
    model, got, got_eval = run(hf_actcomp.ActCompTrainer, "ours", plan=Plan(num_stages=2, micro_batches=2))
    assert got == pytest.approx(want, rel=1e-5)
    assert got_eval["eval_loss"] == pytest.approx(want_eval["eval_loss"], rel=1e-5)
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias"):  # its gradient is rounding noise (softmax ignores a key bias),
            continue  # which AdamW's normalisation turns into whole steps of either sign
        torch.testing.assert_close(p.detach(), reference.get_parameter(name).detach(), rtol=0, atol=1e-5, msg=name)
    aqsgd = Plan(num_stages=2, micro_batches=2, forward=Compression("aqsgd", bits=4))
    _, compressed, _ = run(hf_actcomp.ActCompTrainer, "aqsgd", plan=aqsgd)
    assert compressed[0] == pytest.approx(want[0], rel=1e-5)  # a first visit crosses in full
