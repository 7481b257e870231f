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
from typing import Any, Protocol

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..plan import FORMAT_VERSION
from .keys import prefixed, unprefixed

DEFAULT_MAX_SHARD_SIZE = "2GB"
# Where `accelerator.save_state(dir)` puts every rank's compression state: `dir/actcomp_state`.
COMPRESSION_STATE_DIR = "actcomp_state"


def _plan_fingerprint(plan_dict: dict[str, Any]) -> dict[str, Any]:
    """The plan fields that decide the shape and meaning of the saved state."""
    keep = ("num_stages", "split_points", "forward", "backward", "data_parallel", "dp_compression", "dp_hook",
            "tie_compression", "boundaries")
    fingerprint = {k: plan_dict.get(k) for k in keep}
    memory = plan_dict.get("memory") or {}
    fingerprint["memory"] = {k: memory.get(k) for k in ("dtype", "num_samples")}
    return fingerprint


def model_fingerprint(config) -> dict[str, Any]:
    """What identifies a model's shape in saved state: its family and sizes (`config` of a
    transformers model)."""
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    return {k: getattr(config, k, None) for k in keys}


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


def saved_metadata(directory: str | os.PathLike, rank: int) -> dict[str, Any]:
    """The metadata `save_state` wrote for `rank` (plan, stage, world size, files), unchecked."""
    meta_path = os.path.join(directory, f"rank{rank}.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(
            f"No compression state for rank {rank} in {directory} (missing rank{rank}.json). "
            "Was it saved by a run with as many processes?"
        )
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except ValueError as err:
        raise ValueError(f"{meta_path} cannot be read ({err}); the file is truncated or damaged.") from err
    return meta


def load_state(directory: str | os.PathLike, rank: int, expected: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Read the state of `rank`, after checking its metadata against `expected` (plan, stage,
    world size)."""
    meta = saved_metadata(directory, rank)
    meta_path = os.path.join(directory, f"rank{rank}.json")
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
    for key in ("world_size", "stage", "blocks", "model"):
        if key == "model" and "model" not in meta:  # saved before the model was recorded
            continue
        if meta.get(key) != expected.get(key):
            problems.append(f"{key}: saved {meta.get(key)!r}, running {expected.get(key)!r}")
    if problems:
        raise ValueError(
            f"The compression state in {directory} was saved under another plan or layout and cannot be "
            "loaded into this one:\n  " + "\n  ".join(problems)
        )
    state: dict[str, torch.Tensor] = {}
    for filename in meta["files"]:
        path = os.path.join(directory, filename)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {meta_path} lists it. The state was not written completely.")
        try:
            state.update(load_file(path))  # memory-mapped, read when used
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{path} cannot be read ({err}); the file is truncated or damaged.") from err
    return state



class Stateful(Protocol):
    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


class CompressionState:
    """Everything one rank keeps for compression, saved and loaded as one: named parts (the
    boundary ends, the tied embedding's end, the data-parallel hook), each with
    `state_dict` / `load_state_dict`, under their names as key prefixes
    (`boundary0.forward.sender.memory`, `tie.copy`, `data_parallel.error`).

    The simulation (one process, rank 0, every stage) and each rank of a pipeline build one, so
    both save, load and check state the same way.

    Args:
        parts: name -> stateful part; `None` entries are skipped (a part this rank lacks).
        rank: which `rank{r}` files this state is.
        metadata: what `load` checks the saved state against (`plan` as a dict, `world_size`,
            `stage`, `blocks`).
    """

    def __init__(self, parts: dict[str, Stateful | None], rank: int, metadata: dict[str, Any]) -> None:
        self.parts = {name: part for name, part in parts.items() if part is not None}
        self.rank = rank
        self.metadata = metadata

    def state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for name, part in self.parts.items():
            state.update(prefixed(part.state_dict(), name))
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, part in self.parts.items():
            part.load_state_dict(unprefixed(state, name))

    def save(self, directory: str | os.PathLike, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        """Write this rank's files (`rank{r}.json` and its safetensors) to `directory`."""
        save_state(directory, self.rank, self.state_dict(), self.metadata, max_shard_size=max_shard_size)

    def read(self, directory: str | os.PathLike) -> dict[str, torch.Tensor]:
        """The state written by `save`, checked against this plan, layout and model, not applied."""
        return load_state(directory, self.rank, self.metadata)

    def load(self, directory: str | os.PathLike) -> None:
        """Read state written by `save` under the same plan, layout and model (checked first)."""
        self.load_state_dict(self.read(directory))

    def register_for_checkpointing(self, accelerator) -> None:
        """`accelerator.save_state(dir)` / `load_state(dir)` also save / load this state under
        `dir/actcomp_state` (Accelerate saves custom objects on the main process only, so every
        rank registers its own hooks)."""

        register_state_hooks(accelerator, lambda d: self.save(d), lambda d: self.load(d))


def register_state_hooks(accelerator, save, load) -> None:
    """Have `accelerator.save_state(dir)` / `load_state(dir)` call `save(path)` / `load(path)` with
    `path = dir/actcomp_state` on this rank, before Accelerate's own state. Pass callables that
    look the state up when they run: Plan.auto may replace it after this call."""

    def save_hook(models, weights, output_dir):
        save(os.path.join(output_dir, COMPRESSION_STATE_DIR))

    def load_hook(models, input_dir):
        load(os.path.join(input_dir, COMPRESSION_STATE_DIR))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
