"""What splitting a stage's backward into `B` (input gradient) and `W` (weight gradient) costs.

Zero-bubble schedules (`Plan(schedule="zbh1")`) only pay when `B + W` costs about what one
backward does. Three ways, on one pipeline stage, in one process with one CPU thread:

- `one backward`: `out.backward(grad)` (what GPipe and 1F1B run);
- `torch graph split`: torch.distributed.pipelining's `stage_backward_input` then
  `stage_backward_weight` (private in torch 2.13: walks the autograd graph each micro-batch);
- `layer store` (ours, hf_actcomp/pipeline/split_backward.py): a plain backward in which the linear
  layers hold back their weight products, then those products.

Stages: 2 decoder blocks taken from the middle of a model (a stage that receives activations and
sends gradients back), hidden 256, 4 heads, vocabulary 256, 2 sequences of 64 tokens per
micro-batch (the schedules benchmark's stage, benchmarks/results/schedules.md); GPT-2 (Conv1D
layers) and Llama (nn.Linear, MLP 688). Per round and method, the median over `--iters`
micro-batches of forward, B and W milliseconds; rounds alternate the methods' order; each cell is
the median over rounds [fastest-slowest round]. Every method's gradients (input and every
parameter) are checked against one backward first.

    .venv/bin/python benchmarks/split_backward.py            # ~1 minute

Writes benchmarks/results/split_backward.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch
from harness import add_arguments, busy_cpu_seconds, other_cpu_share

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_actcomp.models import get_adapter  # noqa: E402
from hf_actcomp.pipeline.split_backward import WeightGradients, defer_weight_gradients  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
METHODS = ("one backward", "torch graph split", "layer store")


def make_stage(family: str, args) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(n_embd=args.hidden, n_head=4, n_layer=4, vocab_size=256, n_positions=args.seq_len,
                            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(hidden_size=args.hidden, num_attention_heads=4, num_key_value_heads=4,
                             intermediate_size=688, num_hidden_layers=4, vocab_size=256, bos_token_id=0,
                             eos_token_id=0)
        model = LlamaForCausalLM(config)
    return get_adapter(model).build_stage(1, 3, first=False, last=False)


def micro_batch(stage, store: WeightGradients, method: str, x, grad, mask) -> tuple[float, float, float]:
    """(forward, B, W) seconds of one micro-batch; the gradients land in `.grad`."""
    start = time.perf_counter()
    with store.routed() if method == "layer store" else contextlib.nullcontext():  # as zbh1 runs a split one
        out = stage(x, mask)
    forward = time.perf_counter()
    if method == "one backward":
        out.backward(grad)
        return forward - start, time.perf_counter() - forward, 0.0
    weights = [p for p in stage.parameters() if p.requires_grad]
    if method == "torch graph split":
        _, groups = stage_backward_input([out], [grad], [x], iter(weights))
        b = time.perf_counter()
        stage_backward_weight(iter(weights), groups)
    else:
        with store.deferring(0):
            out.backward(grad)
        b = time.perf_counter()
        if not store.pending.get(0):
            raise RuntimeError("The layer store held back no weight gradient: the forward did not run routed.")
        store.compute(0)
    return forward - start, b - forward, time.perf_counter() - b


def inputs(args, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(args.micro_batch_size, args.seq_len, args.hidden, generator=g).requires_grad_(True)
    grad = torch.randn(args.micro_batch_size, args.seq_len, args.hidden, generator=g)
    return x, grad, torch.ones(args.micro_batch_size, args.seq_len, dtype=torch.long)


def check_gradients(stages: dict, stores: dict, args) -> dict[str, float]:
    """Largest |difference| / max |reference| over the input and every parameter, per method."""
    results = {}
    grads = {}
    for method in METHODS:
        stages[method].zero_grad(set_to_none=True)
        x, grad, mask = inputs(args, seed=123)
        micro_batch(stages[method], stores[method], method, x, grad, mask)
        grads[method] = [x.grad] + [p.grad for p in stages[method].parameters()]
    for method in METHODS:
        results[method] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                              for a, b in zip(grads[method], grads["one backward"], strict=True))
    return results


def measure(args) -> dict:
    rows = {}
    for family in args.families:
        base = make_stage(family, args)
        stages = {m: copy.deepcopy(base) for m in METHODS}
        stores = {m: WeightGradients() for m in METHODS}
        routed = defer_weight_gradients(stages["layer store"], stores["layer store"])
        errors = check_gradients(stages, stores, args)
        per_round = {m: [] for m in METHODS}
        for r in range(args.rounds):
            order = METHODS if r % 2 == 0 else METHODS[::-1]
            for method in order:
                times = []
                for i in range(args.warmup + args.iters):
                    x, grad, mask = inputs(args, seed=i)
                    t = micro_batch(stages[method], stores[method], method, x, grad, mask)
                    if i >= args.warmup:
                        times.append(t)
                per_round[method].append([statistics.median(c) * 1e3 for c in zip(*times, strict=True)])
        rows[family] = {"routed_layers": routed, "max_relative_gradient_difference": errors,
                        "rounds_ms": per_round}
    return rows


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def summarize(data: dict) -> str:
    lines = [
        "# Splitting a stage's backward: one backward vs torch's graph split vs our layer store",
        "",
        f"Machine: {data['machine']}; torch {data['torch']}, 1 CPU thread, one process. "
        f"Other processes used {data['other_cpu']:.0%} of the CPUs during the run. Compute-bound "
        "(no link): this is the cost a zero-bubble schedule pays per micro-batch for moving `W`.",
        "",
        f"Stage: 2 decoder blocks from the middle of a 4-block model, hidden {data['args']['hidden']}, 4 heads, "
        f"{data['args']['micro_batch_size']} x {data['args']['seq_len']} tokens per micro-batch (the schedules "
        f"benchmark's stage). {data['args']['rounds']} rounds alternating the methods' order, each the median of "
        f"{data['args']['iters']} micro-batches after {data['args']['warmup']}; cells: median over rounds "
        "[fastest-slowest round], milliseconds. **B + W vs one backward**: the split's extra cost (median rounds).",
        "",
        "| model | method | forward ms | B ms | W ms | B + W ms | B + W vs one backward | max rel. gradient diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family, row in data["rows"].items():
        one = statistics.median(r[1] + r[2] for r in row["rounds_ms"]["one backward"])
        for method in METHODS:
            rounds = row["rounds_ms"][method]
            total = [r[1] + r[2] for r in rounds]
            extra = statistics.median(total) - one
            lines.append(f"| {family} | {method} | {cell([r[0] for r in rounds])} | {cell([r[1] for r in rounds])} | "
                         f"{cell([r[2] for r in rounds])} | {cell(total)} | "
                         f"{'' if method == 'one backward' else f'{extra:+.2f} ms ({extra / one:+.0%})'} | "
                         f"{row['max_relative_gradient_difference'][method]:.1e} |")
    lines += ["", "Layers routed through the store: " + ", ".join(
        f"{family} {row['routed_layers']}" for family, row in data["rows"].items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, hidden=256, seq_len=64, micro_batch_size=2, rounds=6, warmup=3)
    p.add_argument("--families", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--name", default="split_backward")
    args = p.parse_args()
    torch.set_num_threads(1)
    busy0, wall0, cpu0 = busy_cpu_seconds()[0], time.perf_counter(), time.process_time()
    rows = measure(args)
    other = other_cpu_share(busy_cpu_seconds()[0] - busy0, [time.process_time() - cpu0], time.perf_counter() - wall0)
    data = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "torch": torch.__version__, "args": vars(args), "other_cpu": other, "rows": rows}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = summarize(data)
    with open(os.path.join(RESULTS, f"{args.name}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
