"""Negative controls and extra cases for the spike: show that the checks in check.py can fail.

1. default layer_idx (what create_*_mask picks without it) -> later stages size masks from an
   EMPTY cache layer of another stage.
2. positions 0..L-1 (ignoring left padding) instead of cumsum(mask)-1.
3. eos hit mid-generation (pad after eos, early stop), per family.
4. eager attention for an sdpa family.
"""

from __future__ import annotations

import sys

import torch



import spike  # noqa: E402
from check import prompts  # noqa: E402
from hf_actcomp.debug import debug_model  # noqa: E402

torch.set_num_threads(1)
FAMS = ["llama", "gpt2", "opt", "gemma2", "gemma3_text", "qwen3", "phi3", "mixtral"]


def greedy_eq(model, stages, ids, mask, new=8, **kw):
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kw)
    try:
        got = spike.pipeline_generate(model, stages, ids, mask, max_new_tokens=new, do_sample=False, **kw)
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}: {str(e)[:80]}"
    return torch.equal(ref, got), ref[:, ids.shape[1]:].tolist()


if __name__ == "__main__":
    orig_idx = spike.CachedStage._mask_layer_idx
    for fam in FAMS:
        model = debug_model(fam).eval()
        ids, mask = prompts(model)
        res = {}
        ok, toks = greedy_eq(model, 2, ids, mask)
        res["baseline/2"] = ok
        # 1. default (global) layer_idx
        spike.CachedStage._mask_layer_idx = lambda self, kind: None
        r = greedy_eq(model, 2, ids, mask)
        res["default_layer_idx/2"] = r if isinstance(r, str) else r[0]
        spike.CachedStage._mask_layer_idx = orig_idx
        # 2. positions ignoring padding
        orig_pos = spike.positions_from_mask
        spike.positions_from_mask = lambda m: torch.arange(m.shape[1]).expand(m.shape[0], -1)
        res["arange_positions/2"] = greedy_eq(model, 2, ids, mask)[0]
        spike.positions_from_mask = orig_pos
        # 3. eos mid-generation: make the 3rd generated token of row 0 the eos
        eos = toks[0][2]
        r = greedy_eq(model, 2, ids, mask, new=8, eos_token_id=eos, pad_token_id=0)
        res[f"eos={eos}/2"] = r[0]
        res["eos_tokens"] = r[1]
        print(fam, "tokens(row0..2)=", toks, flush=True)
        print(fam, res, flush=True)
    # 4. eager attention
    for fam in ("llama", "qwen3", "phi3"):
        model = debug_model(fam, attn_implementation="eager").eval()
        ids, mask = prompts(model)
        print(fam, "eager", {s: greedy_eq(model, s, ids, mask, new=20)[0] for s in (2, 3)}, flush=True)
