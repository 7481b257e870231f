"""Does the eos sampling case actually stop rows early (pads after eos)?"""
import sys, torch

import spike
from check import prompts
from hf_actcomp.debug import debug_model
kw = dict(temperature=1.0, top_k=20, repetition_penalty=1.3, min_new_tokens=4, eos_token_id=[7, 9, 11, 13], pad_token_id=0, max_new_tokens=16, do_sample=True)
for fam in ["llama", "gpt2", "opt", "gemma2", "gemma3_text", "qwen3", "phi3", "mixtral"]:
    m = debug_model(fam).eval(); ids, mask = prompts(m)
    hits = 0
    for seed in range(6):
        torch.manual_seed(seed); ref = m.generate(ids, attention_mask=mask, **kw)
        torch.manual_seed(seed); got = spike.pipeline_generate(m, 3, ids, mask, **kw)
        new = ref[:, ids.shape[1]:]
        hit = bool(torch.isin(new, torch.tensor([7, 9, 11, 13])).any())
        hits += hit
        assert torch.equal(ref, got), (fam, seed)
    print(fam, "6 seeds equal; seeds with an eos hit:", hits, flush=True)
