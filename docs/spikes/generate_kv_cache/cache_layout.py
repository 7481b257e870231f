"""Per family: adapter mask kind per layer vs DynamicCache(config) layer type (is_sliding)."""
import sys

from transformers import DynamicCache
from hf_actcomp.debug import debug_model
from hf_actcomp.models.decoder import DecoderAdapter
for fam in ["llama", "gpt2", "opt", "gemma2", "gemma3_text", "qwen3", "phi3", "mixtral", "mistral", "qwen2", "olmo2"]:
    m = debug_model(fam)
    c = DynamicCache(config=m.config)
    kinds = [DecoderAdapter(m).layer_mask_kind(i)[:4] for i in range(4)] if fam not in ("gpt2", "opt") else ["full"] * 4
    print(f"{fam:12s} adapter={kinds} cache={[type(l).__name__ for l in c.layers]} window={getattr(m.config,'sliding_window',None)} attn={m.config._attn_implementation}")
