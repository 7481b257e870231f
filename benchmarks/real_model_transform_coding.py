"""Can a calibrated transform code reach 16x (2 bits a value) within 1% on SmolLM2? The stretch
target of 16x at inference, measured with textbook transform coding instead of our codecs.

Each boundary of the default 4-stage split (blocks 4, 15, 26) gets a codec fitted on its own
hidden states over calibration blocks of the training text (never the held-out ones):

- **KLT**: subtract the channel mean, rotate onto the covariance's eigenvectors (the
  Karhunen-Loeve transform, optimal for Gaussian data at high rate), give each component bits by
  greedy reverse water-filling (the next bit to the component whose squared error it cuts most,
  at most 8) and quantize each with a Lloyd-Max codebook fitted on its calibration values.
- **KLT, per-token RMS**: the same on each token divided by its RMS (sent in bf16).
- **Fisher-weighted KLT**: the KLT of F^1/2 x, F = E[g g^T] the empirical Fisher of the
  boundary's gradient (plus 10% of its mean eigenvalue), so bits go where the loss is sensitive.

Every variant sends each sequence's first token (the attention sink) whole in bf16, as
`hadamard_outliers` does; its bits are counted. The bases, means and codebooks are state both
stages would hold (fitted once, not sent). `hadamard_codebook` and `hadamard_outliers` rows,
stateless, run on the same eval blocks for reference.

    python benchmarks/real_model_transform_coding.py           # ~5 min on this CPU
    python benchmarks/real_model_transform_coding.py --quick   # checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smollm2  # noqa: E402
from harness import add_arguments, write_markdown  # noqa: E402
from real_model_boundaries import (  # noqa: E402
    RESULTS,
    Walk,
    block_gradients,
    codec_settings,
    cost_table,
    roundtrip,
    stage_boundaries,
)

MAX_BITS = 8
FISHER_RIDGE = 0.1
VARIANTS = ("KLT", "KLT, per-token RMS", "Fisher-weighted KLT")
REFERENCES = ("hadamard_codebook 11", "hadamard_codebook 7", "hadamard_outliers 3")


def lloyd_max(values: torch.Tensor, levels: int, iterations: int = 25) -> torch.Tensor:
    """A `levels`-point scalar codebook minimising squared error on `values` (1-D k-means)."""
    codebook = torch.quantile(values[:200_000], torch.linspace(0.5 / levels, 1 - 0.5 / levels, levels, dtype=values.dtype))
    for _ in range(iterations):
        index = torch.bucketize(values, (codebook[1:] + codebook[:-1]) / 2)
        sums = torch.zeros(levels, dtype=values.dtype).index_add_(0, index, values)
        counts = torch.bincount(index, minlength=levels).to(values.dtype)
        codebook = torch.where(counts > 0, sums / counts.clamp_min(1), codebook)
    return codebook


def water_filling(variance: torch.Tensor, budget: int) -> torch.Tensor:
    """Integer bits per component: each of `budget` bits to the component whose squared error
    (variance * 4^-bits, the high-rate rule) it cuts most."""
    bits = torch.zeros_like(variance, dtype=torch.long)
    error = variance.clone()
    for _ in range(budget):
        i = int((error * (bits < MAX_BITS)).argmax())
        bits[i] += 1
        error[i] = variance[i] * 4.0 ** -int(bits[i])
    return bits


class TransformCode:
    """One boundary's fitted transform code; `apply` is encode then decode."""

    def __init__(self, states: torch.Tensor, bits_per_value: float, variant: str, fisher: torch.Tensor | None) -> None:
        hidden = states.shape[-1]
        tokens = states[:, 1:].flatten(0, 1).double()  # the sink (position 0) travels apart
        self.per_token = variant == "KLT, per-token RMS"
        if self.per_token:
            tokens = tokens / tokens.pow(2).mean(-1, keepdim=True).sqrt()
        self.mean = tokens.mean(0)
        centred = tokens - self.mean
        to_code, from_code = torch.eye(hidden, dtype=torch.float64), torch.eye(hidden, dtype=torch.float64)
        if variant == "Fisher-weighted KLT":
            ridge = FISHER_RIDGE * fisher.trace() / hidden
            eigenvalues, vectors = torch.linalg.eigh(fisher.double() + ridge * torch.eye(hidden, dtype=torch.float64))
            to_code = vectors @ torch.diag(eigenvalues.sqrt()) @ vectors.T
            from_code = vectors @ torch.diag(eigenvalues.rsqrt()) @ vectors.T
        weighted = centred @ to_code
        _, basis = torch.linalg.eigh(weighted.T @ weighted / len(weighted))
        self.encoder, self.decoder = to_code @ basis, basis.T @ from_code
        coefficients = weighted @ basis
        seq_len = states.shape[1]
        # bits per sequence: the sink's bf16, each other token's code (and its bf16 RMS)
        overhead = 16 * hidden + (seq_len - 1) * 16 * self.per_token
        budget = int((bits_per_value * hidden * seq_len - overhead) / (seq_len - 1))
        self.bits = water_filling(coefficients.var(0), budget)
        self.codebooks = {i: lloyd_max(coefficients[:, i].contiguous(), 2 ** int(b)) for i, b in enumerate(self.bits) if b}
        self.bits_per_element = (overhead + (seq_len - 1) * int(self.bits.sum())) / (hidden * seq_len)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        out = x.double().clone()
        tokens = x[:, 1:].flatten(0, 1).double()
        if self.per_token:
            rms = tokens.pow(2).mean(-1, keepdim=True).sqrt().to(torch.bfloat16).double()
            tokens = tokens / rms
        coefficients = (tokens - self.mean) @ self.encoder
        decoded = torch.zeros_like(coefficients)
        for i, codebook in self.codebooks.items():
            decoded[:, i] = codebook[torch.bucketize(coefficients[:, i].contiguous(), (codebook[1:] + codebook[:-1]) / 2)]
        tokens = decoded @ self.decoder + self.mean
        if self.per_token:
            tokens = tokens * rms
        out[:, 1:] = tokens.view(x.shape[0], x.shape[1] - 1, x.shape[2])
        out[:, 0] = x[:, 0].to(torch.bfloat16).double()
        return out.to(x.dtype)


@torch.no_grad()
def loss_with(walk: Walk, applies: dict) -> float:
    """Eval loss with each boundary's own `applies[k]` on the input of block k."""
    first = min(applies)
    hidden = walk.states[first]
    for k in range(first, walk.num_blocks):
        if k in applies:
            hidden = applies[k](hidden)
        hidden = walk.adapter.run_block(k, hidden, walk.context)
    return walk.loss(walk.adapter.head(hidden))


def fisher_at(model, ids: torch.Tensor, boundaries: list[int], chunk: int = 8) -> dict[int, torch.Tensor]:
    """E[g g^T] over the non-sink tokens of `ids`, g = d loss / d (input of block k)."""
    fisher = {k: 0 for k in boundaries}
    count = 0
    for start in range(0, len(ids), chunk):
        grads = block_gradients(Walk(model, ids[start:start + chunk]))
        for k in boundaries:
            g = grads[k - 1][:, 1:].flatten(0, 1).double()
            fisher[k] = fisher[k] + g.T @ g
        count += len(g)
    return {k: f / count for k, f in fisher.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, eval_blocks=8, seq_len=256, quick=False)
    p.add_argument("--calibration_blocks", type=int, default=32, help="training blocks the codes are fitted on")
    p.add_argument("--bits", type=float, nargs="+", default=[2.0, 3.0, 4.0], help="bits per value, all counted")
    p.add_argument("--name", default="real_model_transform_coding")
    args = p.parse_args(argv)
    if args.quick:
        args.eval_blocks, args.calibration_blocks, args.seq_len, args.bits = 2, 4, 64, [2.0]
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    started = time.time()
    model, tokenizer = smollm2.load()
    train, held_out = smollm2.stdlib_blocks(tokenizer, args.seq_len, train_blocks=args.calibration_blocks,
                                            eval_blocks=args.eval_blocks)
    calibration_ids = torch.tensor(train["input_ids"][:args.calibration_blocks])
    walk = Walk(model, torch.tensor(held_out["input_ids"]))
    base = walk.loss(walk.adapter.head(walk.states[-1]))
    boundaries = stage_boundaries(walk.adapter, 4)
    calibration = Walk(model, calibration_ids)
    fisher = fisher_at(model, calibration_ids, boundaries)
    print(f"plain eval loss {base:.4f}; calibrated ({time.time() - started:.0f} s)", flush=True)
    places = {**{f"block {k} only": [k] for k in boundaries}, "4 stages": boundaries}
    rows = []

    def measure(label: str, bits: float, applies: dict) -> None:
        cost = {place: 100 * (loss_with(walk, {k: applies[k] for k in ks}) / base - 1) for place, ks in places.items()}
        rows.append({"codec": label, "bits_per_element": bits, "cost": cost})
        print(f"[{time.time() - started:5.0f} s] {label} ({bits:.2f} bits): "
              + ", ".join(f"{k} {v:+.2f}%" for k, v in cost.items()), flush=True)

    for bits in args.bits:
        for variant in VARIANTS:
            codes = {k: TransformCode(calibration.states[k], bits, variant, fisher[k]) for k in boundaries}
            measure(f"{variant}, {bits:g} bits", max(c.bits_per_element for c in codes.values()),
                    {k: c.apply for k, c in codes.items()})
    settings = codec_settings()
    for label in REFERENCES:
        apply, bits = roundtrip(settings[label])
        measure(label + " (stateless)", bits(tuple(walk.ids.shape) + (model.config.hidden_size,)),
                dict.fromkeys(boundaries, apply))
    write(args, base, rows, list(places), time.time() - started)


def write(args, base: float, rows: list[dict], places: list[str], seconds: float) -> None:
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump({"args": vars(args), "plain_eval_loss": base, "costs": rows, "seconds": seconds}, f, indent=1)
    lines = [
        "# SmolLM2-135M-Instruct: calibrated transform coding at the 4-stage boundaries",
        "",
        f"`benchmarks/real_model_transform_coding.py`: codes fitted on {args.calibration_blocks} training blocks, "
        f"eval on {args.eval_blocks} held-out blocks of {args.seq_len} tokens (plain eval loss {base:.4f}), fp32 on "
        f"this CPU, {seconds / 60:.1f} min. Deterministic: one run. Bits per element count every bit sent "
        "(the sink token in bf16, per-token RMS where used); fp32 = 32.",
        "",
        *cost_table(rows, places),
    ]
    write_markdown(RESULTS, args.name, lines)


if __name__ == "__main__":
    main()
