"""`hf-actcomp estimate`: what a plan sends per step over a given link, or what `Plan.auto` would
choose there, printed before training.

The arguments are read and the tables printed here; the numbers come from `plan_estimate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..plan import AUTO_QUALITY, AutoConfig, Plan
from ..plan.codec_choice import describe as describe_decision
from ..plan.estimate import auto_estimate, diloco_estimate, estimate
from .formatting import size_text

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_parser(sub: argparse._SubParsersAction) -> None:  # argparse's only name for the type
    """Register `estimate` on the command's subparsers."""
    p = sub.add_parser("estimate", help="bytes, AQ-SGD memory and link time per step of a plan, before training",
                       description="For each stage boundary and direction: the bytes one optimizer step sends, "
                                   "the AQ-SGD memory and where it lives, and the time on the link. With "
                                   "--compute-seconds, the expected step time and speed-up over sending "
                                   "uncompressed, without overlap (compute + link) and with full overlap "
                                   "(max of compute and the busiest link direction).")
    p.add_argument("--model", required=True, help="a model name or directory (its config.json), or a config JSON file")
    p.add_argument("--plan", required=True, help="plan YAML/JSON file, or a directory with actcomp_config.json")
    p.add_argument("--batch-size", type=int, required=True, help="rows per optimizer step (per replica)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per row")
    p.add_argument("--link", default="100mbit",
                   help="link rate, e.g. 50mbit, 100mbit, 1gbit, 10gbps (default 100mbit); with --auto one per "
                        "boundary may be given, comma-separated (e.g. 1gbit,10mbit)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="dtype of the activations sent")
    p.add_argument("--num-samples", type=int, default=None, help="training rows (AQ-SGD memory), if the plan has none")
    p.add_argument("--compute-seconds", type=float, default=None, help="measured compute seconds per step")
    p.add_argument("--auto", action="store_true",
                   help="show what Plan.auto would choose per boundary and direction for these links and "
                        "--compute-seconds (the busiest stage's seconds per step), without running anything")
    p.add_argument("--rtt", default="0",
                   help="--auto: the links' round trip in ms (one, or one per boundary, comma-separated)")
    p.add_argument("--quality", choices=AUTO_QUALITY, default=None,
                   help="--auto: the quality level (default: the plan's, if it is a Plan.auto plan, else safe)")
    p.add_argument("--aqsgd", action="store_true", help="--auto: pick AQ-SGD for activations (default: the plan's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=estimate_command)


def parse_link(text: str) -> float:
    """'100mbit' -> 1e8 bits per second (tc's units: kbit, mbit, gbit; kbps, mbps, gbps are bytes)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(f"--link {text!r} is not a rate; use a number and one of {', '.join(_UNITS)} (e.g. 100mbit).")
    return float(match.group(1)) * _UNITS[unit]


def per_boundary(text: str, num_boundaries: int, parse: Callable[[str], float], flag: str) -> list[float]:
    """One value per boundary from `text`: a single value for all, or exactly one per boundary."""
    values = [parse(v) for v in text.split(",")]
    if len(values) == 1:
        return values * num_boundaries
    if len(values) != num_boundaries:
        raise ValueError(f"{flag} {text!r} gives {len(values)} values; give one, or one per boundary "
                         f"({num_boundaries}).")
    return values


def load_config(name_or_path: str) -> PretrainedConfig:
    """`--model`: a config JSON file, or a Hub name or directory (its config.json only, no weights)."""
    from transformers import AutoConfig

    if os.path.isfile(name_or_path):
        with open(name_or_path, encoding="utf-8") as f:
            data = json.load(f)
        return AutoConfig.for_model(data.pop("model_type"), **data)
    return AutoConfig.from_pretrained(name_or_path)


def load_plan_file(path: str) -> Plan:
    """`--plan`: a plan YAML/JSON file, or a saved directory with actcomp_config.json."""
    if os.path.isdir(path):
        return Plan.from_pretrained(path)
    return Plan.from_file(path)


def estimate_command(args: argparse.Namespace) -> int:
    """Print the estimate as a table (or JSON); with --auto, what Plan.auto would choose instead."""
    config = load_config(args.model)
    plan = load_plan_file(args.plan)
    if args.auto:
        return auto_estimate_command(args, config, plan)
    result = estimate(config, plan, args.batch_size, args.seq_len, parse_link(args.link), _DTYPES[args.dtype],
                      args.num_samples, args.compute_seconds)
    if plan.diloco is not None:
        result["diloco"] = {"method": plan.diloco.label(), "sync_every": plan.diloco.sync_every,
                            "fragments": plan.diloco.fragments,
                            "stages": diloco_estimate(config, plan, parse_link(args.link))}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"plan: {plan.num_stages} stages, {plan.micro_batches} micro-batches, forward {plan.forward.describe()}, "
          f"backward {plan.backward.describe()}; batch {args.batch_size} x {args.seq_len} tokens, hidden "
          f"{result['hidden_size']}, {args.dtype}, link {args.link}")
    print("| boundary | direction | codec | bytes per step | ratio | AQ-SGD memory |")
    print("|---|---|---|---|---|---|")
    for e in result["boundaries"]:
        memory = (f"{size_text(e['aqsgd_memory_bytes'])} ({e['aqsgd_memory_store']})"
                  if "aqsgd_memory_bytes" in e else "")
        first = (f" (first epoch {size_text(e['first_epoch_forward_bytes'])}, {e['first_visit']})"
                 if "first_epoch_forward_bytes" in e else "")
        print(f"| {e['boundary']} | forward | {e['forward']} | {size_text(e['forward_bytes'])}{first} | "
              f"{e['forward_ratio']:.2f}x | {memory} |")
        print(f"| {e['boundary']} | backward | {e['backward']} | {size_text(e['backward_bytes'])} | "
              f"{e['backward_ratio']:.2f}x | |")
    print(f"link time per step: {result['link_seconds_per_step']:.3f} s "
          f"(uncompressed {result['link_seconds_per_step_uncompressed']:.3f} s; both directions, all boundaries)")
    if "tie_compression" in result:
        print(f"tied embedding rows: at most {size_text(result['tied_embedding_bytes_at_most'])} per step "
              f"({result['tie_compression']}: rows as deltas, gradient rows with error feedback; exact fp32 "
              f"{size_text(result['tied_embedding_bytes_at_most_uncompressed'])})")
    elif "tied_embedding_bytes_at_most" in result:
        print(f"tied embedding rows: at most {size_text(result['tied_embedding_bytes_at_most'])} per step "
              "(fp32, exact)")
    if "diloco" in result:
        fragments = plan.diloco.fragments
        streaming = (f"; {fragments} fragments in turn, one every {plan.diloco.fragment_every} steps: bytes per sync "
                     "are the largest fragment's" if fragments > 1 else "")
        print(f"data parallel: {plan.data_parallel} replicas, {result['diloco']['method']} (an outer step every "
              f"{result['diloco']['sync_every']} optimizer steps{streaming}; bytes each replica sends)")
        print("| stage | parameters | bytes per sync | bytes per step | vs DDP every step | link time per sync |")
        print("|---|---|---|---|---|---|")
        for e in result["diloco"]["stages"]:
            print(f"| {e['stage']} | {e['parameters']:,} | {size_text(e['bytes_per_sync'])} | "
                  f"{size_text(e['bytes_per_step'])} | {e['ratio_vs_ddp']:.0f}x fewer | "
                  f"{e['link_seconds_per_sync']:.3f} s |")
    if "expected_speedup" in result:
        print(f"expected step time: {result['step_seconds']:.3f} s vs {result['step_seconds_uncompressed']:.3f} s "
              f"uncompressed: {result['expected_speedup']:.2f}x without overlap (compute + link); "
              f"{result['step_seconds_overlapped']:.3f} s vs {result['step_seconds_overlapped_uncompressed']:.3f} s: "
              f"{result['expected_speedup_overlapped']:.2f}x with full overlap (max of compute and the busiest link "
              "direction; the schedule's dependencies put a real step between the two)")
    return 0


def auto_estimate_command(args: argparse.Namespace, config: PretrainedConfig, plan: Plan) -> int:
    """`estimate --auto`: print Plan.auto's choice per boundary and direction for the given links."""
    if args.compute_seconds is None:
        raise ValueError("--auto needs --compute-seconds: the busiest stage's forward and backward seconds per step "
                         "(compute hides the link up to that).")
    base = plan.autotune or AutoConfig()
    auto = dataclasses.replace(base, quality=args.quality or base.quality, aqsgd=args.aqsgd or base.aqsgd,
                               decision=None)
    boundaries = plan.num_stages - 1
    links = per_boundary(args.link, boundaries, parse_link, "--link")
    rtts = per_boundary(args.rtt, boundaries, lambda v: float(v) / 1e3, "--rtt")
    decision = auto_estimate(config, plan, args.batch_size, args.seq_len, links, rtts, args.compute_seconds,
                             _DTYPES[args.dtype], auto)
    if args.json:
        print(json.dumps(decision, indent=2))
        return 0
    print(f"plan: {plan.num_stages} stages, {plan.micro_batches} micro-batches; batch {args.batch_size} x "
          f"{args.seq_len} tokens, hidden {config.hidden_size}, {args.dtype}; compute {args.compute_seconds:g} s "
          "per step (busiest stage)")
    print(describe_decision(decision))
    return 0
