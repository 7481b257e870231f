"""Convergence under boundary compression (simulation, one process).

A small GPT-2-style model is trained for several epochs on the Python reference documentation
that ships with CPython (tokenizer built locally), from the same initialisation and data order,
once per compression setting. For each setting: final eval loss / perplexity evaluated both with
the plan's compression at inference and without it, bytes sent per step, and the loss curve.

    .venv/bin/python benchmarks/convergence.py            # ~12 minutes on 2 cores
    .venv/bin/python benchmarks/convergence.py --quick    # a smoke run
    .venv/bin/python benchmarks/convergence.py --compare convergence convergence_rerun  # curves drifting apart

Writes benchmarks/results/convergence.{json,md,png} (`--name` another name).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import torch
from harness import add_arguments, write_markdown
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, GPT2Config, default_data_collator

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan
from hf_actcomp.data import build_tokenizer, causal_lm_datasets, offline_corpus

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def settings(num_samples: int) -> dict[str, tuple[Compression, Compression]]:
    q = lambda b: Compression("quantize", bits=b)  # noqa: E731
    aq = lambda b: Compression("aqsgd", bits=b)  # noqa: E731
    return {
        "none": (Compression(), Compression()),
        "quantize fw2/bw4": (q(2), q(4)),
        "quantize fw4/bw8": (q(4), q(8)),
        "aqsgd fw2/bw4": (aq(2), q(4)),
        "aqsgd fw4/bw8": (aq(4), q(8)),
        "topk 10%": (Compression("topk", ratio=0.1), q(8)),
        "topk 30%": (Compression("topk", ratio=0.3), q(8)),
        "topk 10% + EF": (Compression("topk", ratio=0.1, feedback="ef"), q(8)),
        "topk 30% + EF": (Compression("topk", ratio=0.3, feedback="ef"), q(8)),
        "aqsgd topk 30%": (Compression("aqsgd", inner="topk", ratio=0.3), q(8)),
    }


def make_model(vocab: int, seq_len: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=128, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config)


def eval_loss(module, loader) -> float:
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            batch = {k: v for k, v in batch.items() if k != "sample_id"}
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += module(**batch).loss.item() * n
            tokens += n
    return total / tokens


def training_bytes(stats: dict) -> dict[str, int]:
    """What training sent: every category but `evaluation` (the per-epoch evaluations' forwards)."""
    kept = [c for name, c in stats["categories"].items() if name != "evaluation"]
    return {key: sum(c[key] for c in kept) for key in ("bytes_sent", "bytes_uncompressed")}


def train_epochs(sim, loader, optimizer, epochs: int, evaluate) -> tuple[list[float], list[float]]:
    """`epochs` passes over `loader` through `sim` (one optimizer step a batch); returns the
    training losses and `evaluate()` (in eval mode) after each epoch."""
    curve, epoch_eval = [], []
    for _epoch in range(epochs):
        for batch in loader:
            loss = sim(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            curve.append(loss.item())
        sim.eval()
        epoch_eval.append(evaluate())
        sim.train()
    return curve, epoch_eval


def run(name, forward, backward, data, args) -> dict:
    train, evaluation, vocab = data
    model = make_model(vocab, args.seq_len, args.seed)
    plan = Plan(num_stages=2, micro_batches=2, split_points=[2], forward=forward, backward=backward,
                memory=MemoryConfig(num_samples=len(train), store="host", dtype="fp16"))
    sim = hf_actcomp.simulate(model, plan)
    optimizer = torch.optim.AdamW(sim.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        collate_fn=default_data_collator, generator=generator)
    eval_loader = DataLoader(evaluation, batch_size=32, collate_fn=default_data_collator)
    start = time.perf_counter()
    curve, epoch_eval = train_epochs(sim, loader, optimizer, args.epochs, lambda: eval_loss(sim, eval_loader))
    seconds = time.perf_counter() - start
    stats = sim.stats()
    steps = len(curve)
    model.eval()
    plain = eval_loss(model, eval_loader)
    with hf_actcomp.compressed_inference(model, plan) as inf:
        compressed = eval_loss(inf, eval_loader)
    training = training_bytes(stats)
    fwd = stats["channels"]["boundary0.forward"]
    bwd = stats["channels"]["boundary0.backward"]
    row = {
        "setting": name,
        "forward": forward.describe(),
        "backward": backward.describe(),
        "eval_loss_compressed": compressed,
        "eval_loss_uncompressed": plain,
        "perplexity_compressed": math.exp(compressed),
        "perplexity_uncompressed": math.exp(plain),
        "bytes_per_step": training["bytes_sent"] / steps,
        "bytes_per_step_uncompressed": training["bytes_uncompressed"] / steps,
        "compression_ratio": training["bytes_uncompressed"] / training["bytes_sent"],
        "forward_ratio": fwd["compression_ratio"],
        "backward_ratio": bwd["compression_ratio"],
        "forward_relative_error": fwd["relative_error"],
        "backward_relative_error": bwd["relative_error"],
        "epoch_eval_loss": epoch_eval,
        "train_curve": curve,
        "seconds": seconds,
    }
    print(f"{name:18s} eval {compressed:.3f} (no comp. at inference {plain:.3f})  "
          f"{row['bytes_per_step'] / 1e6:7.3f} MB/step  ratio {row['compression_ratio']:5.1f}x  {seconds:5.0f}s",
          flush=True)
    return row


def write_outputs(rows: list[dict], args) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    meta = {"args": vars(args), "torch": torch.__version__, "machine": platform.machine(),
            "threads": torch.get_num_threads()}
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    base = rows[0]
    lines = [
        f"Model: GPT-2 style, 4 layers, hidden 128, 2 stages split after block 2; {args.epochs} epochs, "
        f"batch {args.batch_size} x {args.seq_len} tokens, 2 micro-batches, AdamW lr {args.lr}, seed {args.seed}.",
        "",
        "| setting | fw | bw | eval loss (compressed inference) | eval loss (plain inference) | ppl (compressed) "
        "| MB/step | ratio | fw rel. err | bw rel. err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['forward']} | {r['backward']} | {r['eval_loss_compressed']:.3f} | "
            f"{r['eval_loss_uncompressed']:.3f} | {r['perplexity_compressed']:.1f} | "
            f"{r['bytes_per_step'] / 1e6:.3f} | {r['compression_ratio']:.1f}x | "
            f"{r['forward_relative_error']:.3f} | {r['backward_relative_error']:.3f} |"
        )
    lines.append("")
    lines.append(f"Uncompressed traffic: {base['bytes_per_step_uncompressed'] / 1e6:.3f} MB/step.")
    write_markdown(RESULTS, args.name, lines)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    window = 8
    for r in rows:
        c = torch.tensor(r["train_curve"])
        smooth = c.unfold(0, window, 1).mean(1) if len(c) >= window else c
        ax.plot(range(len(smooth)), smooth.tolist(), label=r["setting"])
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss (moving average of {window})")
    ax.set_title("Training loss under boundary compression (simulated 2-stage pipeline)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{args.name}.png"), dpi=110)


def compare(names: list[str]) -> None:
    """How the training curves of saved runs (results file names) drift apart, setting by
    setting: the first step whose train loss differs from the first run's, by how much, and the
    gap later on. Writes benchmarks/results/convergence_divergence.md."""
    runs = {}
    for name in names:
        with open(os.path.join(RESULTS, f"{name}.json")) as f:
            runs[name] = {r["setting"]: r for r in json.load(f)["rows"]}
    first, *others = names
    at = (10, 50, 200)
    lines = [f"Train loss of each run against `{first}`, step by step (0 = the first step's loss).", "",
             "| setting | run | first step that differs | by | " + " | ".join(f"gap at step {s}" for s in at)
             + " | gap at the end | eval loss (plain inference) | eval loss of " + first + " |", "|---" * (7 + len(at)) + "|"]
    for setting, base in runs[first].items():
        for other in others:
            if setting not in runs[other]:
                continue
            r = runs[other][setting]
            gaps = [abs(x - y) for x, y in zip(base["train_curve"], r["train_curve"], strict=True)]
            step = next((i for i, gap in enumerate(gaps) if gap > 0), None)
            lines.append(f"| {setting} | {other} | {'none' if step is None else step} | "
                         f"{'' if step is None else f'{gaps[step]:.1e}'} | "
                         + " | ".join(f"{gaps[s]:.1e}" for s in at) + f" | {gaps[-1]:.1e} | "
                         f"{r['eval_loss_uncompressed']:.3f} | {base['eval_loss_uncompressed']:.3f} |")
    with open(os.path.join(RESULTS, "convergence_divergence.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, epochs=6, train_samples=1024, batch_size=16, seq_len=128, lr=2e-3, seed=0, only=None,
                  quick=(False, "2 epochs on 128 samples, three settings"))
    p.add_argument("--name", default="convergence", help="results file name in benchmarks/results/")
    p.add_argument("--compare", nargs="+", metavar="NAME",
                   help="only compare the training curves of these saved results (no training)")
    args = p.parse_args(argv)
    if args.compare:
        compare(args.compare)
        return
    if args.quick:
        args.epochs, args.train_samples = 2, 128
        args.only = args.only or ["none", "aqsgd fw4/bw8", "topk 10% + EF"]
    texts = offline_corpus()
    tokenizer = build_tokenizer(texts, vocab_size=1024)
    train, evaluation = causal_lm_datasets(tokenizer, texts, seq_len=args.seq_len,
                                           max_train_samples=args.train_samples)
    data = (train.with_format("torch"), evaluation.with_format("torch"), len(tokenizer))
    print(f"{len(train)} train / {len(evaluation)} eval blocks of {args.seq_len} tokens", flush=True)
    rows = []
    for name, (fw, bw) in settings(len(train)).items():
        if args.only and name not in args.only:
            continue
        rows.append(run(name, fw, bw, data, args))
    write_outputs(rows, args)


if __name__ == "__main__":
    main()
