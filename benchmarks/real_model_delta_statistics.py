"""What AQ-SGD's deltas carry on a real LLM: SmolLM2-135M's boundary activations between two visits
of the same sample during fine-tuning.

SmolLM2 is fine-tuned unsplit and uncompressed (the continued training of real_model_finetune.py:
stdlib blocks of 128 tokens, batch 4, AdamW), and the hidden state entering each block where the
default split of 2 and 4 stages puts a boundary is kept for every training sample at every epoch.
Per sample and boundary, d = x(epoch e) - x(epoch e - 1) is what a delta carries when the memory
is exact (the weights' drift); the table gives its median over samples of:

- |d| / |x|: how far one epoch moves the activation;
- the sink's share of |d|^2 (the sequence's largest-norm token, which `hadamard_outliers` and
  `hadamard_vq` send apart) and the channel mean's share of the other tokens' |d|^2;
- AM / GM of the other tokens' delta power: the most that spending a code's bits unevenly across
  tokens (reverse water-filling) could divide the distortion by at high rate;
- the first-visit error of a codec (|x - Q(x)|^2 at epoch 0) over |d|^2 (epoch 1): above 1, an
  epoch-1 delta is mostly the first visit's error, not the drift;
- per pair of samples (a 2 x 128-token micro-batch, samples 2i and 2i + 1): the share of |d|^2 that
  its best rank-4 approximation keeps (`lowrank` 4, what `deltas="drift"` sends), and, epoch 1, the
  drift that AQ-SGD's own rank-4 delta after a ternary first visit delivers, 1 - |d - L|^2 / |d|^2
  with L = lowrank4(x(1) - ternary(x(0))) (the receiver's change; below 0: it adds more error than
  drift).

    python benchmarks/real_model_delta_statistics.py           # ~3 min on this CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, default_data_collator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smollm2  # noqa: E402
from harness import add_arguments, write_markdown  # noqa: E402
from real_model_boundaries import stage_boundaries  # noqa: E402

from hf_actcomp import Compression  # noqa: E402
from hf_actcomp.feedback import build_codec  # noqa: E402
from hf_actcomp.models.registry import get_adapter  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LOW_RANK = Compression("lowrank", rank=4)
TERNARY = "hadamard_codebook 3"
FIRST_VISIT = {"hadamard_vq 64": Compression("hadamard_vq", levels=64),
               "hadamard_vq 64, 1 outlier": Compression("hadamard_vq", levels=64, outliers=1),
               "hadamard_codebook 3": Compression("hadamard_codebook", levels=3, outliers=0)}


def collect(model, train, boundaries: list[int], args) -> dict[tuple[int, int, int], torch.Tensor]:
    """{(epoch, block, sample): the hidden state entering `block` in that epoch's training forward}."""
    layers = get_adapter(model).blocks()
    current: dict[int, torch.Tensor] = {}
    hooks = [layers[k].register_forward_pre_hook(
        lambda _m, inputs, k=k: current.__setitem__(k, inputs[0].detach().clone())) for k in boundaries]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        collate_fn=default_data_collator, generator=torch.Generator().manual_seed(args.seed))
    states = {}
    model.train()
    for epoch in range(args.epochs):
        for batch in loader:
            ids = batch.pop("sample_id").tolist()
            loss = model(**batch).loss
            for k in boundaries:
                for row, sample in enumerate(ids):
                    states[(epoch, k, sample)] = current[k][row]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"epoch {epoch} done", flush=True)
    for hook in hooks:
        hook.remove()
    return states


def delta_statistics(x_before: torch.Tensor, x_after: torch.Tensor, codecs: dict) -> dict[str, float]:
    """The module docstring's statistics of one sample's (tokens, hidden) states at two visits."""
    d = x_after - x_before
    sink = int(x_after.norm(dim=-1).argmax())
    rest = torch.ones(d.shape[0], dtype=torch.bool)
    rest[sink] = False
    power = d[rest].square().mean(dim=-1)
    out = {"relative_delta": float(d.norm() / x_after.norm()),
           "sink_share": float(d[sink].square().sum() / d.square().sum()),
           "mean_share": float(d[rest].mean(dim=0).square().sum() * rest.sum() / d[rest].square().sum()),
           "am_gm": float(power.mean() / power.log().mean().exp())}
    for label, codec in codecs.items():
        x = x_before.unsqueeze(0)
        error = x - codec.decode(codec.encode(x), x.shape, x.dtype)
        out[f"first_visit_over_drift {label}"] = float(error.square().sum() / d.square().sum())
    return out


def low_rank_statistics(x_before: torch.Tensor, x_after: torch.Tensor, codecs: dict) -> dict[str, float]:
    """The module docstring's rank-4 statistics of a pair of samples' (2, tokens, hidden) states."""
    low_rank = build_codec(LOW_RANK)
    code = lambda codec, x: codec.decode(codec.encode(x), x.shape, x.dtype)  # noqa: E731
    d = x_after - x_before
    out = {"rank4_share": float(1 - (d - code(low_rank, d)).square().sum() / d.square().sum())}
    if TERNARY in codecs:
        delta = x_after - code(codecs[TERNARY], x_before)
        out["rank4_memory_delta_delivers"] = float(1 - (d - code(low_rank, delta)).square().sum() / d.square().sum())
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, seq_len=128, eval_blocks=8, epochs=3, batch_size=4, lr=3e-5, seed=0)
    p.add_argument("--train_blocks", type=int, default=24, help="training blocks (real_model_finetune.py's)")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--name", default="real_model_delta_statistics")
    args = p.parse_args(argv)
    started = time.time()
    torch.manual_seed(args.seed)
    tokenizer = smollm2.load_tokenizer()
    train, _ = smollm2.stdlib_blocks(tokenizer, args.seq_len, args.train_blocks, args.eval_blocks)
    model = AutoModelForCausalLM.from_pretrained(smollm2.smollm2_dir(), dtype=torch.float32)
    adapter = get_adapter(model)
    split = {s: stage_boundaries(adapter, s) for s in args.stages}  # the blocks each stage count cuts before
    boundaries = sorted({k for cuts in split.values() for k in cuts})
    states = collect(model, train, boundaries, args)
    codecs = {label: build_codec(c) for label, c in FIRST_VISIT.items()}
    rows = []
    for epoch in range(1, args.epochs):
        for k in boundaries:
            per_sample = [delta_statistics(states[(epoch - 1, k, s)], states[(epoch, k, s)], codecs if epoch == 1 else {})
                          for s in range(len(train))]
            pairs = [low_rank_statistics(*(torch.stack([states[(e, k, s)] for s in (i, i + 1)]) for e in (epoch - 1, epoch)),
                                         codecs if epoch == 1 else {}) for i in range(0, len(train) - 1, 2)]
            row = {"epoch": epoch, "block": k, "stages": [s for s, cuts in split.items() if k in cuts],
                   **{key: statistics.median(r[key] for r in per_sample) for key in per_sample[0]},
                   **{key: statistics.median(r[key] for r in pairs) for key in pairs[0]}}
            rows.append(row)
            print(row, flush=True)
    seconds = time.time() - started
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows, "seconds": seconds}, f, indent=1)
    labels = list(FIRST_VISIT)
    lines = ["# SmolLM2-135M: what AQ-SGD's deltas carry", "",
             f"`benchmarks/real_model_delta_statistics.py`: SmolLM2-135M-Instruct (fp32) fine-tuned unsplit and "
             f"uncompressed on {args.train_blocks} stdlib blocks of {args.seq_len} tokens, batch {args.batch_size}, "
             f"AdamW lr {args.lr:g}, seed {args.seed}, {args.epochs} epochs; the hidden state entering each boundary "
             f"block of the default {' and '.join(map(str, args.stages))}-stage splits, kept for every sample at every "
             f"epoch. d = x(epoch) - x(epoch - 1) per sample: the drift a delta carries when AQ-SGD's memory is exact. "
             f"Median over the {len(train)} samples (the rank-4 columns: over the {len(train) // 2} pairs of samples "
             f"2i, 2i + 1, each a micro-batch's 2 x {args.seq_len} tokens); {seconds / 60:.1f} min on this CPU, deterministic: one run.", "",
             "| epoch | block input | boundary of | \\|d\\| / \\|x\\| | sink's share of \\|d\\|² | channel mean's share "
             "(other tokens) | AM / GM of token delta power | " + " | ".join(
                 f"{label} first-visit error / drift" for label in labels) + " | rank 4's share of \\|d\\|² "
             "(2 samples) | drift delivered by AQ-SGD's rank-4 delta after a ternary first visit |",
             "|---:|---:|---|---:|---:|---:|---:|" + "---:|" * (len(labels) + 2)]
    for r in rows:
        lines.append(f"| {r['epoch']} | {r['block']} | {', '.join(f'{s} stages' for s in r['stages'])} | "
                     f"{r['relative_delta']:.4f} | {r['sink_share']:.3f} | {r['mean_share']:.3f} | {r['am_gm']:.2f} | "
                     + " | ".join(f"{r[f'first_visit_over_drift {label}']:.0f}" if f"first_visit_over_drift {label}" in r
                                  else "-" for label in labels)
                     + f" | {r['rank4_share']:.3f} | "
                     + (f"{r['rank4_memory_delta_delivers']:.3f}" if "rank4_memory_delta_delivers" in r else "-") + " |")
    write_markdown(RESULTS, args.name, lines)


if __name__ == "__main__":
    main()
