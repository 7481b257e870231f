"""Sequence and token classifiers of every decoder family through the stages (models/heads.py).

As for the causal LMs (tests/test_models.py), chained stages must give the unsplit model's
logits, loss and every gradient bit for bit; `simulate` and the two-process pipeline cut the
batch into micro-batches, so there the sums run in another order and the comparison has a
tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)

import hf_actcomp
from hf_actcomp import Plan
from hf_actcomp.debug import DEBUG_FAMILIES, ENCODER_FAMILIES, debug_config, debug_model
from hf_actcomp.dp.base import ring_allreduce_bytes
from hf_actcomp.models import check_adapter, get_adapter
from hf_actcomp.models.check import padded_batch
from hf_actcomp.models.heads import MASKED_LM, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION

EXACT = dict(atol=0.0, rtol=0.0)
CLOSE = dict(atol=1e-6, rtol=1e-5)
TOKEN_FAMILIES = [f for f in DEBUG_FAMILIES
                  if debug_config(f).model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES]
PROBLEMS = {  # problem type -> (num_labels, labels of 4 rows)
    "single_label_classification": (3, torch.tensor([0, 2, -100, 1])),
    "regression": (1, torch.tensor([0.5, -1.0, 2.0, 0.25])),
    "multi_label_classification": (3, torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0]])),
}


def classifier_batch(model, padding: str = "left", rows: int = 3, labels: torch.Tensor | None = None) -> dict:
    """`padded_batch` with the pad token where the mask is 0 (where a sequence classifier looks
    for each row's last token) and labels of the model's task."""
    batch = padded_batch(model.config.vocab_size, padding, batch=rows)
    mask = batch["attention_mask"]
    if mask is not None:
        batch["input_ids"] = batch["input_ids"].masked_fill(mask == 0, model.config.pad_token_id)
    if model.config.model_type in ("bert", "deberta-v2"):  # two segments, as a sentence pair
        batch["token_type_ids"] = (torch.arange(batch["input_ids"].shape[1]) >= 5).long().expand_as(batch["input_ids"]).clone()
    if labels is not None:
        batch["labels"] = labels
    elif get_adapter(model).task == MASKED_LM:  # every third token is a prediction target
        targets = torch.arange(batch["input_ids"].numel()).view_as(batch["input_ids"]) % 3 == 0
        batch["labels"] = batch["input_ids"].masked_fill(~targets, -100)
    elif get_adapter(model).task == TOKEN_CLASSIFICATION:
        batch["labels"] = (batch["input_ids"] % model.config.num_labels).masked_fill(
            mask == 0 if mask is not None else torch.zeros_like(batch["input_ids"], dtype=torch.bool), -100)
    else:
        batch["labels"] = torch.arange(rows) % model.config.num_labels
    return batch


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]], ids=["2-stage", "3-stage"])
@pytest.mark.parametrize("family, task", [(f, SEQUENCE_CLASSIFICATION) for f in DEBUG_FAMILIES]
                         + [(f, TOKEN_CLASSIFICATION) for f in TOKEN_FAMILIES]
                         + [(f, t) for f in ENCODER_FAMILIES
                            for t in (SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, MASKED_LM)])
def test_chained_stages_match_the_unsplit_classifier(family, task, ranges, padding):
    model = debug_model(family, task=task)
    assert get_adapter(model).task == task
    # DeBERTa-v2: every stage applies the LayerNorm of the relative-position embeddings, so their
    # gradient is a sum of one term per stage (rounding, not bits, differs from the model's one term)
    tolerance = CLOSE if family == "deberta-v2" else EXACT
    check_adapter(model, stage_ranges=ranges, batch=classifier_batch(model, padding), **tolerance)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient to compare"


def test_every_family_has_a_sequence_classifier_and_the_known_token_classifiers():
    types = [debug_config(f).model_type for f in DEBUG_FAMILIES]
    assert all(t in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES for t in types)
    assert TOKEN_FAMILIES == ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "mixtral"]


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
def test_simulate_matches_the_unsplit_classifier_over_micro_batches(family, problem):
    """4 rows in 2 micro-batches over 2 stages: the loss is the unsplit model's mean over the
    whole batch (an ignored row, -100, counts for nothing), as are the logits and gradients."""
    num_labels, labels = PROBLEMS[problem]
    model = debug_model(family, task=SEQUENCE_CLASSIFICATION, num_labels=num_labels, problem_type=problem)
    reference = copy.deepcopy(model)
    batch = classifier_batch(model, "right", rows=4, labels=labels)
    expected = reference(**batch)
    expected.loss.backward()
    sim = hf_actcomp.simulate(model, Plan(num_stages=2, micro_batches=2))
    out = sim(**batch)
    out.loss.backward()
    torch.testing.assert_close(out.logits, expected.logits, **CLOSE)
    torch.testing.assert_close(out.loss, expected.loss, **CLOSE)
    want = grads(reference)
    assert set(grads(model)) == set(want)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, want[name], **CLOSE, msg=lambda m, n=name: f"{n}: {m}")


def test_simulate_token_classifier_call_for_call_like_the_model():
    """Gradient accumulation as Trainer runs it: two calls of 2 rows (2 micro-batches each) give
    the loss of each call and the summed gradients of the unsplit model's two calls. Like the
    model's own forward, the stages ignore `num_items_in_batch` for a classifier (the call's mean)."""
    model = debug_model("qwen2", task=TOKEN_CLASSIFICATION, classifier_dropout=0.0)  # the same numbers both ways
    reference = copy.deepcopy(model)
    batch = classifier_batch(model, "left", rows=4)
    sim = hf_actcomp.simulate(model, Plan(num_stages=2, micro_batches=2))
    count = int(batch["labels"].ne(-100).sum())
    for half in (slice(0, 2), slice(2, 4)):
        part = {k: v[half] for k, v in batch.items()}
        expected = reference(**part, num_items_in_batch=count).loss
        expected.backward()
        got = sim(**part, num_items_in_batch=count).loss
        got.backward()
        torch.testing.assert_close(got, expected, **CLOSE)
    want = grads(reference)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, want[name], **CLOSE, msg=lambda m, n=name: f"{n}: {m}")


def test_compressed_boundaries_train_a_classifier():
    """AQ-SGD and quantized gradients on a sequence classifier: the loss falls."""
    model = debug_model("llama", task=SEQUENCE_CLASSIFICATION)
    batch = classifier_batch(model, "right", rows=4, labels=torch.tensor([0, 1, 2, 1]))
    batch["sample_id"] = torch.arange(4)
    plan = Plan(num_stages=2, micro_batches=2,
                forward=hf_actcomp.Compression("aqsgd", bits=4), backward=hf_actcomp.Compression("quantize", bits=8),
                memory=hf_actcomp.MemoryConfig(num_samples=4))
    sim = hf_actcomp.simulate(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = sim(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert sim.stats()["compression_ratio"] > 1.5


def test_mixtral_classifier_adds_no_load_balancing_loss():
    """transformers adds the router loss in the causal LM's forward only."""
    model = debug_model("mixtral", task=SEQUENCE_CLASSIFICATION, output_router_logits=True)
    reference = copy.deepcopy(model)
    batch = classifier_batch(model, "right", rows=4, labels=torch.tensor([0, 1, 2, 1]))
    sim = hf_actcomp.simulate(model, Plan(num_stages=2, micro_batches=2))
    assert sim.router is None
    torch.testing.assert_close(sim(**batch).loss, reference(**batch).loss, **CLOSE)


def test_classifier_refusals_name_the_problem():
    model = debug_model("llama", task=SEQUENCE_CLASSIFICATION, pad_token_id=None)
    batch = classifier_batch(debug_model("llama", task=SEQUENCE_CLASSIFICATION), "none", rows=2)
    with pytest.raises(ValueError, match="no padding token is defined: set model.config.pad_token_id"):
        hf_actcomp.simulate(model, Plan(num_stages=2))(**batch)
    import transformers

    qa = transformers.AutoModelForQuestionAnswering.from_config(debug_config("llama"))
    with pytest.raises(ValueError, match=r"LlamaForQuestionAnswering is not a model hf-actcomp splits: it takes .*"
                                         r"AutoModelForSequenceClassification"):
        hf_actcomp.simulate(qa, Plan(num_stages=2))
    with pytest.raises(ValueError, match=r"LlamaModel is not a model hf-actcomp splits"):
        hf_actcomp.simulate(transformers.AutoModel.from_config(debug_config("llama")), Plan(num_stages=2))
    with pytest.raises(ValueError, match=r"task='qa': choose one of causal_lm, sequence_classification"):
        debug_model("llama", task="qa")


# Two processes, one stage each (tests/workers/heads_worker.py): name -> (family, task, overrides)
PIPELINE_CASES = {
    "gpt2-single-label": ("gpt2", SEQUENCE_CLASSIFICATION, {}),
    "llama-regression": ("llama", SEQUENCE_CLASSIFICATION, {"num_labels": 1}),
    "opt-multi-label": ("opt", SEQUENCE_CLASSIFICATION, {"problem_type": "multi_label_classification"}),
    "qwen2-tokens": ("qwen2", TOKEN_CLASSIFICATION, {"classifier_dropout": 0.0}),
    # segments through the first stage; the masked-LM head tied to the first stage's embedding
    "bert-single-label": ("bert", SEQUENCE_CLASSIFICATION, {"hidden_dropout_prob": 0.0}),
    "roberta-masked-lm": ("roberta", MASKED_LM, {"hidden_dropout_prob": 0.0}),
    # pixel_values into the first stage; boundaries sized from the patches (models/vision.py)
    "vit-images": ("vit", "image_classification", {}),
    # feature maps of two shapes (the cut inside a ResNet stage would be a third); BatchNorm per micro-batch
    "resnet-images": ("resnet", "image_classification", {}),
    # relative-position embeddings on both stages: their gradients summed over the stages
    "deberta-v2-single-label": ("deberta-v2", SEQUENCE_CLASSIFICATION, {"hidden_dropout_prob": 0.0}),
    # both at once: the shared embeddings summed over the stages and the decoder tied to the first stage
    "deberta-v2-masked-lm": ("deberta-v2", MASKED_LM, {"hidden_dropout_prob": 0.0}),
    # mean pooling over the unpadded tokens: the padding mask reaches the last stage; a tied decoder
    "modernbert-mean-pooling": ("modernbert", SEQUENCE_CLASSIFICATION, {}),
    "modernbert-masked-lm": ("modernbert", MASKED_LM, {}),
}


def case_batch(case: str, model) -> dict:
    """The 4-row batch of a pipeline case, with labels of its problem type."""
    if model.config.model_type == "vit":
        from test_vision import image_batch

        return image_batch(4, labels=torch.tensor([2, 0, 1, 1]))
    if model.config.model_type == "resnet":
        from test_resnet import resnet_batch

        return resnet_batch(4, labels=torch.tensor([2, 0, 1, 1]))
    problem = {"llama-regression": "regression", "opt-multi-label": "multi_label_classification"}.get(case)
    labels = PROBLEMS[problem][1] if problem else (None if case.endswith(("tokens", "masked-lm"))
                                                   else torch.tensor([2, 0, 1, 1]))
    return classifier_batch(model, "right", rows=4, labels=labels)


def reference_step(reference, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unsplit model's training loss of the worker's step (2 micro-batches) with its gradients
    left in `reference`, and its evaluation's logits and loss after the step. The batch at once
    (no dropout: training and evaluation agree); a ResNet (BatchNorm over the batch it is given)
    over the two halves in turn, as gradient accumulation runs it, then evaluated with the running
    statistics they left."""
    if reference.config.model_type != "resnet":
        out = reference(**batch)
        out.loss.backward()
        return out.loss.detach(), out.logits.detach(), out.loss.detach()
    loss = sum(reference(**{k: v.tensor_split(2)[i] for k, v in batch.items()}).loss for i in range(2)) / 2
    loss.backward()
    with torch.no_grad():
        evaluated = reference.eval()(**batch)
    return loss.detach(), evaluated.logits, evaluated.loss


def test_two_processes_match_the_unsplit_classifier(tmp_path):
    """`prepare` + `train_step` / `eval_step` on 2 ranks: the loss, the last stage's logits and
    every parameter's gradient equal the unsplit model's (BERT's segments reach the first stage,
    RoBERTa's masked-LM head stays tied to the first stage's embedding, ViT's pixel_values reach
    the first stage and its patches size the boundary, ResNet's feature maps are sized from the
    images and its BatchNorm runs per micro-batch)."""
    from distributed import run_workers
    from safetensors.torch import load_file

    run_workers("heads_worker.py", 2, [str(tmp_path)], timeout=300)
    plain = [int(load_file(tmp_path / f"bert-single-label-rank{rank}.safetensors")["collective_bytes"][0])
             for rank in range(2)]  # a step's collectives without shared parameters (the loss)
    for case, (family, task, overrides) in PIPELINE_CASES.items():
        reference = debug_model(family, task=task, **overrides)
        batch = case_batch(case, reference)
        loss, eval_logits, eval_loss = reference_step(reference, batch)
        want = grads(reference)
        got = [load_file(tmp_path / f"{case}-rank{rank}.safetensors") for rank in range(2)]
        for rank in range(2):
            torch.testing.assert_close(got[rank]["loss"][0], loss, **CLOSE)
            torch.testing.assert_close(got[rank]["eval_loss"][0], eval_loss, **CLOSE)
        torch.testing.assert_close(got[1]["logits"], eval_logits, **CLOSE)
        # A head tied to the input embedding (the masked LM): the last stage's copy owns the
        # gradient, under the head's name; every parameter's gradient is on exactly one rank, but
        # for those every stage holds (DeBERTa's relative-position embeddings): the whole sum on each.
        alias = dict(get_adapter(reference).tied_weights())
        shared = set(get_adapter(reference).shared_parameters())
        seen = [alias.get(name[5:], name[5:]) for g in got for name in g if name.startswith("grad.")]
        assert sorted(n for n in seen if n not in shared) == sorted(n for n in want if n not in shared), case
        assert all(seen.count(n) == 2 for n in shared), f"{case}: {sorted(shared)} on both ranks"
        assert bool(shared) == case.startswith("deberta-v2")
        # Their sum over the stages is one all-reduce a step, counted with the step's collectives.
        shared_bytes = sum(reference.get_parameter(n).numel() * 4 for n in shared)
        extra = [int(g["collective_bytes"][0]) - plain[rank] for rank, g in enumerate(got)]
        assert extra == [ring_allreduce_bytes(shared_bytes, 2) if shared else 0] * 2, (case, extra)
        for g in got:
            for name, grad in g.items():
                if name.startswith("grad."):
                    torch.testing.assert_close(grad, want[alias.get(name[5:], name[5:])], **CLOSE,
                                               msg=lambda m, c=case, n=name: f"{c} {n}: {m}")


@pytest.mark.parametrize("family, overrides", [("llama", {}), ("bert", {"hidden_dropout_prob": 0.0}),
                                               ("deberta-v2", {"hidden_dropout_prob": 0.0}), ("modernbert", {})])
def test_trainer_in_one_process_matches_plain_trainer_for_a_classifier(tmp_path, family, overrides):
    """ActCompTrainer in one process (the stages through simulate) on a sequence classifier:
    the same logged losses, gradient norms, final weights and evaluation as plain Trainer."""
    from trainer_cases import class_collator, classification_rows, training_args
    from transformers import Trainer

    def run(trainer_class, output_dir, **kwargs):
        model = debug_model(family, task=SEQUENCE_CLASSIFICATION, **overrides)
        trainer = trainer_class(model=model, args=training_args(str(tmp_path / output_dir)), train_dataset=classification_rows(),
                                eval_dataset=classification_rows(8), data_collator=class_collator, **kwargs)
        trainer.train()
        logged = [v for h in trainer.state.log_history if "loss" in h and "train_loss" not in h
                  for v in (h["loss"], h["grad_norm"])]
        return model, logged, trainer.evaluate()

    reference, want, want_eval = run(Trainer, "reference")
    model, got, got_eval = run(hf_actcomp.ActCompTrainer, "ours", plan=Plan(num_stages=2))
    assert got == pytest.approx(want, rel=1e-5)
    assert got_eval["eval_loss"] == pytest.approx(want_eval["eval_loss"], rel=1e-5)
    assert got_eval["eval_plain_loss"] == pytest.approx(want_eval["eval_loss"], rel=1e-5)  # identity codec
    assert not any(k.endswith(("token_loss", "perplexity")) for k in got_eval)  # no per-token means
    # Weights to 1e-4 as tests/scripts.py's assert_same_run: Adam's normalised step turns rounding in
    # an embedding row's near-zero gradient into a step-sized difference (1.06e-5 on an AMD EPYC).
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), reference.get_parameter(name).detach(), rtol=0, atol=1e-4, msg=name)


def test_compressed_inference_and_lora_take_a_classifier():
    """`compressed_inference` wraps the unsplit classifier (identity codec: its very logits; 8-bit
    boundaries: close, the codec's payload), and a PEFT LoRA classifier (`task_type="SEQ_CLS"`, its
    `score` trained in full) runs through `simulate` with the model's loss and gradients."""
    from peft import LoraConfig, get_peft_model

    model = debug_model("llama", task=SEQUENCE_CLASSIFICATION).eval()
    batch = classifier_batch(model, "right", rows=4, labels=torch.tensor([0, 1, 2, 1]))
    expected = model(**batch)
    with hf_actcomp.compressed_inference(model, Plan(num_stages=2)) as inference:
        assert torch.equal(inference(**batch).logits, expected.logits)
    plan = Plan(num_stages=2, forward=hf_actcomp.Compression("quantize", bits=8))
    with hf_actcomp.compressed_inference(model, plan) as inference:
        out = inference(**batch)
        ratio = inference.stats()["compression_ratio"]
    torch.testing.assert_close(out.logits, expected.logits, atol=0.05, rtol=0.05)
    shape = (*batch["input_ids"].shape, model.config.hidden_size)
    from hf_actcomp.feedback import (
        build_inference_codec,  # inference="auto": the form measured on SmolLM2
    )

    payload = build_inference_codec(plan.forward_at(0)).payload_nbytes(shape, torch.float32)
    assert ratio == pytest.approx(4 * batch["input_ids"].numel() * model.config.hidden_size / payload)

    # The head PEFT trains in full (`modules_to_save`): the decoders' `score`, ModernBERT's `classifier`.
    for family, targets, head in (("llama", ["q_proj", "v_proj"], "score"), ("modernbert", ["Wqkv"], "classifier")):
        def lora(family=family, targets=targets):
            torch.manual_seed(0)
            config = LoraConfig(r=4, target_modules=targets, task_type="SEQ_CLS")
            return get_peft_model(debug_model(family, task=SEQUENCE_CLASSIFICATION), config)

        ours, reference = lora(), lora()
        reference(**batch).loss.backward()
        hf_actcomp.simulate(ours, Plan(num_stages=2, micro_batches=2))(**batch).loss.backward()
        want = grads(reference)
        assert set(grads(ours)) == set(want) and any(head in n for n in want) and any("lora_A" in n for n in want)
        for name, grad in grads(ours).items():
            torch.testing.assert_close(grad, want[name], **CLOSE, msg=lambda m, n=name, f=family: f"{f} {n}: {m}")


LORA_TARGETS = {"bert": ["query", "value"], "roberta": ["query", "value"], "deberta-v2": ["query_proj", "value_proj"],
                "modernbert": ["Wqkv"]}


@pytest.mark.parametrize("task", [SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, MASKED_LM])
@pytest.mark.parametrize("family", ENCODER_FAMILIES)
def test_lora_encoders_match_the_unsplit_model_over_micro_batches(family, task):
    """PEFT LoRA on each encoder's attention and each head (the classifier saved in full), through
    simulate in 2 micro-batches over 3 stages: the unsplit LoRA model's loss and every trainable
    gradient."""
    from peft import LoraConfig, get_peft_model

    def lora():
        torch.manual_seed(0)
        model = debug_model(family, task=task, **({} if family == "modernbert" else {"hidden_dropout_prob": 0.0}))
        saved = [] if task == MASKED_LM else ["classifier"]
        return get_peft_model(model, LoraConfig(r=4, target_modules=LORA_TARGETS[family], modules_to_save=saved))

    ours, reference = lora(), lora()
    batch = classifier_batch(reference, "right", rows=4)
    expected = reference(**batch)
    expected.loss.backward()
    out = hf_actcomp.simulate(ours, Plan(num_stages=3, micro_batches=2, schedule="gpipe"))(**batch)
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, **CLOSE)
    want = grads(reference)
    assert set(grads(ours)) == set(want) and any("lora_B" in n for n in want)
    for name, grad in grads(ours).items():
        torch.testing.assert_close(grad, want[name], **CLOSE, msg=lambda m, n=name: f"{n}: {m}")


def test_encoders_over_micro_batches_and_their_refusals():
    """BERT and DeBERTa-v2 with segments (token_type_ids) in 2 micro-batches through simulate: the
    unsplit model's loss, logits and gradients (DeBERTa's relative-position embeddings shared by
    the stages; ModernBERT's mean pooling over each micro-batch's padding mask); BERT as a decoder,
    an encoder without an adapter (ELECTRA), DeBERTa-v2's non-legacy masked-LM head and ModernBERT's
    sparse prediction are refused by name."""
    import transformers

    for family in ("bert", "deberta-v2", "modernbert"):
        model = debug_model(family, task=SEQUENCE_CLASSIFICATION, hidden_dropout_prob=0.0)
        reference = copy.deepcopy(model)
        batch = classifier_batch(model, "right", rows=4, labels=torch.tensor([0, 2, 1, 1]))
        assert family == "modernbert" or batch["token_type_ids"].sum() > 0
        expected = reference(**batch)
        expected.loss.backward()
        out = hf_actcomp.simulate(model, Plan(num_stages=2, micro_batches=2))(**batch)
        out.loss.backward()
        torch.testing.assert_close(out.logits, expected.logits, **CLOSE)
        want = grads(reference)
        prefix = model.base_model_prefix
        assert set(grads(model)) == set(want)
        if family != "modernbert":  # ModernBERT has no segments (test_heads' batch gives it none)
            assert f"{prefix}.embeddings.token_type_embeddings.weight" in want
        for name, grad in grads(model).items():
            torch.testing.assert_close(grad, want[name], **CLOSE, msg=lambda m, n=name: f"{n}: {m}")
        if family == "deberta-v2":
            rel = want.get("deberta.encoder.rel_embeddings.weight")
            assert rel is not None and rel.abs().sum() > 0
    with pytest.raises(ValueError, match=r"DebertaV2ForMaskedLM: config.legacy=False \(a masked-LM head that reads"):
        get_adapter(transformers.AutoModelForMaskedLM.from_config(debug_config("deberta-v2", legacy=False)))

    decoder = transformers.BertLMHeadModel(debug_config("bert", is_decoder=True))
    with pytest.raises(ValueError, match=r"BertLMHeadModel: bert as a decoder .* is not supported"):
        get_adapter(decoder)
    electra = transformers.AutoModelForSequenceClassification.from_config(transformers.ElectraConfig(
        vocab_size=64, embedding_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64))
    with pytest.raises(ValueError, match=r"Model type 'electra' is not supported\. Supported model types: bert, "):
        get_adapter(electra)
    with pytest.raises(ValueError, match=r"ModernBertForMaskedLM: config.sparse_prediction=True .* is not supported"):
        get_adapter(debug_model("modernbert", task=MASKED_LM, sparse_prediction=True))
    with pytest.raises(ValueError, match=r"task='causal_lm' with the bert family: encoders"):
        debug_model("bert")
    llama = debug_model("llama", task=SEQUENCE_CLASSIFICATION)
    segments = {**classifier_batch(llama, "right"), "token_type_ids": torch.zeros(3, 10, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"LlamaForSequenceClassification \(through hf-actcomp's stages\) takes no "
                                         r"token_type_ids: they are an encoder's segments"):
        hf_actcomp.simulate(llama, Plan(num_stages=2))(**segments)
