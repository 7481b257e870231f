"""`hf-actcomp inspect DIR`: the plan, every rank's compression state, the measured traffic and the
card's metadata of a saved run or checkpoint.

It reads tensor shapes from the safetensors headers and loads only the small tensors it
summarises, so it runs on a laptop next to a large checkpoint.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re

from safetensors import safe_open

from ..hub.card import CARD_NAME
from ..plan import CONFIG_NAME, Plan
from ..state.compression import COMPRESSION_STATE_DIR
from ..state.run_results import load_results
from .formatting import size_text


def add_parser(sub: argparse._SubParsersAction) -> None:  # argparse's only name for the type
    """Register `inspect` on the command's subparsers."""
    p = sub.add_parser("inspect", help="the plan, each rank's compression state and the card of a saved run",
                       description="Show the plan (actcomp_config.json), every rank's compression state (tensor "
                                   "sizes, how full the AQ-SGD memory is, error-feedback norms), the measured "
                                   "traffic and the model card's metadata of a saved run or checkpoint.")
    p.add_argument("directory", help="a folder written by save_pretrained / ActCompTrainer (or a checkpoint)")
    p.set_defaults(run=inspect_command)


def inspect_command(args: argparse.Namespace) -> int:
    """Print the plan, each rank's compression state, the measured traffic and the card's metadata."""
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
    results = load_results(directory)
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
    card_path = os.path.join(directory, CARD_NAME)
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
                line = f"  {name}: {dtype} {list(shape)} ({size_text(numel * _itemsize(dtype))})"
                if name.endswith("memory.seen"):
                    seen = f.get_tensor(name)
                    line += f", AQ-SGD memory {int(seen.sum())}/{seen.numel()} samples filled ({seen.float().mean():.0%})"
                elif re.search(r"\.(error|estimate)\.\d+$", name) or name == "tie.error":
                    line += f", norm {f.get_tensor(name).float().norm():.4g}"
                lines.append(line)
    return lines


def _itemsize(dtype: str) -> float:
    """Bytes per element of a safetensors dtype name, read from the header without loading."""
    return {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1}.get(dtype, 4)
