"""Compute per micro-batch of a real-size pipeline stage, and what that means on 100 Mbit/s and 1 Gbit/s.

Each stage of the plan's default split (the first with the embedding, the last with the head and
loss) is timed forward + backward on one micro-batch, in the model's dtype on the chosen device
(median of `--repeats` after two warm-ups). Models: SmolLM2-135M's shapes and a Llama-3.2-1B-shaped
config, random weights (the time does not depend on their values).

From those times and each plan's exact payload sizes, the step time of 1F1B with M micro-batches
is worked out, not measured: every stage and both directions of every link are separate
resources that overlap perfectly, so a step takes the pipeline's fill and drain plus (M - 1) times
its slowest resource per micro-batch:

    step = (M - 1) * max(max_s (f_s + b_s), link_fw, link_bw) + sum_s (f_s + b_s) + (S - 1) * (link_fw + link_bw)

Labelled arithmetic in the results: a real link adds latency, TCP ramp-up and jitter.

    python benchmarks/stage_compute.py --device cuda            # writes stage_compute_cuda.{json,md}
    python benchmarks/stage_compute.py --device cpu --quick     # checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import write_markdown  # noqa: E402

from hf_actcomp import Compression, Plan  # noqa: E402
from hf_actcomp.feedback import build_codec  # noqa: E402
from hf_actcomp.models.registry import get_adapter  # noqa: E402
from hf_actcomp.models.split import stage_ranges  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

MODELS = {
    "SmolLM2-135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    "Llama-3.2-1B shapes": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                                max_position_embeddings=8192, rms_norm_eps=1e-5),
}

# Boundary codecs as (label, forward, backward); None: the activations' own dtype, uncompressed.
PLANS = [
    ("uncompressed", None, None),
    ("hadamard fw4 / bw8", Compression("hadamard", bits=4), Compression("quantize", bits=8)),
    ("AQ-SGD fw4 / bw8 (steady state)", Compression("quantize", bits=4), Compression("quantize", bits=8)),
    ("AQ-SGD fw2 / bw4 (steady state)", Compression("quantize", bits=2), Compression("quantize", bits=4)),
]
LINKS = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stage_times(model, stages: int, batch: int, seq_len: int, repeats: int, device: torch.device) -> list[dict]:
    """Forward and backward ms of each stage on one micro-batch (the stage's input as a leaf)."""
    adapter = get_adapter(model)
    ranges = stage_ranges(adapter, Plan(num_stages=stages))
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)
    dtype = next(model.parameters()).dtype
    rows = []
    for s, blocks in enumerate(ranges):
        def forward(s=s, blocks=blocks):
            if s == 0:
                hidden = adapter.embed(ids, None)
            else:
                hidden = torch.randn(batch, seq_len, model.config.hidden_size, device=device, dtype=dtype,
                                     requires_grad=True)
            context = adapter.block_context(hidden, None)
            for k in blocks:
                hidden = adapter.run_block(k, hidden, context)
            if s == stages - 1:
                logits = adapter.head(hidden)
                return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            return hidden

        forward_ms, backward_ms = [], []
        for i in range(repeats + 2):
            sync(device)
            start = time.perf_counter()
            out = forward()
            sync(device)
            middle = time.perf_counter()
            out.backward(torch.ones_like(out) if out.dim() else None)
            sync(device)
            end = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if i >= 2:
                forward_ms.append((middle - start) * 1e3)
                backward_ms.append((end - middle) * 1e3)
        rows.append(dict(stage=s, blocks=[blocks.start, blocks.stop], forward_ms=statistics.median(forward_ms),
                         backward_ms=statistics.median(backward_ms),
                         spread_ms=max(f + b for f, b in zip(forward_ms, backward_ms, strict=True))
                         - min(f + b for f, b in zip(forward_ms, backward_ms, strict=True))))
    return rows


def payload_bytes(compression: Compression | None, shape: tuple, dtype: torch.dtype) -> int:
    if compression is None:
        return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return build_codec(compression).payload_nbytes(shape, dtype)


def step_seconds(stages: list[dict], micro_batches: int, fw_bytes: int, bw_bytes: int, bits_per_second: float) -> float:
    """The module docstring's arithmetic: 1F1B with perfectly overlapped stages and links."""
    compute = [(r["forward_ms"] + r["backward_ms"]) / 1e3 for r in stages]
    link_fw, link_bw = 8 * fw_bytes / bits_per_second, 8 * bw_bytes / bits_per_second
    slowest = max(max(compute), link_fw, link_bw)
    return (micro_batches - 1) * slowest + sum(compute) + (len(stages) - 1) * (link_fw + link_bw)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=8, help="rows per micro-batch")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny shapes on 2 stages: checks the script")
    p.add_argument("--name", default=None, help="results file name (default stage_compute_<device>)")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.stages, args.batch, args.seq_len, args.repeats = ["SmolLM2-135M"], [2], 1, 64, 1
    from transformers import LlamaConfig, LlamaForCausalLM

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    results = []
    for name in args.models:
        config = LlamaConfig(**MODELS[name])
        with device:  # initialised where it runs: a 1B model's random init is slow on the host
            model = LlamaForCausalLM(config).to(dtype=dtype)
        shape = (args.batch, args.seq_len, config.hidden_size)
        for stages in args.stages:
            rows = stage_times(model, stages, args.batch, args.seq_len, args.repeats, device)
            plans = []
            for label, fw, bw in PLANS:
                fw_bytes, bw_bytes = payload_bytes(fw, shape, dtype), payload_bytes(bw, shape, dtype)
                plans.append(dict(plan=label, forward_bytes=fw_bytes, backward_bytes=bw_bytes,
                                  step_s={link: step_seconds(rows, args.micro_batches, fw_bytes, bw_bytes, bps)
                                          for link, bps in LINKS.items()}))
            compute_only = step_seconds(rows, args.micro_batches, 0, 0, 1.0)
            results.append(dict(model=name, stages=stages, stage_times=rows, plans=plans, compute_only_s=compute_only))
            print(f"{name}, {stages} stages: " + ", ".join(f"stage {r['stage']} {r['forward_ms']:.1f}+{r['backward_ms']:.1f} ms"
                                                          for r in rows), flush=True)
        del model
    meta = dict(device=args.device, dtype=args.dtype, torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if device.type == "cuda" else None, batch=args.batch,
                seq_len=args.seq_len, micro_batches=args.micro_batches, repeats=args.repeats)
    name = args.name or f"stage_compute_{args.device}"
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    where = meta["gpu"] or f"{torch.get_num_threads()} CPU threads"
    lines = [f"# Compute per stage on {where} ({args.dtype}) and the step it implies on slow links", "",
             f"`benchmarks/stage_compute.py`: micro-batches of {args.batch} x {args.seq_len} tokens, forward + backward "
             f"of each stage of the default split, median of {args.repeats} after 2 warm-ups (measured). Step times "
             f"on links: **arithmetic**, not measured: 1F1B with {args.micro_batches} micro-batches, stages and "
             "link directions overlapping perfectly (the formula in the script's docstring), no latency.", "",
             "| model | stages | compute per stage, ms (fw + bw) | plan | bytes fw / bw per micro-batch | "
             "step, compute only | step at 100 Mbit/s | at 1 Gbit/s | speed-up vs uncompressed at 100 Mbit/s | at 1 Gbit/s |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        compute = ", ".join(f"{s['forward_ms']:.1f} + {s['backward_ms']:.1f}" for s in r["stage_times"])
        base = r["plans"][0]["step_s"]
        for plan in r["plans"]:
            lines.append(f"| {r['model']} | {r['stages']} | {compute} | {plan['plan']} | "
                         f"{plan['forward_bytes'] / 1e6:.2f} MB / {plan['backward_bytes'] / 1e6:.2f} MB | "
                         f"{r['compute_only_s'] * 1e3:.0f} ms | {plan['step_s']['100 Mbit/s']:.2f} s | "
                         f"{plan['step_s']['1 Gbit/s']:.3f} s | {base['100 Mbit/s'] / plan['step_s']['100 Mbit/s']:.2f}x | "
                         f"{base['1 Gbit/s'] / plan['step_s']['1 Gbit/s']:.2f}x |")
    write_markdown(RESULTS, name, lines)


if __name__ == "__main__":
    main()
