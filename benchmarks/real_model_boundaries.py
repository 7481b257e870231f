"""Where compression error comes from on a real LLM: SmolLM2-135M's boundary statistics across
depth, and the eval-loss cost of each codec at one boundary and at 2/4/8 stages.

Statistics (activations = the hidden state entering block k, gradients = d loss / d that state),
over the held-out blocks: per-channel max |x| (its max over channels, its median, their ratio, the
three largest channels), the massive tokens (largest token norm over the median token norm, and at
which position), and the excess kurtosis of all values.

Cost: the eval loss of the unsplit model with the forward codec applied at inference (stateless,
deterministic rounding) to the hidden state at each boundary, against the plain eval loss. The
states are computed once; each setting re-runs only the blocks after its first boundary.

    python benchmarks/real_model_boundaries.py            # ~20 min on this CPU
    python benchmarks/real_model_boundaries.py --quick    # 2 blocks, 3 codecs: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smollm2  # noqa: E402
from harness import add_arguments, write_markdown  # noqa: E402

from hf_actcomp import Compression, Plan  # noqa: E402
from hf_actcomp.feedback import build_inference_codec  # noqa: E402
from hf_actcomp.models.registry import get_adapter  # noqa: E402
from hf_actcomp.models.split import stage_ranges  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def codec_settings() -> dict[str, Compression]:
    """The stateless forward codecs measured, by label."""
    q = lambda bits, **kw: Compression("quantize", bits=bits, **kw)  # noqa: E731
    h = lambda bits, **kw: Compression("hadamard", bits=bits, **kw)  # noqa: E731
    o = lambda bits, **kw: Compression("hadamard_outliers", bits=bits, **kw)  # noqa: E731
    return {
        "bf16": Compression("bf16"),
        "quantize 8": q(8),
        "quantize 8 per channel": q(8, granularity="channel"),
        "hadamard 8": h(8),
        "quantize 4": q(4),
        "quantize 4 group 16": q(4, group_size=16),
        "hadamard 4": h(4),
        "hadamard 3": h(3),
        "quantize 2": q(2),
        "topk 30%": Compression("topk", ratio=0.3),
        "topk 10%": Compression("topk", ratio=0.1),
        "hadamard_outliers 8": o(8),
        "hadamard_outliers 6": o(6),
        "hadamard_outliers 5": o(5),
        "hadamard_outliers 4": o(4),
        "hadamard_outliers 4, tile 64": o(4, group_size=64),
        "hadamard_outliers 4, 8 outliers": o(4, outliers=8),
        "hadamard_outliers 4, 0 outliers": o(4, outliers=0),
        "hadamard_outliers 3": o(3),
        "hadamard_outliers 3, 8 outliers, tile 64": o(3, outliers=8, group_size=64),
        **{f"hadamard_codebook {levels}": Compression("hadamard_codebook", levels=levels) for levels in (15, 13, 11, 9, 7)},
        # 16x: 3 levels, no outlier channels (1.92 bits a value); 5 levels (2.82)
        "hadamard_codebook 5": Compression("hadamard_codebook", levels=5),
        "hadamard_codebook 3, 0 outliers": Compression("hadamard_codebook", levels=3, outliers=0),
    }


def roundtrip(compression: Compression, inference_form: bool = False):
    """x -> what the receiver decodes, and the payload's bits per element: the codec itself
    (`inference="direct"`), or with `inference_form` what evaluation and generation send by
    default (`inference="auto"`: hadamard_outliers 6 wherever the codec does not hold)."""
    with warnings.catch_warnings():  # "measured to break": measuring that is the point here
        warnings.simplefilter("ignore")
        codec = build_inference_codec(compression if inference_form else replace(compression, inference="direct"))

    def apply(x: torch.Tensor) -> torch.Tensor:
        return codec.decode(codec.encode(x), x.shape, x.dtype)

    def bits(shape) -> float:
        return 8 * codec.payload_nbytes(shape, torch.float32) / torch.Size(shape).numel()

    return apply, bits


class Walk:
    """The model run block by block (the package's own adapter, as a pipeline stage runs it)."""

    def __init__(self, model, input_ids: torch.Tensor) -> None:
        self.adapter = get_adapter(model)
        self.ids = input_ids
        self.num_blocks = self.adapter.num_blocks
        hidden = self.adapter.embed(input_ids, None)
        self.context = self.adapter.block_context(hidden, None)
        self.states = [hidden]  # states[k]: the input of block k; states[-1]: the last block's output
        with torch.no_grad():
            for k in range(self.num_blocks):
                self.states.append(self.adapter.run_block(k, self.states[-1], self.context))

    def loss(self, logits: torch.Tensor) -> float:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), self.ids[:, 1:].flatten()).item()

    @torch.no_grad()
    def loss_with(self, boundaries: list[int], apply) -> float:
        """Eval loss with `apply` on the input of each block in `boundaries` (sorted, > 0)."""
        hidden = apply(self.states[boundaries[0]])
        for k in range(boundaries[0], self.num_blocks):
            if k in boundaries and k != boundaries[0]:
                hidden = apply(hidden)
            hidden = self.adapter.run_block(k, hidden, self.context)
        return self.loss(self.adapter.head(hidden))


def block_gradients(walk: Walk) -> list[torch.Tensor]:
    """d loss / d (input of block k) for k = 1..num_blocks - 1, from one connected forward."""
    hidden = walk.states[0].detach()
    inputs = []
    for k in range(walk.num_blocks):
        if k > 0:
            hidden.retain_grad()
            inputs.append(hidden)
        hidden = walk.adapter.run_block(k, hidden if k else hidden.requires_grad_(True), walk.context)
    loss = F.cross_entropy(walk.adapter.head(hidden)[:, :-1].flatten(0, 1), walk.ids[:, 1:].flatten())
    loss.backward()
    return [x.grad.detach() for x in inputs]


def statistics(x: torch.Tensor) -> dict:
    """Outlier statistics of a (batch, tokens, hidden) tensor."""
    flat = x.detach().flatten(0, 1).float()
    channel_max = flat.abs().amax(0)
    top = torch.topk(channel_max, 3)
    token_norm = x.detach().float().norm(dim=-1)  # (batch, tokens)
    position_max = token_norm.amax(0)
    centred = flat - flat.mean()
    kurtosis = (centred.pow(4).mean() / centred.pow(2).mean().pow(2) - 3).item()
    return {
        "channel_max": channel_max.max().item(),
        "channel_median": channel_max.median().item(),
        "channel_ratio": (channel_max.max() / channel_max.median()).item(),
        "top_channels": top.indices.tolist(),
        "token_ratio": (token_norm.max() / token_norm.median()).item(),
        "token_position": int(position_max.argmax()),
        "kurtosis": kurtosis,
    }


def stage_boundaries(adapter, stages: int) -> list[int]:
    """The first block of stages 1..S-1 where the plan's default split places them."""
    return [r.start for r in stage_ranges(adapter, Plan(num_stages=stages))[1:]]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, eval_blocks=8, seq_len=256, quick=False)
    p.add_argument("--single", type=int, nargs="+", default=[2, 4, 8, 12, 16, 20, 24, 28],
                   help="blocks whose input gets the codec alone")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--codecs", nargs="+", default=None, help="labels (default: all)")
    p.add_argument("--name", default="real_model_boundaries")
    p.add_argument("--inference-form", action="store_true",
                   help="measure what evaluation sends by default (Compression.inference='auto') instead of each codec")
    p.add_argument("--device", default="cpu", help="where the model runs (e.g. cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the weights' and activations' dtype (the codecs see activations of this dtype)")
    args = p.parse_args(argv)
    if args.quick:
        args.eval_blocks, args.seq_len, args.single, args.stages = 2, 64, [8], [4]
        args.codecs = args.codecs or ["bf16", "hadamard 4", "quantize 4"]
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    started = time.time()
    model, tokenizer = smollm2.load(getattr(torch, args.dtype))
    model.to(args.device)
    _, held_out = smollm2.stdlib_blocks(tokenizer, args.seq_len, train_blocks=1, eval_blocks=args.eval_blocks)
    ids = torch.tensor(held_out["input_ids"], device=args.device)
    walk = Walk(model, ids)
    base = walk.loss(walk.adapter.head(walk.states[-1]))
    print(f"plain eval loss {base:.4f} ({time.time() - started:.0f} s)", flush=True)
    grads = block_gradients(walk)
    stats = [{"block": k, "activation": statistics(walk.states[k]), "gradient": statistics(grads[k - 1])}
             for k in range(1, walk.num_blocks)]
    settings = codec_settings()
    labels = args.codecs or list(settings)
    unknown = sorted(set(labels) - set(settings))
    if unknown:
        p.error(f"--codecs {unknown}: allowed {list(settings)}")
    places = [(f"block {k} only", [k]) for k in args.single]
    places += [(f"{s} stages", stage_boundaries(walk.adapter, s)) for s in args.stages]
    costs = []
    for label in labels:
        apply, bits = roundtrip(settings[label], args.inference_form)
        row = {"codec": label, "bits_per_element": bits(tuple(ids.shape) + (model.config.hidden_size,)), "cost": {}}
        for place, boundaries in places:
            loss = walk.loss_with(boundaries, apply)
            row["cost"][place] = 100 * (loss / base - 1)
        costs.append(row)
        print(f"[{time.time() - started:5.0f} s] {label}: " + ", ".join(f"{k} {v:+.2f}%" for k, v in row["cost"].items()),
              flush=True)
    write(args, base, stats, costs, [name for name, _ in places], time.time() - started)


def where(device: str) -> str:
    """The device in words: the GPU's name, or this CPU."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "this CPU"


def cost_table(costs: list[dict], places: list[str]) -> list[str]:
    """Markdown rows: each codec's bits per element, its ratio to fp32 and its cost at each place."""
    lines = ["| codec | bits/elem | fp32 / payload | " + " | ".join(places) + " |",
             "|---|---:|---:|" + "---:|" * len(places)]
    for row in costs:
        lines.append(f"| {row['codec']} | {row['bits_per_element']:.2f} | {32 / row['bits_per_element']:.1f}x | "
                     + " | ".join(f"{row['cost'][p]:+.2f}%" for p in places) + " |")
    return lines


def write(args, base: float, stats: list[dict], costs: list[dict], places: list[str], seconds: float) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump({"args": vars(args), "plain_eval_loss": base, "statistics": stats, "costs": costs,
                   "seconds": seconds}, f, indent=1)
    lines = [
        "# SmolLM2-135M-Instruct: boundary statistics and the inference cost of each forward codec",
        "",
        f"`benchmarks/real_model_boundaries.py`: {args.eval_blocks} held-out blocks of {args.seq_len} tokens of "
        f"stdlib source (benchmarks/smollm2.py), plain eval loss {base:.4f}; weights dequantized from the "
        f"Q4_1 GGUF, run in {getattr(args, 'dtype', 'float32')} on {where(getattr(args, 'device', 'cpu'))}; "
        f"{seconds / 60:.1f} min. Deterministic: one run.",
        "",
        "## Eval-loss cost of " + ("each codec's inference form (`Compression.inference='auto'`, the default: "
                                   "hadamard_outliers 6 wherever the codec was measured not to hold)"
                                   if getattr(args, "inference_form", False) else "a forward codec at inference")
        + " (vs plain)",
        "",
        "Block k: the codec on the input of block k alone. S stages: at every boundary of the default split.",
        "",
        *cost_table(costs, places),
    ]
    lines += ["", "## Boundary statistics across depth", "",
              "Per-channel max |x| over all tokens: its largest / median value and ratio, the 3 largest channels; "
              "token norm: largest / median and the position of the largest; excess kurtosis of all values.", "",
              "| block input | act. channel max | median | ratio | top channels | token ratio | at position | kurtosis "
              "| grad. channel ratio | top channels | token ratio | at position | kurtosis |",
              "|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for s in stats:
        a, g = s["activation"], s["gradient"]
        lines.append(f"| {s['block']} | {a['channel_max']:.1f} | {a['channel_median']:.2f} | {a['channel_ratio']:.0f} | "
                     f"{a['top_channels']} | {a['token_ratio']:.1f} | {a['token_position']} | {a['kurtosis']:.0f} | "
                     f"{g['channel_ratio']:.0f} | {g['top_channels']} | {g['token_ratio']:.1f} | {g['token_position']} | "
                     f"{g['kurtosis']:.0f} |")
    write_markdown(RESULTS, args.name, lines)


if __name__ == "__main__":
    main()
