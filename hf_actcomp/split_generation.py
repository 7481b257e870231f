"""Text generation with the model still split: each stage keeps the KV cache of its own layers.

`model.generate`'s sampling loop, with the forward replaced by the stages: the first stage embeds
the new tokens, each stage runs its blocks against its own `transformers.DynamicCache` and hands
the new tokens' hidden states on, the last stage computes the logits of the last position and
picks the next tokens with transformers' own logits processors and stopping criteria. Every
stage rebuilds positions and masks from the 2-D attention mask alone, as `generate` does
(positions `cumsum - 1`, pads 0), so only one token's hidden state per row crosses a boundary
after the prompt (tests/test_generation.py checks it against `model.generate`). What each family
computes is its adapter's cached forward (`CachedForward.embed_cached`, `block_context_cached`,
`run_block_cached`, `head_cached`); this module keeps the loop. Two details matter:

- the causal / sliding-window mask must be sized by a cache layer of THIS stage
  (`layer_idx`, `ModelAdapter._cache_mask_layer`): the default, the model's first such layer,
  is empty in later stages;
- the logits processors must see the 2-D mask (the repetition penalty skips left pads by it).

Only greedy decoding and multinomial sampling run this way, one sequence per prompt:
`check_generation_mode` refuses every other mode of `model.generate` (beam search, contrastive,
assisted, DoLa, constrained, several sequences per prompt, ...) with a ValueError before any work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The positions `generate` gives each token: `cumsum(mask) - 1`, pads at 0."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


class CachedStage:
    """Blocks [start, stop) of `model` with their own KV cache, run on new tokens only: the
    adapter's cached forward (`embed_cached`, `block_context_cached`, `run_block_cached`,
    `head_cached`; see `CachedForward` and `ModelAdapter`) in the order `StageModule.forward` runs the uncached one.

    Args:
        model: the causal LM (its other stages' parameters may be freed).
        adapter: the model's `ModelAdapter`.
        start, stop: this stage's blocks.
        first, last: whether it embeds tokens / computes logits.
    """

    def __init__(self, model, adapter, start: int, stop: int, *, first: bool, last: bool) -> None:
        self.model, self.adapter = model, adapter
        self.start, self.stop, self.first, self.last = start, stop, first, last
        if not adapter.has_cached_forward():
            raise TypeError(
                f"Pipeline.generate runs each stage with a KV cache through its adapter's cached forward "
                f"({', '.join(adapter.CACHED_METHODS)}), which {type(adapter).__name__} does not implement "
                "(see docs/adding_a_model.md)."
            )
        # Every layer is listed; only this stage's layers ever hold tensors (attention updates the
        # cache at its global layer index), sliding layers where the config says so.
        self.cache = DynamicCache(config=model.config)

    def __call__(self, x: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor) -> torch.Tensor:
        """`x`: the new token ids (first stage) or their hidden states; `attention_mask`: the 2-D
        mask of every token so far (None: no padding at all, as `generate` passes it); returns
        the new hidden states, or on the last stage the logits of the last position."""
        a, layers = self.adapter, range(self.start, self.stop)
        h = a.embed_cached(x, attention_mask, position_ids) if self.first else x
        context = a.block_context_cached(h, attention_mask, position_ids, self.cache, layers)
        for i in layers:
            h = a.run_block_cached(i, h, context)
        return a.head_cached(h) if self.last else h


# What the split loop implements: one token per row and step, the argmax (greedy) or one
# multinomial draw (sampling) of the last position's scores after transformers' logits processors.
SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)

SUPPORTED_SETTINGS = (
    "greedy decoding (do_sample=False) and multinomial sampling (do_sample=True), one sequence per prompt; "
    "the logits processors and warpers transformers builds from the settings (temperature, top_k, top_p, "
    "min_p, typical_p, top_h, epsilon_cutoff, eta_cutoff, repetition_penalty, no_repeat_ngram_size, "
    "bad_words_ids, sequence_bias, min_length, min_new_tokens, suppress_tokens, begin_suppress_tokens, "
    "forced_bos_token_id, forced_eos_token_id, exponential_decay_length_penalty, remove_invalid_values, "
    "renormalize_logits, watermarking_config); stopping at max_new_tokens / max_length, eos_token_id or "
    "max_time; pad_token_id for finished rows"
)


def _positive(value) -> bool:
    return value is not None and value > 1


# GenerationConfig settings that select another mode than greedy or sampling (or another output):
# (name, whether the resolved config's value turns it on, what it is, the value that turns it off).
_REFUSED_SETTINGS: tuple[tuple[str, Callable[[GenerationConfig, Any], bool], str, str], ...] = (
    ("num_beams", lambda c, v: _positive(v), "beam search", "1"),
    ("num_beam_groups", lambda c, v: _positive(v) and _positive(c.num_beams), "group beam search", "1"),
    ("num_return_sequences", lambda c, v: _positive(v), "several sequences per prompt", "1"),
    ("constraints", lambda c, v: v is not None, "constrained beam search", "None"),
    ("force_words_ids", lambda c, v: v is not None, "constrained beam search", "None"),
    ("penalty_alpha", lambda c, v: v is not None and v > 0 and c.do_sample is not True and _positive(c.top_k),
     "contrastive search", "None"),
    ("prompt_lookup_num_tokens", lambda c, v: v is not None, "assisted generation (prompt lookup)", "None"),
    ("assistant_early_exit", lambda c, v: v is not None, "assisted generation (early exit)", "None"),
    ("use_mtp", lambda c, v: bool(v), "assisted generation (multi-token prediction)", "False"),
    ("dola_layers", lambda c, v: v is not None, "DoLa decoding", "None"),
    ("guidance_scale", lambda c, v: v is not None and v != 1, "classifier-free guidance, which runs the whole "
     "model a second time", "None"),
    ("stop_strings", lambda c, v: v is not None, "stop strings, which need the tokenizer; stop on eos_token_id "
     "instead", "None"),
    ("token_healing", lambda c, v: bool(v), "token healing, which rewrites the prompt with the tokenizer", "False"),
    ("return_dict_in_generate", lambda c, v: bool(v), "a GenerateOutput: the split path returns the ids only",
     "False"),
    ("cache_implementation", lambda c, v: v == "paged", "continuous batching", "None"),
)

# Arguments of `model.generate` that are no GenerationConfig setting (any other keyword would be a
# model input, which the stages do not take: they rebuild positions and masks from attention_mask).
_REFUSED_ARGUMENTS = {
    "assistant_model": "assisted generation", "assistant_tokenizer": "assisted generation",
    "tokenizer": "stop strings or token healing", "streamer": "streaming",
    "logits_processor": "custom logits processors", "stopping_criteria": "custom stopping criteria",
    "prefix_allowed_tokens_fn": "constrained decoding", "negative_prompt_ids": "classifier-free guidance",
    "negative_prompt_attention_mask": "classifier-free guidance", "custom_generate": "a custom decoding loop",
    "synced_gpus": "synchronised GPUs (DeepSpeed ZeRO-3 / FSDP)",
}
_HARMLESS_ARGUMENTS = {"trust_remote_code"}  # only for custom_generate, refused above


def resolve_generation_config(model, generation_config: GenerationConfig | None = None,
                              **kwargs) -> tuple[GenerationConfig, dict[str, Any]]:
    """The settings `model.generate` would run with (`model.generation_config`, then
    `generation_config`, then the keywords, through transformers' own helper), and the keywords
    that are no setting of a GenerationConfig."""
    # GenerationMixin's private helper: the only way to merge the configs exactly as `generate` does.
    return model._prepare_generation_config(generation_config, **kwargs)


def check_generation_mode(config: GenerationConfig, generate_kwargs: Mapping[str, Any] | None = None) -> None:
    """Refuse what `Pipeline.generate` does not run, with a ValueError naming each such setting
    and its value, and what is supported. `config`: the resolved settings
    (`resolve_generation_config`); `generate_kwargs`: the keywords that are no setting of it
    (`assistant_model`, `streamer`, `logits_processor`, ...; None or False counts as not given).

    The split loop picks one token per row at each step, by argmax or one multinomial draw, from
    the last stage's scores after transformers' logits processors; beam search, contrastive
    search, assisted and DoLa decoding, constraints, several sequences per prompt, classifier-free
    guidance, stop strings, token healing and a `GenerateOutput` would need more than that."""
    problems = [f"{name}={getattr(config, name, None)!r} ({what}; set {name}={off})"
                for name, on, what, off in _REFUSED_SETTINGS if on(config, getattr(config, name, None))]
    for name, value in (generate_kwargs or {}).items():
        if value is None or value is False or name in _HARMLESS_ARGUMENTS:
            continue
        what = _REFUSED_ARGUMENTS.get(name, "no setting of GenerationConfig: a model input, which the split "
                                            "stages do not take")
        problems.append(f"{name}={_short(value)} ({what})")
    if not problems:
        mode = config.get_generation_mode()
        if mode in SUPPORTED_MODES:
            return
        problems.append(f"generation mode {mode.value!r}")
    raise ValueError(
        f"Pipeline.generate (the model split over processes) does not support {', '.join(problems)}. "
        f"It supports {SUPPORTED_SETTINGS}. The settings are resolved as model.generate resolves them: "
        "model.generation_config, then the generation_config given, then the keywords. For other modes, "
        "generate with the whole model in one process (hf_actcomp.compressed_inference: the same codec at "
        "the boundaries). See docs/generation.md."
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"


def check_split_generation(model, generation_config: GenerationConfig | None = None,
                           **kwargs) -> GenerationConfig:
    """`check_generation_mode` of what `model.generate(..., generation_config, **kwargs)` would
    run with; returns the resolved config."""
    config, rest = resolve_generation_config(model, generation_config, **kwargs)
    check_generation_mode(config, rest)
    return config


def generation_pieces(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      generation_config: GenerationConfig | None = None, **kwargs):
    """(generation config, logits processors, stopping criteria) as `model.generate` builds them,
    through the same transformers helpers (private in transformers 5; tests/test_generation.py
    fails when they change). Refuses what the split loop does not run (`check_generation_mode`)."""
    config, rest = resolve_generation_config(model, generation_config, **kwargs)
    check_generation_mode(config, rest)
    model._prepare_special_tokens(config, True, device=input_ids.device, batch_size=input_ids.shape[0])

    def unset(name: str) -> bool:  # as `generate` decides it: neither passed nor set in a config
        return (kwargs.get(name) is None and getattr(generation_config, name, None) is None
                and getattr(model.generation_config, name, None) is None)

    config = model._prepare_generated_length(
        generation_config=config, has_default_max_length=unset("max_length"), has_default_min_length=unset("min_length"),
        model_input_name="input_ids", inputs_tensor=input_ids, input_ids_length=input_ids.shape[1],
    )
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        device=input_ids.device, logits_processor=LogitsProcessorList(),
        model_kwargs={"attention_mask": attention_mask},  # the repetition penalty skips left pads by it
    )
    stopping = model._get_stopping_criteria(generation_config=config, stopping_criteria=StoppingCriteriaList())
    return config, processors, stopping


def next_tokens(config, processors, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The next token of each row from the last position's logits, as `generate` picks it."""
    scores = processors(input_ids, logits.to(copy=True, dtype=torch.float32))
    if config.do_sample:
        return torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)
