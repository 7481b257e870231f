"""Tiny random debug models, one per supported family (like torchtitan's debug model).

They build in milliseconds from a config alone (no Hub access), so tests and integration runs
can exercise every family: 4 blocks, hidden size 64, 4 heads, vocabulary 256, no dropout.
Each keeps the feature that makes its family special: GPT-2 and OPT tie the LM head to the
input embedding, Llama-style models use grouped-query attention with an untied head, Mistral
and Phi-3 have a sliding window shorter than a test sequence, Qwen2/3 mix full and sliding
layers, Gemma 2 ties its head and soft-caps attention and logits, Gemma 3 keeps one rotary
table per layer type, OLMo 2 normalises queries and keys, Mixtral routes tokens to 4 experts.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

DEBUG_FAMILIES = (
    "gpt2",
    "opt",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "mixtral",
)
# Encoders: no causal LM; `debug_model(family, task=...)` builds their classifiers and masked LM.
ENCODER_FAMILIES = ("bert", "roberta", "deberta-v2", "modernbert")
# Image models: `debug_model(family, task="image_classification")`, one-channel images: 8 x 8 for ViT (2 x 2
# patches), any size for ResNet.
IMAGE_FAMILIES = ("vit", "resnet")

_VOCAB = 256
_HIDDEN = 64
_LAYERS = 4
_HEADS = 4
_POSITIONS = 128

# The sizes every family with transformers' standard config names shares.
_SIZES: dict[str, Any] = dict(
    vocab_size=_VOCAB,
    hidden_size=_HIDDEN,
    num_hidden_layers=_LAYERS,
    num_attention_heads=_HEADS,
    max_position_embeddings=_POSITIONS,
)

_LLAMA_STYLE: dict[str, Any] = dict(
    _SIZES,
    intermediate_size=2 * _HIDDEN,
    num_key_value_heads=2,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

_GEMMA: dict[str, Any] = dict(
    _LLAMA_STYLE,
    head_dim=_HIDDEN // _HEADS,
    query_pre_attn_scalar=_HIDDEN // _HEADS,
    sliding_window=4,
    tie_word_embeddings=True,
    pad_token_id=0,
)

_ENCODER: dict[str, Any] = dict(_SIZES, intermediate_size=2 * _HIDDEN, attention_probs_dropout_prob=0.0)

_FAMILY_KWARGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        vocab_size=_VOCAB,
        n_embd=_HIDDEN,
        n_layer=_LAYERS,
        n_head=_HEADS,
        n_positions=_POSITIONS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        tie_word_embeddings=True,
        # GPT-2's default token ids (50256) lie outside a 256-token vocabulary.
        bos_token_id=_VOCAB - 1,
        eos_token_id=_VOCAB - 1,
    ),
    "opt": dict(
        _SIZES,
        word_embed_proj_dim=_HIDDEN,
        ffn_dim=2 * _HIDDEN,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
        tie_word_embeddings=True,
    ),
    "llama": dict(_LLAMA_STYLE),
    # A window shorter than typical test sequences, so the sliding mask changes the output.
    "mistral": dict(_LLAMA_STYLE, sliding_window=4),
    # max_window_layers=2: layers 0-1 use full attention, layers 2-3 sliding attention.
    "qwen2": dict(_LLAMA_STYLE, use_sliding_window=True, sliding_window=4, max_window_layers=2),
    "qwen3": dict(_LLAMA_STYLE, use_sliding_window=True, sliding_window=4, max_window_layers=2),
    # Gemma: tied head, explicit head_dim (the default is 256), sliding/full layers alternating.
    "gemma2": dict(_GEMMA, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(_GEMMA, layer_types=["sliding_attention", "full_attention"] * (_LAYERS // 2)),
    "phi3": dict(_LLAMA_STYLE, sliding_window=4, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0),
    "olmo2": dict(_LLAMA_STYLE, pad_token_id=0),
    "mixtral": dict(_LLAMA_STYLE, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0),
    # Dropout between layers stays (0.1): the stages draw it in the model's order.
    "bert": dict(_ENCODER, pad_token_id=0, type_vocab_size=2),
    "roberta": dict(_ENCODER, pad_token_id=1, type_vocab_size=1, bos_token_id=0, eos_token_id=2),
    # Relative attention in log buckets (as DeBERTa-v3), segments, and the convolution after layer 0.
    "deberta-v2": dict(_ENCODER, pad_token_id=0, type_vocab_size=2, relative_attention=True, position_buckets=16,
                       max_relative_positions=32, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                       share_att_key=True, position_biased_input=False, conv_kernel_size=3),
    # Global and local (4-token window) layers alternating, rotary positions, mean pooling (which
    # reads the padding mask on the last stage), tied masked-LM decoder.
    "modernbert": dict(_SIZES, intermediate_size=2 * _HIDDEN, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       cls_token_id=1, sep_token_id=2, global_attn_every_n_layers=2, local_attention=4,
                       classifier_pooling="mean"),
    # Two ResNet stages of two basic residual layers (4 blocks, as the other families' layers, so that a cut
    # can fall inside a ResNet stage); 1 x 16 x 16 images leave 4 x 4 feature maps after the stem, 2 x 2 after
    # the second stage's stride.
    "resnet": dict(num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[2, 2], layer_type="basic",
                   downsample_in_first_stage=False),
    "vit": dict(image_size=8, patch_size=2, num_channels=1, hidden_size=_HIDDEN, num_hidden_layers=_LAYERS,
                num_attention_heads=_HEADS, intermediate_size=2 * _HIDDEN),
}


# Gemma 2 soft-caps attention scores, which transformers' SDPA path cannot do.
_ATTENTION = {"gemma2": "eager", "deberta-v2": "eager", "resnet": "eager"}  # ResNet: no attention at all


def default_attention(family: str) -> str:
    """The attention implementation `debug_config(family)` uses unless overridden."""
    _check_family(family)
    return _ATTENTION.get(family, "sdpa")


def _check_family(family: str) -> None:
    families = DEBUG_FAMILIES + ENCODER_FAMILIES + IMAGE_FAMILIES
    if family not in families:
        raise ValueError(f"Unknown debug family {family!r}. Available families: {', '.join(families)}.")


def debug_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    """A tiny random config for `family`; `overrides` replace any config field.

    `attn_implementation` defaults to "sdpa" ("eager" for Gemma 2, see `default_attention`);
    "eager" is the other supported choice.
    """
    attention = default_attention(family)  # checks the family first
    kwargs = dict(_FAMILY_KWARGS[family], attn_implementation=attention)
    kwargs.update(overrides)
    return transformers.AutoConfig.for_model(family, **kwargs)


AUTO_CLASSES = {
    "causal_lm": transformers.AutoModelForCausalLM,
    "sequence_classification": transformers.AutoModelForSequenceClassification,
    "token_classification": transformers.AutoModelForTokenClassification,
    "masked_lm": transformers.AutoModelForMaskedLM,
    "image_classification": transformers.AutoModelForImageClassification,
}


def debug_model(family: str, seed: int = 0, task: str = "causal_lm", **overrides: Any) -> transformers.PreTrainedModel:
    """A randomly initialised model built from `debug_config(family, **overrides)`: the causal
    LM, or with `task` the family's sequence or token classifier (3 labels and pad token 0 unless
    overridden: a sequence classifier pools at each row's last non-pad token), or an encoder's
    (`ENCODER_FAMILIES`) classifiers and masked LM, or an image model's (`IMAGE_FAMILIES`)
    image classifier.

    The same `seed` gives the same weights, so two calls build identical models.
    """
    if task not in AUTO_CLASSES:
        raise ValueError(f"task={task!r}: choose one of {', '.join(AUTO_CLASSES)}.")
    if (family in IMAGE_FAMILIES) != (task == "image_classification"):
        raise ValueError(f"task={task!r} with the {family} family: image models ({', '.join(IMAGE_FAMILIES)}) build "
                         "image_classification only, text models the other tasks.")
    encoder = family in ENCODER_FAMILIES
    if (encoder and task == "causal_lm") or (not encoder and task == "masked_lm"):
        raise ValueError(f"task={task!r} with the {family} family: encoders ({', '.join(ENCODER_FAMILIES)}) build "
                         "sequence_classification, token_classification or masked_lm; decoders the others.")
    if task != "causal_lm":
        overrides = {"num_labels": 3, **overrides}
        if family not in IMAGE_FAMILIES and debug_config(family).pad_token_id is None:
            overrides = {"pad_token_id": 0, **overrides}
    config = debug_config(family, **overrides)
    torch.manual_seed(seed)
    return AUTO_CLASSES[task].from_config(config)
