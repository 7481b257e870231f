"""compressed_inference(): evaluation and generate() through compressed boundaries, undoable."""

import torch

from hf_actcomp import Compression, MemoryConfig, Plan, compressed_inference
from hf_actcomp.debug import debug_model


def prompt(model, batch=2, length=6):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=g)


def test_identity_codec_generation_is_unchanged():
    model = debug_model("llama").eval()
    ids = prompt(model)
    expected = model.generate(ids, max_new_tokens=5, do_sample=False)
    with compressed_inference(model, Plan(num_stages=3, micro_batches=3)) as inf:
        got = inf.generate(ids, max_new_tokens=5, do_sample=False)
        assert torch.equal(got, expected)
        stats = inf.stats()
    # One message per boundary for the prompt, then one per generated token after the first.
    assert stats["channels"]["boundary0.forward"]["messages"] == 5
    assert stats["compression_ratio"] == 1.0


def test_quantized_generation_with_cache_and_sampling_and_undo():
    model = debug_model("gpt2").eval()
    ids = prompt(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain_logits = model(ids).logits
    inf = compressed_inference(model, Plan(forward=Compression("quantize", bits=2)))
    logits = inf(ids).logits
    assert not torch.equal(logits, plain_logits)
    assert torch.allclose(logits.softmax(-1), plain_logits.softmax(-1), atol=0.2)
    greedy = inf.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
    torch.manual_seed(0)
    sampled = inf.generate(ids, max_new_tokens=4, do_sample=True, top_k=20)
    assert greedy.shape == sampled.shape == (2, 10)
    hidden = model.config.hidden_size
    channel = inf.stats()["channels"]["boundary0.forward"]
    assert channel["bytes_uncompressed"] > 0 and channel["compression_ratio"] > 10  # 32 / (2 + 32/128)
    assert inf.remove() is model
    assert not inf.active
    assert all(not block._forward_hooks for block in model.transformer.h)
    assert torch.equal(model(ids).logits, plain_logits)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert hidden == model.config.hidden_size


def test_aqsgd_inference_fallbacks():
    model = debug_model("mistral").eval()
    ids = prompt(model)
    plain = model(ids).logits
    memory = MemoryConfig(num_samples=10)
    with compressed_inference(model, Plan(forward=Compression("aqsgd", bits=4), memory=memory)) as inf:
        direct = inf(ids).logits
    with compressed_inference(model, Plan(forward=Compression("aqsgd", bits=4, inference="none"), memory=memory)) as inf:
        none = inf(ids).logits
    assert torch.equal(none, plain)
    assert not torch.equal(direct, plain)
