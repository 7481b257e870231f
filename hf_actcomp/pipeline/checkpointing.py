"""Saving and loading a pipeline: per-rank compression state, Accelerate hooks, the model weights."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from .. import checkpoint
from ..boundary import prefixed, unprefixed
from ..models import unwrap_peft
from .loading import assign_parameters, read_tensors, weight_files

if TYPE_CHECKING:
    from .engine import Pipeline

COMPRESSION_STATE_DIR = "actcomp_state"


def compression_state_dict(pipe: Pipeline) -> dict[str, torch.Tensor]:
    """This rank's EF buffers, AQ-SGD memories, codec counters, data-parallel hook state and, with
    `Plan.tie_compression`, its end of the tie (`tie.copy` and `tie.error` on the first stage,
    `tie.mirror` on the last)."""
    state: dict[str, torch.Tensor] = {}
    for name, boundary in pipe.boundaries.items():
        state.update(prefixed(boundary.state_dict(), name))
    if pipe.tie is not None:
        state.update(prefixed(pipe.tie.state_dict(), "tie"))
    if pipe.dp_compressor is not None:
        state.update(prefixed(pipe.dp_compressor.state_dict(), "data_parallel"))
    return state


def load_compression_state_dict(pipe: Pipeline, state: dict[str, torch.Tensor]) -> None:
    if pipe.dp_compressor is not None:
        pipe.dp_compressor.load_state_dict(unprefixed(state, "data_parallel"))
    for name, boundary in pipe.boundaries.items():
        boundary.load_state_dict(unprefixed(state, name))
    if pipe.tie is not None:
        pipe.tie.load_state_dict(unprefixed(state, "tie"))


def state_metadata(pipe: Pipeline) -> dict:
    r = pipe.ranges[pipe.stage_index]
    return {"plan": pipe.plan.to_dict(), "world_size": pipe.plan.world_size, "stage": pipe.stage_index,
            "blocks": [r.start, r.stop]}


def save_compression_state(pipe: Pipeline, directory: str | os.PathLike,
                           max_shard_size: int | str = checkpoint.DEFAULT_MAX_SHARD_SIZE) -> None:
    checkpoint.save_state(directory, pipe.mesh.rank, compression_state_dict(pipe), state_metadata(pipe),
                          max_shard_size=max_shard_size)


def load_compression_state(pipe: Pipeline, directory: str | os.PathLike) -> None:
    load_compression_state_dict(pipe, checkpoint.load_state(directory, pipe.mesh.rank, state_metadata(pipe)))


def register_for_checkpointing(pipe: Pipeline, accelerator) -> None:
    """`accelerator.save_state(dir)` / `load_state(dir)` also save / load every rank's
    compression state under `dir/actcomp_state` (Accelerate saves custom state on the main
    process only)."""

    def save_hook(models, weights, output_dir):
        save_compression_state(pipe, os.path.join(output_dir, COMPRESSION_STATE_DIR))

    def load_hook(models, input_dir):
        load_compression_state(pipe, os.path.join(input_dir, COMPRESSION_STATE_DIR))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def save_pretrained(pipe: Pipeline, save_directory: str | os.PathLike, model: nn.Module | None,
                    results: dict | None = None, **kwargs) -> None:
    """Write one Transformers checkpoint: each stage its own safetensors shard, from its own rank,
    and rank 0 the index, config, plan and card; for a `peft.PeftModel`, gather the (small)
    adapter on rank 0 and write it with PEFT."""
    model = model if model is not None else pipe.model
    base = unwrap_peft(model) if model is not None else None
    stats = pipe.stats(gather=True)  # collective: every rank, before rank 0 writes
    if base is not model:
        _save_adapter(pipe, save_directory, model, base, **kwargs)
    else:
        if kwargs:
            raise TypeError(f"Pipeline.save_pretrained writes one shard per stage and takes no {sorted(kwargs)}.")
        _save_shards(pipe, os.fspath(save_directory), base)
    if pipe.mesh.rank == 0:
        from .. import hub  # the card renderer, only when saving

        pipe.plan.save_pretrained(save_directory)
        run = {"base_model": getattr(base, "name_or_path", None), **(results or {})}
        hub.save_run(save_directory, stats=stats, blocks=[[r.start, r.stop] for r in pipe.ranges], **run)
    dist.barrier(group=pipe.group)


def _stage_state(pipe: Pipeline) -> dict[str, torch.Tensor]:
    """What this stage writes, under the checkpoint's names: its parameters and persistent
    buffers; a tied weight once, by its owner (the last stage), under the first name."""
    state = dict(pipe.stage.state_dict())
    for later, first in pipe.tied_pairs:
        if pipe.is_last and later in state:
            state[first] = state.pop(later)
        elif not pipe.is_last:
            state.pop(first, None)
    return state


def _save_shards(pipe: Pipeline, directory: str, base: nn.Module) -> None:
    """Each stage of replica 0 writes `model-0000{s+1}-of-0000S.safetensors`; rank 0 writes the
    index, built from every stage's names and sizes (no weights cross between ranks)."""
    state = _stage_state(pipe)
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    everyone: list = [None] * pipe.mesh.num_stages
    dist.all_gather_object(everyone, sizes, group=pipe.group)
    owner: dict[str, int] = {}
    for stage, names in enumerate(everyone):
        for name in names:
            owner.setdefault(name, stage)  # a buffer every stage holds (rotary tables) is written once
    stages = pipe.mesh.num_stages
    filename = f"model-{pipe.stage_index + 1:05d}-of-{stages:05d}.safetensors"
    if pipe.replica == 0:  # the replicas hold the same weights
        os.makedirs(directory, exist_ok=True)
        mine = {n: t.detach().contiguous().cpu() for n, t in state.items() if owner[n] == pipe.stage_index}
        save_file(mine, os.path.join(directory, filename), metadata={"format": "pt"})
    if pipe.mesh.rank == 0:
        weight_map = {name: f"model-{stage + 1:05d}-of-{stages:05d}.safetensors" for name, stage in owner.items()}
        total = sum(everyone[stage][name] for name, stage in owner.items())
        with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        base.config.save_pretrained(directory)
        if getattr(base, "generation_config", None) is not None and base.can_generate():
            base.generation_config.save_pretrained(directory)


def _save_adapter(pipe: Pipeline, save_directory, model: nn.Module, base: nn.Module, **kwargs) -> None:
    """Gather the trainable (adapter) tensors of every stage on rank 0 and save with PEFT."""
    own = {name: p.detach().cpu() for name, p in pipe.stage.named_parameters() if p.requires_grad}
    parts: list = [None] * pipe.mesh.num_stages
    dist.all_gather_object(parts, own, group=pipe.group)
    if pipe.mesh.rank == 0:
        full = {}
        for part in parts:
            full.update(part)
        restore_parameters(base, full, require_all=False)
        model.save_pretrained(save_directory, **kwargs)
        free_other_parameters(base, pipe.stage)


def free_other_parameters(model: nn.Module, stage: nn.Module) -> None:
    """Release the storage of every parameter this rank's stage does not use (the module tree
    stays intact so `save_pretrained` can fill it again)."""
    keep = {id(p) for p in stage.parameters()}
    for p in model.parameters():
        if id(p) not in keep:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def restore_parameters(model: nn.Module, tensors: dict[str, torch.Tensor], require_all: bool = True) -> None:
    """Refill freed parameters from `tensors` (by name); with `require_all`, none may stay empty."""
    freed = {name: tensors[name].to(p.dtype) for name, p in model.named_parameters(remove_duplicate=False)
             if p.numel() == 0 and name in tensors}  # freed here, held by another stage
    assign_parameters(model, freed)
    missing = [n for n, p in model.named_parameters() if p.numel() == 0]
    if missing and require_all:
        raise RuntimeError(f"Parameters missing from every stage: {missing[:5]}")


def load_stage_weights(pipe: Pipeline, directory: str | os.PathLike) -> None:
    """Read this stage's weights from a directory written by `save_pretrained` (or by
    `transformers` / `peft`), tensor by tensor: the full model's safetensors (single file or
    sharded with an index), or, for a PEFT pipeline, `adapter_model.safetensors` (adapter only)."""
    directory = os.fspath(directory)
    params = dict(pipe.stage.named_parameters())
    if pipe.peft_model is not None:
        wanted = {name: _peft_key(name, pipe.peft_model.active_adapter) for name, p in params.items() if p.requires_grad}
        files = dict.fromkeys(wanted.values(), os.path.join(directory, "adapter_model.safetensors"))
    else:
        aliases = dict(pipe.tied_pairs)  # a tied head is stored once, under the input embedding's name
        files = weight_files(directory)
        wanted = {name: name if name in files else aliases.get(name, name) for name in params}
    missing = sorted(key for key in wanted.values() if key not in files)
    if missing:
        raise ValueError(f"{directory} lacks weights of stage {pipe.stage_index}: {missing[:5]}")
    with torch.no_grad():
        for name, tensor in read_tensors(files, wanted).items():
            params[name].copy_(tensor)


def _peft_key(name: str, adapter_name: str) -> str:
    """Where PEFT's `save_pretrained` stores a stage parameter: `base_model.model.` in front and
    the adapter's name taken out (`...lora_A.default.weight` -> `...lora_A.weight`)."""
    return "base_model.model." + name.replace(f".{adapter_name}.", ".")
