"""Encode + decode throughput of every codec on activation-sized tensors, in one run.

Side by side with the memory-bound floor (a plain tensor copy) and, for the sparsifiers, a full
`torch.topk` at the same k. Also relative error ||x - x_hat|| / ||x|| and bits per element.

    .venv/bin/python benchmarks/codecs.py [--device cuda] [--repeats 5]
    .venv/bin/python benchmarks/codecs.py --codecs quantize hadamard --repeats 9 --name codecs_cpu_hadamard
    .venv/bin/python benchmarks/codecs.py --outliers
    python benchmarks/codecs.py --device cuda --shape 8 1024 4096 --compile --name codecs_cuda_8x1024x4096

Writes benchmarks/results/codecs_<device>.{json,md}. With `--outliers`, instead: the relative
error and bits per element of each scaling (group, per-token, per-channel, Hadamard rotation) on
activations with outlier channels (8 of 1024 channels x40, as real LLMs have) and on the real
boundary activations and gradients of a small GPT-2 pre-trained on CPython's docs, written to
benchmarks/results/codecs_outliers.{json,md}.
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
from hf_actcomp.codecs.fused import fuse, fusible
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
    ("hadamard", dict(bits=3)),
    ("hadamard", dict(bits=4)),
    ("hadamard_outliers", dict(bits=4)),
    ("hadamard_outliers", dict(bits=6)),
    ("hadamard_codebook", dict(levels=11)),
    ("hadamard_vq", dict(levels=64)),
    ("hadamard_vq", dict(levels=128)),
    ("lowrank", dict(rank=4)),  # for AQ-SGD's drift deltas: its error on an activation says nothing
]

# Scalings compared on tensors with outlier channels: the name, the codec and its parameters.
SCALINGS = [
    ("group of 128 (default)", "quantize", {}),
    ("group of 64", "quantize", dict(group_size=64)),
    ("per token", "quantize", dict(group_size=None)),  # one scale per hidden vector
    ("per channel", "quantize", dict(granularity="channel")),
    ("Hadamard, tiles of 64", "hadamard", dict(group_size=64)),
    ("Hadamard, tiles of 64, widths by spread", "hadamard", dict(group_size=64, boost_fraction=0.25)),
    ("Hadamard, tiles of 128 (default)", "hadamard", dict(group_size=128)),
    ("Hadamard, tiles of 128, widths by spread", "hadamard", dict(group_size=128, boost_fraction=0.25)),
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


# The cases `--compile` also times compiled: the deterministic quantizers the plans use.
COMPILED = [("quantize", dict(bits=4)), ("quantize", dict(bits=8)), ("hadamard", dict(bits=4)),
            ("hadamard_outliers", dict(bits=4)), ("hadamard_codebook", dict(levels=11))]


def compiled_row(name, params, x, payload, out, repeats, device) -> dict:
    """The codec compiled as `compile=True` compiles it (`fuse`: FUSIBLE's methods; any other codec's
    encode and decode whole), timed; whether the payload is the eager one bit for bit, and how far
    the decoded tensor is from eager's (fused multiply-adds round differently; AQ-SGD needs only
    that sender and receiver decode alike)."""
    encoder, decoder = make_codec(name, **params), make_codec(name, **params)
    if fusible(encoder):
        encode, decode = fuse(encoder).encode, fuse(decoder).decode
    else:  # dynamic=False as in `fuse`: a codec's bit width and sizes are constants of the graph
        encode, decode = torch.compile(encoder.encode, dynamic=False), torch.compile(decoder.decode, dynamic=False)
    started = time.perf_counter()
    try:
        got = encode(x)
        back = decode(got, x.shape, x.dtype)
    except Exception as err:  # noqa: BLE001 - a compiler failure is a result to report, not a crash
        return dict(codec=f"{name} (compiled)", params=",".join(f"{k}={v}" for k, v in params.items()),
                    ms_encode=float("nan"), ms_decode=float("nan"), ms_total=float("nan"), exact=False,
                    decode_diff=float("nan"), compile_s=time.perf_counter() - started,
                    error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    compile_s = time.perf_counter() - started
    exact = bool(torch.equal(got, payload))
    decode_diff = float((back.float() - out.float()).abs().max() / out.float().abs().max())
    enc_ms = timed(lambda: encode(x), repeats, device)
    dec_ms = timed(lambda: decode(got, x.shape, x.dtype), repeats, device)
    return dict(codec=f"{name} (compiled)", params=",".join(f"{k}={v}" for k, v in params.items()),
                ms_encode=enc_ms, ms_decode=dec_ms, ms_total=enc_ms + dec_ms, exact=exact, decode_diff=decode_diff,
                compile_s=compile_s)


def compiled_note(row: dict) -> str:
    """The compiled rows' extra column: exactness and compile time, or why compiling failed."""
    if "error" in row:
        return f" compile failed: {row['error']}"
    if "exact" in row:
        return (f" payload exact: {row['exact']}, decoded within {row['decode_diff']:.0e} of max, "
                f"compiled in {row['compile_s']:.0f} s")
    return ""


def bench(shape, dtype, device, repeats, codecs=None, compile=False) -> list[dict]:
    """Every case of CASES (only those of the codecs named in `codecs`, if given) and the copy floor;
    with `compile`, the cases of COMPILED compiled too."""
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
        if codecs and name not in codecs:
            continue
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
        if compile and (name, params) in COMPILED:
            row = compiled_row(name, params, x, payload, out, repeats, device)
            rows.append(dict(rows[-1], **row, x_copy=row["ms_total"] / copy_ms,
                             gb_per_s=nbytes / row["ms_total"] / 1e6))
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


def outlier_tensors() -> dict[str, torch.Tensor]:
    """Synthetic activations with outlier channels, and real boundary activations and gradients
    (after block 2 of 4) of a small GPT-2 pre-trained on CPython's docs (1 epoch)."""
    import argparse as _argparse

    from finetune_quality import make_model, pretrain
    from transformers import default_data_collator

    from hf_actcomp.data import build_tokenizer, causal_lm_datasets, offline_corpus

    g = torch.Generator().manual_seed(0)
    synthetic = torch.randn(2048, 1024, generator=g)
    synthetic[:, torch.randperm(1024, generator=g)[:8]] *= 40
    docs = offline_corpus()
    tokenizer = build_tokenizer(docs, vocab_size=1024)
    train, evaluation = causal_lm_datasets(tokenizer, docs, seq_len=128, max_train_samples=1024)
    settings = _argparse.Namespace(seq_len=128, pretrain_lr=2e-3, pretrain_epochs=1, batch_size=16)
    weights = pretrain((train.with_format("torch"), evaluation.with_format("torch"), len(tokenizer)), settings)
    model = make_model(len(tokenizer), 128, seed=0)
    model.load_state_dict(weights)
    batch = default_data_collator([evaluation.with_format("torch")[i] for i in range(16)])
    captured = {}
    block = model.transformer.h[1]
    block.register_forward_hook(lambda m, a, out: captured.update(activation=out[0] if isinstance(out, tuple) else out))
    hidden = {}

    def keep_grad(module, args, out):
        out = out[0] if isinstance(out, tuple) else out
        out.register_hook(lambda grad: hidden.update(gradient=grad))
    block.register_forward_hook(keep_grad)
    model(**{k: v for k, v in batch.items() if k != "sample_id"}).loss.backward()
    return {"synthetic: 8 of 1024 channels x40": synthetic,
            "GPT-2 (pre-trained) boundary activations": captured["activation"].detach().reshape(-1, 128),
            "GPT-2 (pre-trained) boundary gradients": hidden["gradient"].detach().reshape(-1, 128)}


def outliers() -> None:
    rows = []
    for tensor_name, x in outlier_tensors().items():
        for bits in (3, 4):
            for label, name, params in SCALINGS:
                params = dict(params)
                if params.get("group_size", 0) is None:
                    params["group_size"] = x.shape[-1]
                codec = make_codec(name, bits=bits, **params)
                out = codec.decode(codec.encode(x), x.shape, x.dtype)
                rows.append(dict(tensor=tensor_name, shape=list(x.shape), bits=bits, scaling=label, codec=name,
                                 params=params, relative_error=float((out - x).norm() / x.norm()),
                                 bits_per_element=8.0 * codec.payload_nbytes(x.shape, x.dtype) / x.numel()))
                print(f"{tensor_name:42s} {bits} bits {label:38s} rel. error {rows[-1]['relative_error']:.4f}  "
                      f"{rows[-1]['bits_per_element']:.3f} bits/elem", flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, "codecs_outliers")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": dict(torch=torch.__version__, machine=platform.machine()), "rows": rows}, f, indent=1)
    lines = ["Relative error ||x - x_hat|| / ||x|| and bits per element of each scaling; deterministic rounding.",
             "", "| tensor | bits | scaling | rel. error | bits/elem |", "|---|---|---|---|---|"]
    lines += [f"| {r['tensor']} {tuple(r['shape'])} | {r['bits']} | {r['scaling']} | {r['relative_error']:.4f} | "
              f"{r['bits_per_element']:.3f} |" for r in rows]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shape", type=int, nargs="+", default=[8, 1024, 768])
    p.add_argument("--outliers", action="store_true", help="the scaling comparison on outlier tensors instead")
    p.add_argument("--codecs", nargs="+", default=None, help="measure only these codecs (and the copy floor)")
    p.add_argument("--name", default=None, help="results file name (default codecs_<device>)")
    p.add_argument("--compile", action="store_true",
                   help="also time the COMPILED cases under torch.compile (payload bit for bit vs eager, decode's largest difference)")
    args = p.parse_args(argv)
    if args.outliers:
        outliers()
        return
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows += bench(tuple(args.shape), dtype, args.device, args.repeats, args.codecs, args.compile)
    meta = dict(device=args.device, shape=args.shape, torch=torch.__version__, threads=torch.get_num_threads(),
                machine=platform.machine(), cpu_count=os.cpu_count(),
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, args.name or f"codecs_{args.device}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    header = "| codec | params | dtype | encode ms | decode ms | total ms | x copy time | GB/s | bits/elem | rel. error |"
    where = meta["gpu"] or f"{meta['threads']} threads"
    lines = [f"Tensor {tuple(args.shape)} on {args.device} ({where}), "
             f"median of {args.repeats}, torch {torch.__version__}.", "", header, "|---" * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['codec']} | {r['params']} | {r['dtype']} | {r['ms_encode']:.2f} | {r['ms_decode']:.2f} | "
                     f"{r['ms_total']:.2f} | {r['x_copy']:.1f}x | {r['gb_per_s']:.2f} | {r['bits_per_element']:.3f} | "
                     f"{r['relative_error']:.4f} |" + compiled_note(r))
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
