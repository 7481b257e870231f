"""Quality of boundary compression when FINE-TUNING a pre-trained model (simulation, one process).

AQ-SGD and Rudakov et al. measured fine-tuning, where activations change slowly between epochs;
`convergence.py` trains from scratch. Here a small GPT-2-style model is first pre-trained
uncompressed on one offline corpus (CPython's reference documentation, `pydoc_data`), then
fine-tuned from that checkpoint on a different one (the source code of the standard library's
top-level modules), once per compression setting, with the same data order, initialisation and
seed. Reported per setting and seed: the final eval loss and perplexity on held-out stdlib code,
with the plan's compression at inference and without it, bytes per step, and the training curve.
The model's head is tied to its input embedding: six settings also compress the tie's rows
(`Plan.tie_compression`, which the simulation emulates as the pipeline exchanges them); the
others exchange them exactly, and every row reports the tie's bytes per step.

    .venv/bin/python benchmarks/finetune_quality.py                 # 3 seeds; ~32 minutes on 2 cores before
                                                                    # the two warm-up settings were added
    .venv/bin/python benchmarks/finetune_quality.py --seeds 0 --quick

Writes benchmarks/results/finetune_quality.{json,md,png} (`--name` another name; `--merge` keeps the saved rows
of settings and seeds not run again).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch
from convergence import eval_loss, make_model  # the same model and token-weighted eval
from convergence import settings as convergence_settings
from harness import add_arguments, write_markdown
from smollm2 import stdlib_sources  # the same stdlib files as the real-model benchmarks
from torch.utils.data import DataLoader
from transformers import default_data_collator

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan
from hf_actcomp.data import build_tokenizer, causal_lm_datasets, offline_corpus

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def settings() -> dict[str, tuple[Compression, Compression, Compression | None]]:
    """(forward, backward, tie_compression) per setting: the from-scratch study's settings
    (convergence.py), plus 3 bits, the cacheless codec, AQ-SGD with a compressed warm-up (first
    visits Hadamard-4 instead of uncompressed) and compressed tied-embedding rows (8-bit, alone
    and with AQ-SGD), in table order; tie None: exact rows."""
    q = lambda b: Compression("quantize", bits=b)  # noqa: E731
    h = lambda b: Compression("hadamard", bits=b)  # noqa: E731
    warm = lambda b: Compression("aqsgd", bits=b, first_visit=h(4))  # noqa: E731
    every = {**convergence_settings(0), "quantize fw3/bw6": (q(3), q(6)),
             "aqsgd fw3/bw6": (Compression("aqsgd", bits=3), q(6)),
             "hadamard fw3/bw6": (h(3), h(6)), "hadamard fw4/bw8": (h(4), h(8)),
             "aqsgd fw2/bw4 warm-up h4": (warm(2), q(4)), "aqsgd fw4/bw8 warm-up h4": (warm(4), q(8))}
    order = ["none", "quantize fw2/bw4", "quantize fw3/bw6", "quantize fw4/bw8", "aqsgd fw2/bw4", "aqsgd fw3/bw6",
             "aqsgd fw4/bw8", "topk 10%", "topk 30%", "topk 10% + EF", "topk 30% + EF", "aqsgd topk 30%",
             "hadamard fw3/bw6", "hadamard fw4/bw8", "aqsgd fw2/bw4 warm-up h4", "aqsgd fw4/bw8 warm-up h4"]
    tie = q(8)
    ties = {"tie quantize8": (Compression(), Compression(), tie),
            "aqsgd fw2/bw4 + tie quantize8": (*every["aqsgd fw2/bw4"], tie),
            "aqsgd fw4/bw8 + tie quantize8": (*every["aqsgd fw4/bw8"], tie),
            "aqsgd fw2/bw4 warm-up h4 + tie quantize8": (*every["aqsgd fw2/bw4 warm-up h4"], tie),
            "aqsgd fw4/bw8 warm-up h4 + tie quantize8": (*every["aqsgd fw4/bw8 warm-up h4"], tie),
            "aqsgd fw2/bw4 warm-up h4 + tie quantize4": (*every["aqsgd fw2/bw4 warm-up h4"], q(4))}
    return {**{name: (*every[name], None) for name in order}, **ties}


def corpora(args):
    """The pre-training blocks (docs: train, eval), the fine-tuning blocks (stdlib source: train,
    the first `eval_samples` held-out ones) and the vocabulary size of the tokenizer built on the
    docs (the pre-trained model's tokenizer, as in practice)."""
    docs = offline_corpus()
    tokenizer = build_tokenizer(docs, vocab_size=1024)
    pre_train, pre_eval = causal_lm_datasets(tokenizer, docs, seq_len=args.seq_len, max_train_samples=1024)
    code = stdlib_sources(args.stdlib_files)
    ft_train, ft_eval = causal_lm_datasets(tokenizer, code, seq_len=args.seq_len, max_train_samples=args.train_samples)
    ft_eval = ft_eval.select(range(min(args.eval_samples, len(ft_eval))))
    return pre_train, pre_eval, ft_train, ft_eval, len(tokenizer)


def pretrain(data, args) -> dict[str, torch.Tensor]:
    """Uncompressed pre-training on the documentation; returns the weights every fine-tune starts from."""
    train, evaluation, vocab = data
    model = make_model(vocab, args.seq_len, seed=1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        collate_fn=default_data_collator, generator=torch.Generator().manual_seed(1234))
    start = time.perf_counter()
    for _ in range(args.pretrain_epochs):
        for batch in loader:
            batch = {k: v for k, v in batch.items() if k != "sample_id"}
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    loss = eval_loss(model, DataLoader(evaluation, batch_size=32, collate_fn=default_data_collator))
    print(f"pre-trained {args.pretrain_epochs} epochs in {time.perf_counter() - start:.0f}s: docs eval loss {loss:.3f}",
          flush=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def finetune(name, forward, backward, tie, weights, data, args, seed) -> dict:
    train, evaluation, vocab = data
    model = make_model(vocab, args.seq_len, seed)
    model.load_state_dict(weights)
    plan = Plan(num_stages=2, micro_batches=2, split_points=[2], forward=forward, backward=backward,
                memory=MemoryConfig(num_samples=len(train), store="host", dtype="fp16"), tie_compression=tie)
    sim = hf_actcomp.simulate(model, plan)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(sim.parameters(), lr=args.lr)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        collate_fn=default_data_collator, generator=torch.Generator().manual_seed(seed))
    eval_loader = DataLoader(evaluation, batch_size=32, collate_fn=default_data_collator)
    curve, epoch_eval = [], []
    exact_tie = 0  # what the pipeline's exact tie sends: the batch's distinct rows there and back, fp32
    start = time.perf_counter()
    for _ in range(args.epochs):
        for batch in loader:
            exact_tie += 2 * torch.unique(batch["input_ids"]).numel() * model.config.hidden_size * 4
            loss = sim(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            curve.append(loss.item())
        model.eval()
        epoch_eval.append(eval_loss(model, eval_loader))
        model.train()
    seconds = time.perf_counter() - start
    stats = sim.stats()
    model.eval()
    plain = eval_loss(model, eval_loader)
    with hf_actcomp.compressed_inference(model, plan) as inf:
        compressed = eval_loss(inf, eval_loader)
    # Boundary traffic (activations and their gradients) apart from the tie's rows.
    boundary = [stats["categories"][c] for c in ("activations", "activation_gradients")]
    sent, raw = sum(c["bytes_sent"] for c in boundary), sum(c["bytes_uncompressed"] for c in boundary)
    tie_sent = stats["categories"]["tie"]["bytes_sent"] if tie is not None else exact_tie
    row = {
        "setting": name, "seed": seed, "forward": forward.describe(), "backward": backward.describe(),
        "tie": tie.describe() if tie is not None else "exact",
        "eval_loss_compressed": compressed, "eval_loss_uncompressed": plain,
        "bytes_per_step": sent / len(curve),
        "bytes_per_step_uncompressed": raw / len(curve),
        "compression_ratio": raw / sent if sent else 1.0,
        "tie_bytes_per_step": tie_sent / len(curve),
        "tie_bytes_per_step_uncompressed": exact_tie / len(curve),
        "forward_relative_error": stats["channels"]["boundary0.forward"]["relative_error"],
        "backward_relative_error": stats["channels"]["boundary0.backward"]["relative_error"],
        "epoch_eval_loss_uncompressed": epoch_eval, "train_curve": curve, "seconds": seconds,
    }
    print(f"seed {seed} {name:30s} eval {plain:.4f} (compressed inference {compressed:.4f})  "
          f"{row['bytes_per_step'] / 1e6:6.3f} MB/step  ratio {row['compression_ratio']:5.1f}x  "
          f"tie {row['tie_bytes_per_step'] / 1e6:6.3f} MB/step  {seconds:4.0f}s", flush=True)
    return row


def summarise(rows: list[dict]) -> list[dict]:
    """Per setting: median and range over seeds, and the median gap to `none` of the same seed."""
    base = {r["seed"]: r["eval_loss_uncompressed"] for r in rows if r["setting"] == "none"}
    out = []
    for name in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == name]
        plain = [r["eval_loss_uncompressed"] for r in mine]
        gaps = [100 * (r["eval_loss_uncompressed"] / base[r["seed"]] - 1) for r in mine if r["seed"] in base]
        out.append({
            "setting": name, "forward": mine[0]["forward"], "backward": mine[0]["backward"],
            "tie": mine[0].get("tie", "exact"), "seeds": len(mine),
            "eval_loss": statistics.median(plain), "eval_loss_min": min(plain), "eval_loss_max": max(plain),
            "eval_loss_compressed": statistics.median(r["eval_loss_compressed"] for r in mine),
            "gap_percent": statistics.median(gaps) if gaps else None,
            "gap_percent_min": min(gaps) if gaps else None, "gap_percent_max": max(gaps) if gaps else None,
            "bytes_per_step": statistics.median(r["bytes_per_step"] for r in mine),
            "compression_ratio": statistics.median(r["compression_ratio"] for r in mine),
            "tie_bytes_per_step": (statistics.median(r["tie_bytes_per_step"] for r in mine)
                                   if all("tie_bytes_per_step" in r for r in mine) else None),
        })
    return out


def write_outputs(rows: list[dict], summary: list[dict], meta: dict) -> None:
    name = meta["args"].get("name", "finetune_quality")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1)
    a = meta["args"]
    lines = [
        f"Fine-tuning a pre-trained GPT-2-style model (4 layers, hidden 128, pre-trained {a['pretrain_epochs']} "
        f"epochs on CPython's docs) on {meta['train_blocks']} blocks of {a['seq_len']} tokens of stdlib source, "
        f"{a['epochs']} epochs, batch {a['batch_size']}, 2 stages split after block 2, 2 micro-batches, AdamW lr "
        f"{a['lr']}; seeds {a['seeds']} (median [min-max]). Eval: {meta['eval_blocks']} held-out blocks.",
        "",
        "| setting | fw | bw | tie | eval loss | vs none (same seed) | eval loss, codec at inference | ppl | MB/step "
        "| ratio | tie MB/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        gap = "-" if s["setting"] == "none" or s["gap_percent"] is None else (
            f"{s['gap_percent']:+.2f}% [{s['gap_percent_min']:+.2f}, {s['gap_percent_max']:+.2f}]")
        tie_mb = "-" if s.get("tie_bytes_per_step") is None else f"{s['tie_bytes_per_step'] / 1e6:.3f}"
        lines.append(
            f"| {s['setting']} | {s['forward']} | {s['backward']} | {s.get('tie', 'exact')} | {s['eval_loss']:.4f} "
            f"[{s['eval_loss_min']:.4f}-{s['eval_loss_max']:.4f}] | {gap} | {s['eval_loss_compressed']:.4f} | "
            f"{math.exp(s['eval_loss']):.2f} | {s['bytes_per_step'] / 1e6:.3f} | {s['compression_ratio']:.1f}x "
            f"| {tie_mb} |")
    write_markdown(RESULTS, name, lines)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    seed = rows[0]["seed"]
    colors = plt.cm.tab20.colors  # 19 settings: the default cycle of 10 would repeat colours
    for i, r in enumerate(r for r in rows if r["seed"] == seed):
        ax.plot(range(1, len(r["epoch_eval_loss_uncompressed"]) + 1), r["epoch_eval_loss_uncompressed"],
                marker="o", color=colors[i % len(colors)], linestyle="-" if i % 2 == 0 else "--", label=r["setting"])
    ax.set_xlabel("epoch")
    ax.set_ylabel("eval loss (stdlib source, plain inference)")
    ax.set_title(f"Fine-tuning under boundary compression (seed {seed})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=110)


def replot(name: str) -> None:
    """Rewrite the table and plot from the saved JSON (no training)."""
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        saved = json.load(f)
    saved["meta"]["args"]["name"] = name
    write_outputs(saved["rows"], summarise(saved["rows"]), saved["meta"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, seeds=[0, 1, 2], pretrain_epochs=4, pretrain_lr=2e-3, epochs=4, train_samples=512,
                  eval_samples=256, stdlib_files=120, batch_size=16, seq_len=128, lr=5e-4, only=None,
                  merge=(False, "keep the saved rows of settings and seeds not run again (with --only)"),
                  quick=(False, "1 pre-training epoch, 2 fine-tuning epochs, 3 settings"),
                  replot=(False, "only rewrite the table and plot from the saved JSON"))
    p.add_argument("--name", default="finetune_quality", help="results file name in benchmarks/results/")
    args = p.parse_args(argv)
    if args.replot:
        replot(args.name)
        return
    if args.quick:
        args.pretrain_epochs, args.epochs, args.train_samples = 1, 2, 128
        args.only = args.only or ["none", "aqsgd fw2/bw4", "hadamard fw3/bw6"]
    pre_train, pre_eval, ft_train, ft_eval, vocab = corpora(args)
    print(f"pre-training: {len(pre_train)} blocks of docs; fine-tuning: {len(ft_train)} train / {len(ft_eval)} "
          f"eval blocks of stdlib source", flush=True)
    weights = pretrain((pre_train.with_format("torch"), pre_eval.with_format("torch"), vocab), args)
    data = (ft_train.with_format("torch"), ft_eval.with_format("torch"), vocab)
    rows = []
    for seed in args.seeds:
        for name, (fw, bw, tie) in settings().items():
            if args.only and name not in args.only:
                continue
            rows.append(finetune(name, fw, bw, tie, weights, data, args, seed))
    meta = {"args": vars(args), "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "train_blocks": len(ft_train), "eval_blocks": len(ft_eval)}
    if args.merge and os.path.exists(os.path.join(RESULTS, f"{args.name}.json")):
        with open(os.path.join(RESULTS, f"{args.name}.json")) as f:
            saved = json.load(f)
        again = {(r["setting"], r["seed"]) for r in rows}
        rows = [r for r in saved["rows"] if (r["setting"], r["seed"]) not in again] + rows
        meta["merged_with"] = saved["meta"]
    order = list(settings())
    rows.sort(key=lambda r: (r["seed"], order.index(r["setting"]) if r["setting"] in order else len(order)))
    write_outputs(rows, summarise(rows), meta)


if __name__ == "__main__":
    main()
