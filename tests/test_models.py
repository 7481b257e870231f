"""Model adapters: chained stages reproduce the unsplit model's logits, loss and every gradient.

The comparisons are bitwise (atol=rtol=0): the stages run the very same operations in the same
order as the model's own forward, so any difference is a bug (a wrong position, mask, scaling
or a missed module), not rounding.

The reference model runs with `use_cache=False`, as the stages do. With the config's default
`use_cache=True` the model copies keys and values into a `DynamicCache` (a `torch.cat`, hence
contiguous), whereas without a cache GPT-2 and OPT hand eager attention strided views of their
projections. `query @ key.T` then runs as a GEMM with another operand layout, which some BLAS
kernels (MKL on AVX-512) round differently: a few ulps in the logits, decided by the CPU, not
by the adapters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import hf_actcomp
import hf_actcomp.models as models
from hf_actcomp.debug import (
    DEBUG_FAMILIES,
    ENCODER_FAMILIES,
    IMAGE_FAMILIES,
    debug_config,
    debug_model,
    default_attention,
)
from hf_actcomp.models import (
    VERIFIED_TYPES,
    DecoderAdapter,
    ModelAdapter,
    StageModule,
    check_adapter,
    get_adapter,
    register_adapter,
    register_standard_decoder,
    supported_model_types,
)
from hf_actcomp.models.check import even_ranges, padded_batch
from hf_actcomp.models.decoder import FULL, SLIDING

EXACT = dict(atol=0.0, rtol=0.0)
SPLITS = {
    "1-stage": [(0, 4)],
    "2-stage": [(0, 2), (2, 4)],
    "3-stage": [(0, 1), (1, 3), (3, 4)],
}
TIED = {
    "gpt2": [("lm_head.weight", "transformer.wte.weight")],
    "opt": [("lm_head.weight", "model.decoder.embed_tokens.weight")],
    "gemma2": [("lm_head.weight", "model.embed_tokens.weight")],
    "gemma3_text": [("lm_head.weight", "model.embed_tokens.weight")],
}
make_batch = padded_batch


def build_stages(model, split: str) -> list[StageModule]:
    adapter = get_adapter(model)
    ranges = SPLITS[split]
    return [
        adapter.build_stage(start, stop, first=i == 0, last=i == len(ranges) - 1)
        for i, (start, stop) in enumerate(ranges)
    ]


def run_chain(stages: list[StageModule], batch: dict) -> torch.Tensor:
    x = batch["input_ids"]
    for stage in stages:
        x = stage(x, batch["attention_mask"])
    return x


def assert_chain_matches_unsplit(model, split: str, batch: dict) -> None:
    """Logits, loss and every parameter's gradient of the chained stages equal an unsplit copy's
    (`check_adapter`), and no gradient is zero (else the comparison would prove nothing)."""
    check_adapter(model, stage_ranges=SPLITS[split], batch=batch, **EXACT)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: no gradient to compare"


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("split", ["2-stage", "3-stage"])
@pytest.mark.parametrize("family", DEBUG_FAMILIES)
def test_chained_stages_match_unsplit_model(family, split, padding):
    model = debug_model(family)
    assert model.config._attn_implementation == default_attention(family)
    assert_chain_matches_unsplit(model, split, make_batch(model.config.vocab_size, padding))


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("family", [f for f in DEBUG_FAMILIES if default_attention(f) != "eager"])
def test_chained_stages_match_unsplit_model_eager(family, padding):
    model = debug_model(family, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert_chain_matches_unsplit(model, "3-stage", make_batch(model.config.vocab_size, padding))


@pytest.mark.parametrize("family", DEBUG_FAMILIES)
def test_chained_stages_match_without_attention_mask(family):
    model = debug_model(family)
    assert_chain_matches_unsplit(model, "3-stage", make_batch(model.config.vocab_size, "none"))


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("gpt2", dict(embd_pdrop=0.2, attn_pdrop=0.2, resid_pdrop=0.2)),
        ("opt", dict(dropout=0.2, attention_dropout=0.2, layerdrop=0.4)),
        ("qwen2", dict(attention_dropout=0.2)),
    ],
)
def test_dropout_and_layerdrop_draw_random_numbers_in_model_order(family, overrides):
    """With dropout (and OPT's LayerDrop) in training mode the same seed gives the same output."""
    model = debug_model(family, **overrides).train()
    reference = copy.deepcopy(model)
    batch = make_batch(model.config.vocab_size, "left")
    torch.manual_seed(123)
    logits = run_chain(build_stages(model, "3-stage"), batch)
    torch.manual_seed(123)
    ref = reference(**batch, use_cache=False)
    torch.testing.assert_close(logits, ref.logits, **EXACT)
    torch.manual_seed(124)
    rerun = reference(**batch, use_cache=False)
    assert not torch.equal(ref.logits, rerun.logits)  # dropout is really active


def test_opt_with_projections_and_post_layer_norm():
    """OPT-350m layout: project_in/project_out around a narrower tied embedding, no final norm."""
    model = debug_model("opt", word_embed_proj_dim=32, do_layer_norm_before=False)
    decoder = model.model.decoder
    assert decoder.project_in is not None and decoder.final_layer_norm is None
    adapter = get_adapter(model)
    assert decoder.project_in in adapter.embedding_modules()
    assert decoder.project_out in adapter.head_modules()
    assert_chain_matches_unsplit(model, "2-stage", make_batch(model.config.vocab_size, "left"))


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("family", DEBUG_FAMILIES)
def test_stage_parameters_partition_the_model(family, split):
    model = debug_model(family)
    adapter = get_adapter(model)
    assert adapter.tied_weights() == TIED.get(family, [])
    stages = build_stages(model, split)
    last = len(stages) - 1
    by_name = dict(model.named_parameters(remove_duplicate=False))
    owners: dict[int, list[int]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            # Same dotted names as in the model, and the very same tensors (no copies).
            assert by_name[name] is p, name
            owners.setdefault(id(p), []).append(s)
    tied = {id(by_name[a]) for pair in adapter.tied_weights() for a in pair}
    for name, p in model.named_parameters():
        expected = sorted({0, last}) if id(p) in tied else None
        got = owners.get(id(p))
        assert got is not None, f"{name} is on no stage"
        if expected is not None:
            assert got == expected, f"tied {name} on stages {got}"
        else:
            assert len(got) == 1, f"{name} on stages {got}"
    assert set(owners) == {id(p) for p in model.parameters()}
    if split == "1-stage":
        assert sorted(n for n, _ in stages[0].named_parameters()) == sorted(
            n for n, _ in model.named_parameters()
        )


def test_stage_module_contents():
    model = debug_model("llama")
    adapter = get_adapter(model)
    assert adapter.num_blocks == 4 and adapter.blocks() is model.model.layers
    assert adapter.embedding_modules() == [model.model.embed_tokens]
    assert adapter.head_modules() == [model.model.norm, model.lm_head]
    middle = adapter.build_stage(1, 3, first=False, last=False)
    assert (middle.start, middle.stop, middle.first, middle.last) == (1, 3, False, False)
    assert middle.get_submodule("model.layers.1") is model.model.layers[1]
    # Rotary tables travel with every stage (buffers only), embeddings and head do not.
    assert middle.model.rotary_emb is model.model.rotary_emb
    assert not hasattr(middle.model, "embed_tokens") and not hasattr(middle, "lm_head")
    assert {n.split(".")[2] for n, _ in middle.named_parameters()} == {"1", "2"}


def test_invalid_stage_ranges_and_masks_are_rejected():
    adapter = get_adapter(debug_model("gpt2"))
    with pytest.raises(ValueError, match="Invalid block range"):
        adapter.build_stage(2, 5, first=False, last=True)
    with pytest.raises(ValueError, match="first stage must start at block 0"):
        adapter.build_stage(1, 4, first=True, last=True)
    with pytest.raises(ValueError, match="last stage must end"):
        adapter.build_stage(0, 3, first=True, last=True)
    stage = adapter.build_stage(0, 4, first=True, last=True)
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="2-D"):
        stage(ids, torch.ones(2, 6, dtype=torch.long))


def test_debug_configs_exercise_each_family_feature():
    for family in DEBUG_FAMILIES:
        config = debug_config(family)
        assert config.model_type == family
        assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (4, 64, 256)
        assert config.num_attention_heads == 4 and config.max_position_embeddings == 128
        assert config.tie_word_embeddings == (family in TIED)
    assert debug_config("llama").num_key_value_heads == 2
    assert debug_config("gpt2", n_layer=2).num_hidden_layers == 2
    for family in ("qwen2", "qwen3"):
        qwen = get_adapter(debug_model(family))
        assert [qwen.layer_mask_kind(i) for i in range(4)] == [FULL, FULL, SLIDING, SLIDING]
    for family in ("gemma2", "gemma3_text"):
        gemma = get_adapter(debug_model(family))
        assert [gemma.layer_mask_kind(i) for i in range(4)] == [SLIDING, FULL, SLIDING, FULL]
    for family in ("mistral", "phi3"):
        assert get_adapter(debug_model(family)).layer_mask_kind(0) == SLIDING
    assert get_adapter(debug_model("gemma3_text"))._rotary_per_layer_type()
    assert not get_adapter(debug_model("gemma2"))._rotary_per_layer_type()
    assert debug_model("mixtral").config.num_local_experts == 4
    # The sliding window is shorter than the test sequences, so the exactness tests cover it.
    batch = make_batch(256, "right")
    for family in ("mistral", "qwen2", "phi3"):
        windowed = debug_model(family)(**batch).logits
        full = debug_model(family, sliding_window=None, use_sliding_window=False)(**batch).logits
        assert not torch.allclose(windowed, full)
    # Same seed, same weights.
    a, b = debug_model("opt", seed=3), debug_model("opt", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_debug_config_unknown_family():
    with pytest.raises(ValueError) as info:
        debug_config("electra")
    assert str(info.value) == (
        "Unknown debug family 'electra'. Available families: gpt2, opt, llama, mistral, qwen2, "
        "qwen3, gemma2, gemma3_text, phi3, olmo2, mixtral, bert, roberta, deberta-v2, modernbert, vit, resnet."
    )
    with pytest.raises(ValueError, match="Available families"):
        debug_model("gptj")


def tiny_gpt_neox():
    config = transformers.GPTNeoXConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_unsupported_model_type_lists_supported_ones():
    assert supported_model_types() == sorted(["gpt2", "opt", *VERIFIED_TYPES, *ENCODER_FAMILIES, *IMAGE_FAMILIES])
    # every verified family is tested
    assert sorted(DEBUG_FAMILIES + ENCODER_FAMILIES + IMAGE_FAMILIES) == supported_model_types()
    with pytest.raises(ValueError) as info:
        get_adapter(tiny_gpt_neox())
    assert str(info.value) == (
        "Model type 'gpt_neox' is not supported. Supported model types: bert, deberta-v2, gemma2, gemma3_text, "
        "gpt2, llama, mistral, mixtral, modernbert, olmo2, opt, phi3, qwen2, qwen3, resnet, roberta, vit. See "
        "docs/adding_a_model.md to add an adapter."
    )
    bert = transformers.BertLMHeadModel(
        transformers.BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            is_decoder=True,
        )
    )
    with pytest.raises(ValueError, match=r"BertLMHeadModel: bert as a decoder \(is_decoder=True, a causal LM head\) "
                                         r"is not supported; hf-actcomp splits its encoder"):
        get_adapter(bert)


def test_base_model_without_head_is_rejected():
    with pytest.raises(ValueError, match="LlamaModel is not a model hf-actcomp splits: it takes a family.s causal LM"):
        get_adapter(debug_model("llama").model)


def test_register_adapter_adds_a_family(monkeypatch):
    """The GPT-NeoX example of docs/adding_a_model.md, held to the same exactness test."""
    monkeypatch.setattr(models.registry, "ADAPTERS", dict(models.ADAPTERS))

    @register_adapter
    class GPTNeoXAdapter(DecoderAdapter):
        model_types = ("gpt_neox",)
        blocks_path = "gpt_neox.layers"
        embed_path = "gpt_neox.embed_in"
        norm_path = "gpt_neox.final_layer_norm"
        rotary_path = "gpt_neox.rotary_emb"

        def _embedding_paths(self):
            return [self.embed_path, "gpt_neox.emb_dropout"]

        def embed(self, input_ids, attention_mask):
            embeds = self._module(self.embed_path)(input_ids)
            return self._module("gpt_neox.emb_dropout")(embeds)

        def run_block(self, index, hidden, context):
            return self.blocks()[index](
                hidden,
                attention_mask=context["masks"][FULL],
                position_ids=context["position_ids"],
                use_cache=False,
                layer_past=None,
                position_embeddings=context["position_embeddings"][FULL],
            )

    assert "gpt_neox" in supported_model_types()
    model = tiny_gpt_neox()
    assert isinstance(get_adapter(model), GPTNeoXAdapter)
    reference = copy.deepcopy(model)
    batch = make_batch(256, "left")
    adapter = get_adapter(model)
    stages = [
        adapter.build_stage(0, 1, first=True, last=False),
        adapter.build_stage(1, 2, first=False, last=True),
    ]
    logits = run_chain(stages, batch)
    ref = reference(**batch, use_cache=False)
    torch.testing.assert_close(logits, ref.logits, **EXACT)
    model.loss_function(logits, batch["labels"], vocab_size=256).backward()
    ref.loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **EXACT)

    with pytest.raises(ValueError, match="already served by GPT2Adapter"):

        @register_adapter
        class OtherGPT2(ModelAdapter):
            model_types = ("gpt2",)

    with pytest.raises(TypeError):
        register_adapter(object)


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_gradient_checkpointing_keeps_stages_exact(family):
    model = debug_model(family).train()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    assert_chain_matches_unsplit(model, "3-stage", make_batch(model.config.vocab_size, "left"))


def test_unverified_standard_family_can_be_tried_and_checked(monkeypatch):
    """OLMo (1) has the standard layout but is not verified: the error says how to try it, and
    `check_adapter` then passes; Granite's embedding multiplier is something the generic adapter
    does not reproduce, and `check_adapter` says so."""
    monkeypatch.setattr(models.registry, "ADAPTERS", dict(models.ADAPTERS))
    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    olmo = transformers.AutoModelForCausalLM.from_config(transformers.OlmoConfig(**kwargs))
    with pytest.raises(ValueError) as info:
        get_adapter(olmo)
    assert "It has the standard decoder layout, so the generic adapter may serve it: call " \
        "hf_actcomp.models.register_standard_decoder('olmo'), then " \
        "hf_actcomp.models.check_adapter(model)" in str(info.value)
    register_standard_decoder("olmo")
    assert "olmo" in supported_model_types()
    check_adapter(olmo)  # 3 stages of one block each, left padding
    assert all(p.grad is not None for p in olmo.parameters())

    register_standard_decoder("granite")
    granite = transformers.AutoModelForCausalLM.from_config(
        transformers.GraniteConfig(**kwargs, embedding_multiplier=12.0))
    with pytest.raises(AssertionError, match="^logits: Tensor-likes are not equal"):
        check_adapter(granite)
    with pytest.raises(ValueError, match="already served by DecoderAdapter_olmo"):
        register_standard_decoder("olmo") and register_adapter(
            type("Other", (DecoderAdapter,), {"model_types": ("olmo",)}))


def test_check_adapter_catches_a_missing_softcap():
    """Gemma 2's logit soft-capping changes logits only slightly: the exact check still sees it."""
    adapter = get_adapter(debug_model("gemma2"))

    class NoCap(type(adapter)):
        def head(self, hidden):
            return self._module(self.lm_head_path)(self._module(self.norm_path)(hidden))

    model = debug_model("gemma2")
    model_adapter = NoCap(model)
    stages = [model_adapter.build_stage(a, b, first=i == 0, last=i == 1)
              for i, (a, b) in enumerate(even_ranges(4, 2))]
    batch = make_batch(256, "left")
    logits = run_chain(stages, batch)
    reference = model(**batch, use_cache=False).logits
    assert not torch.equal(logits, reference)
    torch.testing.assert_close(logits, reference, atol=1e-3, rtol=0)  # tiny but not zero
    check_adapter(model)  # the real adapter caps


def test_features_a_stage_cannot_reproduce_are_refused_by_name():
    with pytest.raises(ValueError, match="use_bidirectional_attention=True .* Set it to False"):
        get_adapter(debug_model("gemma3_text", use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="llama: output_router_logits=True but the model declares no router "
                       "outputs .* Set config.output_router_logits=False"):
        hf_actcomp.simulate(debug_model("llama", output_router_logits=True), hf_actcomp.Plan(num_stages=2))


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_mixtral_load_balancing_loss_in_process_is_transformers_own(micro_batches):
    """output_router_logits=True: simulate() adds each micro-batch's router loss exactly as
    transformers adds it per forward call; loss and every gradient bit for bit."""
    from pipeline_cases import reference_loss

    model = debug_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    reference = copy.deepcopy(model)
    batch = padded_batch(256, "left", batch=4)
    plan = hf_actcomp.Plan(num_stages=2, micro_batches=micro_batches, schedule="gpipe")
    loss = hf_actcomp.simulate(model, plan)(**batch).loss
    expected = reference_loss(reference, batch, micro_batches)
    without_router_loss = debug_model("mixtral")(**{k: v for k, v in batch.items() if k != "sample_id"}).loss
    assert expected > without_router_loss + 0.5  # coef 0.5 x aux (about E x top_k / E = 2)
    torch.testing.assert_close(loss, expected, **EXACT)
    loss.backward()
    expected.backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **EXACT, msg=name)


def test_even_ranges():
    assert even_ranges(4, 3) == [(0, 1), (1, 3), (3, 4)]
    assert even_ranges(5, 2) == [(0, 2), (2, 5)]
    with pytest.raises(ValueError, match=r"num_stages must be in \[1, 4\], got 5"):
        even_ranges(4, 5)
