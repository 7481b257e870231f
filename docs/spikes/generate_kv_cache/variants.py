"""Variants: positions rebuilt inside each stage from the 2-D mask alone; never dropping an
all-ones mask; bf16 models. Logits compared bitwise with generate(output_logits=True)."""
import sys
import torch

import spike
from check import prompts
from hf_actcomp.debug import debug_model
torch.set_num_threads(1)

def cmp(model, s, ids, mask, new=12, **kw):
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    got, raw = spike.pipeline_generate(model, s, ids, mask, return_logits=True, max_new_tokens=new,
                                       do_sample=False, **kw)
    return torch.equal(got, ref.sequences) and all(torch.equal(a, b) for a, b in zip(raw, ref.logits))

for fam in sys.argv[1:] or ["llama", "gpt2", "opt", "gemma2", "gemma3_text", "qwen3", "phi3", "mixtral"]:
    m = debug_model(fam).eval(); ids, mask = prompts(m)
    r = {}
    r["stagepos/3"] = cmp(m, 3, ids, mask, stage_positions=True)
    r["nopad_stagepos/3"] = cmp(m, 3, ids[:1], mask[:1], stage_positions=True)
    r["nopad_keepmask/3"] = cmp(m, 3, ids[:1], mask[:1], stage_positions=True, drop_all_ones_mask=False)
    mb = debug_model(fam, dtype=torch.bfloat16).eval() if True else None
    r["bf16/3"] = cmp(mb, 3, ids, mask)
    r["bf16_dtype"] = str(next(mb.parameters()).dtype)
    print(fam, r, flush=True)
