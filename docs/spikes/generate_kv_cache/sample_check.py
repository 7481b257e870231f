"""Sampling: same seed -> same tokens as model.generate(do_sample=True), several processor sets, 3 stages."""
import sys
import torch

import spike
from check import prompts
from hf_actcomp.debug import debug_model
torch.set_num_threads(1)
CFGS = {
    "t0.7_k50_p0.9": dict(temperature=0.7, top_k=50, top_p=0.9),
    "t1.3_k0": dict(temperature=1.3, top_k=0),
    "rep1.3_min4_eos": dict(temperature=1.0, top_k=20, repetition_penalty=1.3, min_new_tokens=4, eos_token_id=[7, 9, 11, 13], pad_token_id=0),
    "minp0.1": dict(min_p=0.1, top_k=0),
}
for fam in sys.argv[1:] or ["llama", "gpt2", "opt", "gemma2", "gemma3_text", "qwen3", "phi3", "mixtral"]:
    m = debug_model(fam).eval(); ids, mask = prompts(m)
    row = {}
    for name, kw in CFGS.items():
        kw = dict(kw, max_new_tokens=16, do_sample=True)
        torch.manual_seed(7); ref = m.generate(ids, attention_mask=mask, **kw)
        torch.manual_seed(7); got = spike.pipeline_generate(m, 3, ids, mask, **kw)
        row[name] = torch.equal(ref, got) if ref.shape == got.shape else f"shape {tuple(ref.shape)} vs {tuple(got.shape)}"
    _, procs, stops = spike.build_generation_pieces(m, ids, mask, **dict(CFGS["rep1.3_min4_eos"], max_new_tokens=16, do_sample=True))
    print(fam, row, flush=True)
print("processors for rep1.3_min4_eos:", [type(p).__name__ for p in procs], "stops:", [type(s).__name__ for s in stops])
