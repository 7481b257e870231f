"""The `hf-actcomp` command: inspect a saved run, estimate a plan's traffic, re-render a card.

    hf-actcomp inspect DIR
    hf-actcomp estimate --model NAME_OR_CONFIG --plan plan.yaml --batch-size 8 --seq-len 1024 --link 100mbit
    hf-actcomp card DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import sys

import torch
from safetensors import safe_open

from . import hub
from .auto import describe as describe_decision
from .checkpoint import COMPRESSION_STATE_DIR
from .plan import AUTO_QUALITY, CONFIG_NAME, AutoConfig, Plan
from .plan_estimate import (
    auto_estimate,
    diloco_estimate,
    estimate,
    first_visit_label,
    stage_parameter_counts,
)

__all__ = [
    "auto_estimate",
    "auto_estimate_command",
    "build_parser",
    "card_command",
    "describe_rank_state",
    "diloco_estimate",
    "estimate",
    "estimate_command",
    "first_visit_label",
    "inspect_command",
    "load_config",
    "load_plan_file",
    "main",
    "parse_link",
    "per_boundary",
    "stage_parameter_counts",
]

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"hf-actcomp {args.command}: error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-actcomp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="the plan, each rank's compression state and the card of a saved run",
                       description="Show the plan (actcomp_config.json), every rank's compression state (tensor "
                                   "sizes, how full the AQ-SGD memory is, error-feedback norms), the measured "
                                   "traffic and the model card's metadata of a saved run or checkpoint.")
    p.add_argument("directory", help="a folder written by save_pretrained / ActCompTrainer (or a checkpoint)")
    p.set_defaults(run=inspect_command)

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

    p = sub.add_parser("card", help="re-render README.md (the model card) from a run's saved results",
                       description="Render the model card of DIR again from actcomp_config.json, "
                                   "actcomp_results.json and the model's config, and write DIR/README.md.")
    p.add_argument("directory")
    p.add_argument("--repo-id", default=None, help="the Hub repo the card will live in (used in the snippets)")
    p.add_argument("--base-model", default=None, help="the Hub model it was fine-tuned from")
    p.add_argument("--dataset", action="append", default=None, help="a Hub dataset it was trained on (repeatable)")
    p.set_defaults(run=card_command)
    return parser


# ----------------------------------------------------------------------------- inspect
def inspect_command(args: argparse.Namespace) -> int:
    directory = args.directory
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is not a directory.")
    plan = None
    if os.path.isfile(os.path.join(directory, CONFIG_NAME)):
        plan = Plan.from_pretrained(directory)
        print(f"plan ({CONFIG_NAME}):")
        for line in plan.to_yaml_string().strip().splitlines():
            print(f"  {line}")
    else:
        print(f"plan: no {CONFIG_NAME} in {directory}")
    state_dir = os.path.join(directory, COMPRESSION_STATE_DIR)
    state_dir = state_dir if os.path.isdir(state_dir) else directory
    ranks = sorted(glob.glob(os.path.join(state_dir, "rank*.json")))
    print(f"\ncompression state ({len(ranks)} rank(s) in {state_dir}):" if ranks else "\ncompression state: none saved")
    for path in ranks:
        for line in describe_rank_state(path):
            print(f"  {line}")
    results = hub.load_results(directory)
    stats = results.get("stats") or {}
    if stats.get("bytes_sent"):
        print(f"\nmeasured traffic: {stats['bytes_sent']:,} bytes sent, {stats['bytes_uncompressed']:,} uncompressed "
              f"({stats['compression_ratio']:.2f}x)")
        for name, c in sorted((stats.get("channels") or {}).items()):
            print(f"  {name}: {c['bytes_sent']:,} bytes ({c['compression_ratio']:.2f}x), "
                  f"relative error {c['relative_error']:.4f}")
        tie = (stats.get("categories") or {}).get("tie") or {}
        if tie.get("bytes_sent"):
            codec = plan.tie_compression.describe() if plan is not None and plan.tie_compression else "exact"
            print(f"  tied embedding rows ({codec}): {tie['bytes_sent']:,} bytes ({tie['compression_ratio']:.2f}x)")
    card_path = os.path.join(directory, hub.CARD_NAME)
    if os.path.isfile(card_path):
        from huggingface_hub import ModelCard

        data = ModelCard.load(card_path).data.to_dict()
        print("\nmodel card metadata:")
        for key in ("library_name", "base_model", "datasets", "pipeline_tag", "tags"):
            if data.get(key):
                print(f"  {key}: {data[key]}")
        for entry in data.get("model-index", []):
            for result in entry.get("results", []):
                for metric in result.get("metrics", []):
                    print(f"  {metric.get('name', metric['type'])}: {metric['value']}")
    return 0


def describe_rank_state(meta_path: str) -> list[str]:
    """One rank's saved compression state: its tensors by size, AQ-SGD fill, feedback norms."""
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    lines = [f"rank {meta['rank']}: stage {meta['stage']}, blocks {meta['blocks']}, world size {meta['world_size']}"]
    folder = os.path.dirname(meta_path)
    for filename in meta["files"]:
        with safe_open(os.path.join(folder, filename), framework="pt") as f:
            for name in sorted(f.keys()):
                part = f.get_slice(name)
                shape, dtype = part.get_shape(), part.get_dtype()
                numel = math.prod(shape)
                line = f"  {name}: {dtype} {list(shape)} ({_size(numel * _itemsize(dtype))})"
                if name.endswith("memory.seen"):
                    seen = f.get_tensor(name)
                    line += f", AQ-SGD memory {int(seen.sum())}/{seen.numel()} samples filled ({seen.float().mean():.0%})"
                elif re.search(r"\.(error|estimate)\.\d+$", name) or name == "tie.error":
                    line += f", norm {f.get_tensor(name).float().norm():.4g}"
                lines.append(line)
    return lines


def _itemsize(dtype: str) -> float:
    return {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1}.get(dtype, 4)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""  # pragma: no cover


# ----------------------------------------------------------------------------- estimate
def parse_link(text: str) -> float:
    """'100mbit' -> 1e8 bits per second (tc's units: kbit, mbit, gbit; kbps, mbps, gbps are bytes)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(f"--link {text!r} is not a rate; use a number and one of {', '.join(_UNITS)} (e.g. 100mbit).")
    return float(match.group(1)) * _UNITS[unit]


def load_config(name_or_path: str):
    from transformers import AutoConfig

    if os.path.isfile(name_or_path):
        with open(name_or_path, encoding="utf-8") as f:
            data = json.load(f)
        return AutoConfig.for_model(data.pop("model_type"), **data)
    return AutoConfig.from_pretrained(name_or_path)


def load_plan_file(path: str) -> Plan:
    if os.path.isdir(path):
        return Plan.from_pretrained(path)
    return Plan.from_file(path)


def per_boundary(text: str, num_boundaries: int, parse, flag: str) -> list[float]:
    """One value per boundary from `text`: a single value for all, or exactly one per boundary."""
    values = [parse(v) for v in text.split(",")]
    if len(values) == 1:
        return values * num_boundaries
    if len(values) != num_boundaries:
        raise ValueError(f"{flag} {text!r} gives {len(values)} values; give one, or one per boundary "
                         f"({num_boundaries}).")
    return values


def estimate_command(args: argparse.Namespace) -> int:
    config = load_config(args.model)
    plan = load_plan_file(args.plan)
    if args.auto:
        return auto_estimate_command(args, config, plan)
    result = estimate(config, plan, args.batch_size, args.seq_len, parse_link(args.link), _DTYPES[args.dtype],
                      args.num_samples, args.compute_seconds)
    if plan.diloco is not None:
        result["diloco"] = {"method": plan.diloco.label(), "sync_every": plan.diloco.sync_every,
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
        memory = (f"{_size(e['aqsgd_memory_bytes'])} ({e['aqsgd_memory_store']})" if "aqsgd_memory_bytes" in e else "")
        first = (f" (first epoch {_size(e['first_epoch_forward_bytes'])}, {e['first_visit']})"
                 if "first_epoch_forward_bytes" in e else "")
        print(f"| {e['boundary']} | forward | {e['forward']} | {_size(e['forward_bytes'])}{first} | "
              f"{e['forward_ratio']:.2f}x | {memory} |")
        print(f"| {e['boundary']} | backward | {e['backward']} | {_size(e['backward_bytes'])} | "
              f"{e['backward_ratio']:.2f}x | |")
    print(f"link time per step: {result['link_seconds_per_step']:.3f} s "
          f"(uncompressed {result['link_seconds_per_step_uncompressed']:.3f} s; both directions, all boundaries)")
    if "tie_compression" in result:
        print(f"tied embedding rows: at most {_size(result['tied_embedding_bytes_at_most'])} per step "
              f"({result['tie_compression']}: rows as deltas, gradient rows with error feedback; exact fp32 "
              f"{_size(result['tied_embedding_bytes_at_most_uncompressed'])})")
    elif "tied_embedding_bytes_at_most" in result:
        print(f"tied embedding rows: at most {_size(result['tied_embedding_bytes_at_most'])} per step (fp32, exact)")
    if "diloco" in result:
        print(f"data parallel: {plan.data_parallel} replicas, {result['diloco']['method']} (an outer step every "
              f"{result['diloco']['sync_every']} optimizer steps; bytes each replica sends)")
        print("| stage | parameters | bytes per sync | bytes per step | vs DDP every step | link time per sync |")
        print("|---|---|---|---|---|---|")
        for e in result["diloco"]["stages"]:
            print(f"| {e['stage']} | {e['parameters']:,} | {_size(e['bytes_per_sync'])} | {_size(e['bytes_per_step'])} | "
                  f"{e['ratio_vs_ddp']:.0f}x fewer | {e['link_seconds_per_sync']:.3f} s |")
    if "expected_speedup" in result:
        print(f"expected step time: {result['step_seconds']:.3f} s vs {result['step_seconds_uncompressed']:.3f} s "
              f"uncompressed: {result['expected_speedup']:.2f}x without overlap (compute + link); "
              f"{result['step_seconds_overlapped']:.3f} s vs {result['step_seconds_overlapped_uncompressed']:.3f} s: "
              f"{result['expected_speedup_overlapped']:.2f}x with full overlap (max of compute and the busiest link "
              "direction; the schedule's dependencies put a real step between the two)")
    return 0


def auto_estimate_command(args: argparse.Namespace, config, plan: Plan) -> int:
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


# ----------------------------------------------------------------------------- card
def card_command(args: argparse.Namespace) -> int:
    card = hub.write_model_card(args.directory, repo_id=args.repo_id, base_model=args.base_model,
                                datasets=args.dataset)
    print(f"wrote {os.path.join(args.directory, hub.CARD_NAME)} ({len(card.text.splitlines())} lines; tags: "
          f"{', '.join(card.data.tags or [])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
