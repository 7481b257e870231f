"""Per-step raw logits of the pipeline vs generate(output_logits=True): bitwise equal? max |diff|.
Also the same with positions 0..L-1 (negative control for learned absolute positions)."""
import sys
import torch

import spike
from check import prompts
from hf_actcomp.debug import debug_model
torch.set_num_threads(1)

def cmp(model, s, ids, mask, new):
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    got, raw = spike.pipeline_generate(model, s, ids, mask, return_logits=True, max_new_tokens=new, do_sample=False)
    bit = len(raw) == len(ref.logits) and all(torch.equal(a, b) for a, b in zip(raw, ref.logits))
    diff = max((a - b).abs().max().item() for a, b in zip(raw, ref.logits))
    return torch.equal(got, ref.sequences), bit, diff

for fam in sys.argv[1:] or ["llama", "gpt2", "opt", "gemma2", "gemma3_text", "qwen3", "phi3", "mixtral", "mistral", "qwen2", "olmo2"]:
    model = debug_model(fam).eval()
    ids, mask = prompts(model)
    row = {s: cmp(model, s, ids, mask, 12) for s in (1, 2, 3, 4)}
    orig = spike.positions_from_mask
    spike.positions_from_mask = lambda m: torch.arange(m.shape[1]).expand(m.shape[0], -1)
    row["arange/2"] = cmp(model, 2, ids, mask, 12)
    spike.positions_from_mask = orig
    orig_idx = spike.CachedStage._mask_layer_idx
    spike.CachedStage._mask_layer_idx = lambda self, kind: None
    try:
        row["default_idx/3"] = cmp(model, 3, ids, mask, 12)
    except Exception as e:
        row["default_idx/3"] = f"error {type(e).__name__}"
    spike.CachedStage._mask_layer_idx = orig_idx
    print(fam, "(tokens_equal, logits_bitwise_equal, max_abs_diff):", row, flush=True)
