"""With a lossy codec: Pipeline-style generate (codec on each new token's hidden state at each
boundary) vs hf_actcomp.compressed_inference(model, plan).generate (hooks on the unsplit model)."""
import sys
import torch

import spike
from check import prompts
from hf_actcomp import Compression, Plan, compressed_inference, get_adapter
from hf_actcomp.models.split import stage_ranges
from hf_actcomp.debug import debug_model
torch.set_num_threads(1)

codecs = {"none": Compression("none"), "quantize4": Compression("quantize", bits=4),
          "hadamard4": Compression("hadamard", bits=4), "topk0.3": Compression("topk", ratio=0.3)}
for fam in sys.argv[1:] or ["llama", "gpt2", "opt", "gemma2", "gemma3_text", "qwen3", "phi3", "mixtral"]:
    m = debug_model(fam).eval(); ids, mask = prompts(m)
    row = {}
    for name, comp in codecs.items():
        plan = Plan(num_stages=3, forward=comp)
        rs = [(r.start, r.stop) for r in stage_ranges(get_adapter(m), plan)]
        with compressed_inference(m, plan) as inf:
            ref = inf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
            fns = [b.inference_transfer for b in inf.boundaries.values()]
            with torch.no_grad():
                got = spike.pipeline_generate(m, 3, ids, mask, ranges=rs, boundary_fns=fns,
                                              max_new_tokens=12, do_sample=False)
        plain = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        row[name] = (torch.equal(ref, got), torch.equal(plain, got))
    print(fam, rs, "(== compressed_inference.generate, == plain generate):", row, flush=True)
