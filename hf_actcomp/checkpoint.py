"""Compression state (error-feedback buffers, AQ-SGD memories, codec counters) <-> safetensors.

Each rank writes its own files, because each rank holds a different stage's state:

    <dir>/rank{r}.json                      plan, stage, world size, shard list
    <dir>/rank{r}.safetensors               or rank{r}-00001-of-0000N.safetensors when sharded

Loading checks the metadata against the running plan first, so state saved under another plan
(other codecs, split or data set size) is a clear error instead of silently wrong buffers.

Neither direction holds a copy of the state in RAM: safetensors (>= 0.8) writes each tensor from
its own memory and `load_file` returns tensors backed by a memory map of the file, whose pages
the kernel reads as they are copied into the running buffers (an AQ-SGD memory store allocates
its host or mmap table at load for that). A memory-mapped AQ-SGD memory of hundreds of GB thus
goes from disk to disk (tests/test_memory.py measures the process's anonymous memory).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file

from .plan import FORMAT_VERSION

DEFAULT_MAX_SHARD_SIZE = "2GB"


def _plan_fingerprint(plan_dict: dict[str, Any]) -> dict[str, Any]:
    """The plan fields that decide the shape and meaning of the saved state."""
    keep = ("num_stages", "split_points", "forward", "backward", "data_parallel", "dp_compression", "dp_hook",
            "tie_compression")
    fingerprint = {k: plan_dict.get(k) for k in keep}
    memory = plan_dict.get("memory") or {}
    fingerprint["memory"] = {k: memory.get(k) for k in ("dtype", "num_samples")}
    return fingerprint


def save_state(directory: str | os.PathLike, rank: int, state: dict[str, torch.Tensor], metadata: dict[str, Any],
               max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write `state` of `rank` (sharded above `max_shard_size`) and its JSON metadata."""
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern=f"rank{rank}{{suffix}}.safetensors", max_shard_size=max_shard_size
    )
    files = []
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, os.path.join(directory, filename), metadata={"format": "pt"})
        files.append(filename)
    meta = dict(metadata, format_version=FORMAT_VERSION, rank=rank, files=sorted(files),
                plan_fingerprint=_plan_fingerprint(metadata["plan"]))
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    return files


def load_state(directory: str | os.PathLike, rank: int, expected: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Read the state of `rank`, after checking its metadata against `expected` (plan, stage,
    world size)."""
    meta_path = os.path.join(directory, f"rank{rank}.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(
            f"No compression state for rank {rank} in {directory} (missing rank{rank}.json). "
            "Was it saved by a run with as many processes?"
        )
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{meta_path} has format_version {meta['format_version']}, newer than this hf-actcomp "
            f"supports ({FORMAT_VERSION}). Upgrade hf-actcomp."
        )
    problems = []
    saved_plan, running_plan = meta["plan_fingerprint"], _plan_fingerprint(expected["plan"])
    for key in running_plan:
        if saved_plan.get(key) != running_plan[key]:
            problems.append(f"plan.{key}: saved {saved_plan.get(key)!r}, running {running_plan[key]!r}")
    for key in ("world_size", "stage", "blocks"):
        if meta.get(key) != expected.get(key):
            problems.append(f"{key}: saved {meta.get(key)!r}, running {expected.get(key)!r}")
    if problems:
        raise ValueError(
            f"The compression state in {directory} was saved under another plan or layout and cannot be "
            "loaded into this one:\n  " + "\n  ".join(problems)
        )
    state: dict[str, torch.Tensor] = {}
    for filename in meta["files"]:
        state.update(load_file(os.path.join(directory, filename)))  # memory-mapped, read when used
    return state

