"""Spike for issue #26: Pipeline.generate with per-stage KV caches (prototype, not product code).

Each CachedStage holds blocks [start, stop) of a model, its own transformers.DynamicCache
(built from the config, so sliding layers are DynamicSlidingWindowLayer), and rebuilds its block
context (positions, masks, rotary) from the full 2-D attention mask + the new tokens' positions.
Only hidden states of the NEW tokens cross stage boundaries.
"""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask


from hf_actcomp.models.decoder import FULL, SLIDING, DecoderAdapter  # noqa: E402  (read-only use)

SCORES: list = []  # debug: processed scores of the last run
MASK_FN = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}


def positions_from_mask(mask2d: torch.Tensor) -> torch.Tensor:
    """What generate does (_prepare_position_ids_for_generation): cumsum-1, pads -> 0."""
    pos = mask2d.long().cumsum(-1) - 1
    return pos.masked_fill(mask2d == 0, 0)


class CachedStage:
    def __init__(self, model, start: int, stop: int, *, first: bool, last: bool):
        self.model, self.config = model, model.config
        self.start, self.stop, self.first, self.last = start, stop, first, last
        self.family = model.config.model_type
        self.cache = DynamicCache(config=model.config)  # all layers listed, only ours get filled
        if self.family not in ("gpt2", "opt"):
            self.adapter = DecoderAdapter(model)

    # -- which cache layer sizes the mask -----------------------------------------------------
    def _mask_layer_idx(self, kind: str) -> int:
        """Pitfall: create_*_mask picks the FIRST full/sliding layer of the WHOLE cache (a global
        index); in a later stage that layer belongs to another stage and is empty -> kv sizes 0.
        Pick the first layer of this stage whose cache layer has the right type instead."""
        want_sliding = kind == SLIDING
        for i in range(self.start, self.stop):
            if bool(self.cache.is_sliding[i]) == want_sliding:
                return i
        return self.start

    # -- forward --------------------------------------------------------------------------------
    def positions(self, q_len: int, mask2d):
        """Positions of the q_len new tokens from the 2-D mask alone (what generate passes), or,
        without a mask, past length + arange (past read from one of THIS stage's cache layers)."""
        if mask2d is not None:
            return positions_from_mask(mask2d)[:, -q_len:]
        past = self.cache.layers[self.start].get_seq_length() if self.stop > self.start else 0
        return (torch.arange(q_len) + past).unsqueeze(0)

    def __call__(self, x, mask2d, position_ids=None):
        """x: new input_ids (first) or new hidden states; mask2d: (B, past+new) 2-D mask, or None
        when generate would drop it (no padding at all); position_ids: (B, new)."""
        if position_ids is None:
            position_ids = self.positions(x.shape[1], mask2d)
        fam = self.family
        if fam == "gpt2":
            return self._gpt2(x, mask2d, position_ids)
        if fam == "opt":
            return self._opt(x, mask2d, position_ids)
        return self._decoder(x, mask2d, position_ids)

    def _decoder(self, x, mask2d, pos):
        a, m = self.adapter, self.model
        h = a._module(a.embed_path)(x) if self.first else x
        kinds = {a.layer_mask_kind(i) for i in range(self.start, self.stop)}
        masks = {
            k: MASK_FN[k](config=self.config, inputs_embeds=h, attention_mask=mask2d, cache=self.cache,
                          position_ids=pos, layer_idx=self._mask_layer_idx(k))
            for k in kinds
        }
        rotary = a._module(a.rotary_path)
        if a._rotary_per_layer_type():
            pe = {k: rotary(h, pos, k) for k in kinds}
        else:
            t = rotary(h, position_ids=pos)
            pe = {k: t for k in kinds}
        for i in range(self.start, self.stop):
            k = a.layer_mask_kind(i)
            h = a.blocks()[i](h, attention_mask=masks[k], position_embeddings=pe[k], position_ids=pos,
                              cache=self.cache, use_cache=True)
        if not self.last:
            return h
        # generate passes logits_to_keep=1: head on the last position only (bitwise the same as HF)
        return a.head(h[:, -1:, :])

    def _gpt2(self, x, mask2d, pos):
        t = self.model.transformer
        if self.first:
            e = t.wte(x)
            h = t.drop(e + t.wpe(pos).to(e.device))
        else:
            h = x
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=mask2d,
                                  cache=self.cache, position_ids=pos, layer_idx=self._mask_layer_idx(FULL))
        for i in range(self.start, self.stop):
            h = t.h[i](h, self.cache, mask, None, encoder_attention_mask=None, use_cache=True,
                       position_ids=pos)
        if not self.last:
            return h
        return self.model.lm_head(t.ln_f(h[:, -1:, :]))

    def _opt(self, x, mask2d, pos):
        d = self.model.model.decoder
        if self.first:
            e = d.embed_tokens(x)
            # generate passes position_ids (cumsum-1, pads->0) so OPT's own cumsum is bypassed;
            # embed_positions adds its +2 offset.
            pm = mask2d if mask2d is not None else torch.ones(x.shape[0], 1)  # only shape used
            pe = d.embed_positions(pm, 0, position_ids=pos)
            if d.project_in is not None:
                e = d.project_in(e)
            h = e + pe.to(e.device)
        else:
            h = x
        # OPT builds its causal mask WITHOUT position_ids
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=mask2d,
                                  cache=self.cache, layer_idx=self._mask_layer_idx(FULL))
        for i in range(self.start, self.stop):
            h = d.layers[i](h, attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True)
        if not self.last:
            return h
        if d.final_layer_norm is not None:
            h = d.final_layer_norm(h)
        if d.project_out is not None:
            h = d.project_out(h)
        return self.model.lm_head(h[:, -1:, :])


def split_points(n_blocks: int, n_stages: int) -> list[tuple[int, int]]:
    base, extra = divmod(n_blocks, n_stages)
    out, s = [], 0
    for r in range(n_stages):
        e = s + base + (1 if r < extra else 0)
        out.append((s, e))
        s = e
    return out


def build_generation_pieces(model, input_ids, attention_mask=None, **gen_kwargs):
    """LogitsProcessorList + StoppingCriteriaList + prepared GenerationConfig outside generate,
    through the same private helpers generate calls (transformers 5.24)."""
    gen_cfg, _ = model._prepare_generation_config(None, **gen_kwargs)
    model._prepare_special_tokens(gen_cfg, True, device=input_ids.device, batch_size=input_ids.shape[0])
    gen_cfg = model._prepare_generated_length(
        generation_config=gen_cfg,
        has_default_max_length=gen_kwargs.get("max_length") is None and gen_kwargs.get("max_new_tokens") is None,
        has_default_min_length=gen_kwargs.get("min_length") is None and gen_kwargs.get("min_new_tokens") is None,
        model_input_name="input_ids",
        inputs_tensor=input_ids,
        input_ids_length=input_ids.shape[1],
    )
    procs = model._get_logits_processor(
        generation_config=gen_cfg, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        device=input_ids.device, logits_processor=LogitsProcessorList(),
        # PITFALL: RepetitionPenaltyLogitsProcessor reads the 2-D mask from model_kwargs to skip left pads
        model_kwargs={"attention_mask": attention_mask},
    )
    stops = model._get_stopping_criteria(generation_config=gen_cfg, stopping_criteria=StoppingCriteriaList())
    return gen_cfg, procs, stops


@torch.no_grad()
def pipeline_generate(model, n_stages, input_ids, attention_mask, return_logits=False, stage_positions=False,
                      drop_all_ones_mask=True, ranges=None, boundary_fns=None, **gen_kwargs):
    """The loop of GenerationMixin._sample, with the forward replaced by the stage chain."""
    gen_cfg, procs, stops = build_generation_pieces(model, input_ids, attention_mask, **gen_kwargs)
    n = model.config.num_hidden_layers
    ranges = ranges or split_points(n, n_stages)
    n_stages = len(ranges)
    stages = [CachedStage(model, s, e, first=r == 0, last=r == n_stages - 1) for r, (s, e) in enumerate(ranges)]

    pad = gen_cfg._pad_token_tensor
    has_eos = any(hasattr(c, "eos_token_id") for c in stops)
    B = input_ids.shape[0]
    unfinished = torch.ones(B, dtype=torch.long)
    pos_all = positions_from_mask(attention_mask)
    # generate drops an all-ones mask (then masks are causal-only; same result, different path)
    mask = None if drop_all_ones_mask and bool((attention_mask == 1).all()) else attention_mask
    x, pos = input_ids, pos_all
    raw = []
    SCORES.clear()
    while True:
        h = x
        for r, st in enumerate(stages):  # in a real pipeline: send/recv of h between ranks
            h = st(h, mask, None if stage_positions else pos)
            if boundary_fns is not None and r < n_stages - 1:
                h = boundary_fns[r](h)  # encode+decode, as the codec would on the wire
        logits = h[:, -1].to(copy=True, dtype=torch.float32)
        raw.append(logits)
        scores = procs(input_ids, logits)
        SCORES.append(scores.clone())
        if gen_cfg.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            nxt = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            nxt = torch.argmax(scores, dim=-1)
        if has_eos:
            nxt = nxt * unfinished + pad * (1 - unfinished)
        input_ids = torch.cat([input_ids, nxt[:, None]], dim=-1)
        unfinished = unfinished & ~stops(input_ids, None)
        if unfinished.max() == 0:
            break
        # next step: only the new token; mask grows by a column of ones; position = last + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((B, 1))], dim=-1)
        pos = pos[:, -1:] + 1
        x = nxt[:, None]
    return (input_ids, raw) if return_logits else input_ids
