"""Encode + decode throughput of every codec on activation-sized tensors, in one run.

Side by side with the memory-bound floor (a plain tensor copy) and, for the sparsifiers, a full
`torch.topk` at the same k. Also relative error ||x - x_hat|| / ||x|| and bits per element.

    .venv/bin/python benchmarks/codecs.py [--device cuda] [--repeats 5]

Writes benchmarks/results/codecs_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from hf_actcomp.codecs import make_codec
from hf_actcomp.codecs.sparsify import keep_count

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

CASES = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("quantize", dict(bits=2)),
    ("quantize", dict(bits=4)),
    ("quantize", dict(bits=4, rounding="stochastic")),
    ("quantize", dict(bits=4, granularity="channel")),
    ("quantize", dict(bits=8)),
    ("topk", dict(ratio=0.01)),
    ("topk", dict(ratio=0.1)),
    ("topk", dict(ratio=0.3)),
    ("randk", dict(ratio=0.1)),
]


def timed(fn, repeats: int, device: str) -> float:
    """Median wall time in ms of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench(shape, dtype, device, repeats) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(shape, device=device).to(dtype)
    n = x.numel()
    nbytes = n * x.element_size()
    # The floor is short and page-fault sensitive: more repeats keep one slow call from setting it.
    copy_ms = timed(lambda: x.clone(), max(4 * repeats, 20), device)
    rows = [dict(codec="copy (floor)", params="", dtype=str(dtype).replace("torch.", ""), ms_encode=copy_ms,
                 ms_decode=0.0, ms_total=copy_ms, x_copy=1.0, gb_per_s=nbytes / copy_ms / 1e6,
                 bits_per_element=8.0 * x.element_size(), relative_error=0.0)]
    for name, params in CASES:
        encoder, decoder = make_codec(name, **params), make_codec(name, **params)
        payload = encoder.encode(x)
        # randk's index stream advances per call: keep both sides in step for the error measure.
        out = decoder.decode(payload, x.shape, x.dtype)
        rel = float((x.float() - out.float()).norm() / x.float().norm())
        enc_ms = timed(lambda e=encoder: e.encode(x), repeats, device)
        dec_ms = timed(lambda d=decoder, p=payload: d.decode(p, x.shape, x.dtype), repeats, device)
        total = enc_ms + dec_ms
        rows.append(dict(
            codec=name, params=",".join(f"{k}={v}" for k, v in params.items()),
            dtype=str(dtype).replace("torch.", ""), ms_encode=enc_ms, ms_decode=dec_ms, ms_total=total,
            x_copy=total / copy_ms, gb_per_s=nbytes / total / 1e6,
            bits_per_element=8.0 * payload.numel() / n, relative_error=rel,
        ))
        if name == "topk":
            k = keep_count(params["ratio"], n)
            flat = x.reshape(-1)
            full_ms = timed(lambda f=flat, k=k: torch.topk(f.abs(), k, sorted=False), repeats, device)
            rows.append(dict(
                codec="torch.topk (full)", params=f"ratio={params['ratio']}", dtype=rows[-1]["dtype"],
                ms_encode=full_ms, ms_decode=0.0, ms_total=full_ms, x_copy=full_ms / copy_ms,
                gb_per_s=nbytes / full_ms / 1e6, bits_per_element=float("nan"), relative_error=rel,
            ))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shape", type=int, nargs="+", default=[8, 1024, 768])
    args = p.parse_args(argv)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows += bench(tuple(args.shape), dtype, args.device, args.repeats)
    meta = dict(device=args.device, shape=args.shape, torch=torch.__version__, threads=torch.get_num_threads(),
                machine=platform.machine(), cpu_count=os.cpu_count(),
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"codecs_{args.device}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    header = "| codec | params | dtype | encode ms | decode ms | total ms | x copy time | GB/s | bits/elem | rel. error |"
    where = meta["gpu"] or f"{meta['threads']} threads"
    lines = [f"Tensor {tuple(args.shape)} on {args.device} ({where}), "
             f"median of {args.repeats}, torch {torch.__version__}.", "", header, "|---" * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['codec']} | {r['params']} | {r['dtype']} | {r['ms_encode']:.2f} | {r['ms_decode']:.2f} | "
                     f"{r['ms_total']:.2f} | {r['x_copy']:.1f}x | {r['gb_per_s']:.2f} | {r['bits_per_element']:.3f} | "
                     f"{r['relative_error']:.4f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
