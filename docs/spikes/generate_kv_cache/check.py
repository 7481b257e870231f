"""Greedy (and sampled) equality of spike.pipeline_generate vs model.generate on the debug models.

Usage (from this folder): OMP_NUM_THREADS=1 ../../../.venv/bin/python check.py [family ...]
"""

from __future__ import annotations

import sys
import traceback

import torch



from hf_actcomp.debug import debug_model  # noqa: E402
from spike import pipeline_generate  # noqa: E402

torch.set_num_threads(1)
FAMILIES = ["llama", "gpt2", "opt", "gemma2", "gemma3_text", "qwen3", "phi3", "mixtral", "mistral", "qwen2", "olmo2"]


def prompts(model, lengths=(9, 5, 2), seed=1):
    g = torch.Generator().manual_seed(seed)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    L, B = max(lengths), len(lengths)
    ids = torch.full((B, L), pad, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, L - n:] = torch.randint(3, model.config.vocab_size - 1, (n,), generator=g)
        mask[b, L - n:] = 1
    return ids, mask


def run(family, stages_list=(1, 2, 3), new=8, sample=True):
    model = debug_model(family).eval()
    ids, mask = prompts(model)
    out = {}
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    for s in stages_list:
        got = pipeline_generate(model, s, ids, mask, max_new_tokens=new, do_sample=False)
        out[f"greedy/{s}"] = torch.equal(ref, got)
        if not out[f"greedy/{s}"]:
            print(family, s, "REF", ref[:, ids.shape[1]:].tolist(), "GOT", got[:, ids.shape[1]:].tolist())
    # no padding at all (generate drops the mask)
    ids1, mask1 = ids[:1], mask[:1]
    ref1 = model.generate(ids1, attention_mask=mask1, max_new_tokens=new, do_sample=False)
    out["nopad/2"] = torch.equal(ref1, pipeline_generate(model, 2, ids1, mask1, max_new_tokens=new, do_sample=False))
    # long generation past the sliding window / longer than prompt
    ref2 = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    out["greedy24/3"] = torch.equal(ref2, pipeline_generate(model, 3, ids, mask, max_new_tokens=24, do_sample=False))
    if sample:
        kw = dict(max_new_tokens=new, do_sample=True, temperature=0.7, top_k=50, top_p=0.9)
        torch.manual_seed(123)
        refs = model.generate(ids, attention_mask=mask, **kw)
        torch.manual_seed(123)
        gots = pipeline_generate(model, 2, ids, mask, **kw)
        out["sample/2"] = torch.equal(refs, gots)
    return out


if __name__ == "__main__":
    fams = sys.argv[1:] or FAMILIES
    for f in fams:
        try:
            print(f, run(f), flush=True)
        except Exception:
            print(f, "ERROR")
            traceback.print_exc()
