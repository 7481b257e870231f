"""A pipeline stage's weights on disk: one Transformers checkpoint written by every stage at once
(each its own safetensors shard, or the gathered PEFT adapter), and each stage reading only its
own tensors back. The compression state is `checkpoint.CompressionState`'s."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from ..models import unwrap_peft
from ..pipeline.loading import assign_parameters, read_tensors, weight_files
from ..pipeline.mesh import PipelineMesh


@dataclass
class StageWeights:
    """What one rank's stage reads and writes: its module, where it sits in the pipeline, which of
    its weights are tied to another stage's, and the PEFT model around it (if any).

    Args:
        stage: this rank's stage module.
        mesh: the ranks of this pipeline (and of the stage's replicas).
        group: the pipeline's process group (the collectives of a save).
        tied_pairs: `(later, first)` names of weights tied across stages (`adapter.tied_weights()`).
        peft_model: the `peft.PeftModel` the stage was cut from, or None.
    """

    stage: nn.Module
    mesh: PipelineMesh
    group: dist.ProcessGroup
    tied_pairs: list[tuple[str, str]]
    peft_model: nn.Module | None = None

    def save(self, save_directory: str | os.PathLike, model: nn.Module, **kwargs) -> nn.Module:
        """Write this stage's part of one checkpoint of `model`: the stage's safetensors shard (rank 0
        also the index and config), or, for a `peft.PeftModel`, the adapter gathered and written by
        rank 0 with PEFT (`kwargs` go to its `save_pretrained`). Collective. Returns the
        transformers model inside `model`."""
        base = unwrap_peft(model)
        if base is not model:
            self._save_adapter(save_directory, model, base, **kwargs)
        else:
            if kwargs:
                raise TypeError(f"Pipeline.save_pretrained writes one shard per stage and takes no {sorted(kwargs)}.")
            self._save_shards(os.fspath(save_directory), base)
        return base

    def load(self, directory: str | os.PathLike) -> None:
        """Read this stage's weights from a directory written by `save` (or by `transformers` /
        `peft`), tensor by tensor: the full model's safetensors (single file or sharded with an
        index), or, for a PEFT pipeline, `adapter_model.safetensors` (adapter only)."""
        directory = os.fspath(directory)
        params = dict(self.stage.named_parameters())
        if self.peft_model is not None:
            adapter = self.peft_model.active_adapter
            wanted = {name: _peft_key(name, adapter) for name, p in params.items() if p.requires_grad}
            files = dict.fromkeys(wanted.values(), os.path.join(directory, "adapter_model.safetensors"))
        else:
            aliases = dict(self.tied_pairs)  # a tied head is stored once, under the input embedding's name
            files = weight_files(directory)
            wanted = {name: name if name in files else aliases.get(name, name) for name in params}
        missing = sorted(key for key in wanted.values() if key not in files)
        if missing:
            raise ValueError(f"{directory} lacks weights of stage {self.mesh.stage}: {missing[:5]}")
        with torch.no_grad():
            for name, tensor in read_tensors(files, wanted).items():
                params[name].copy_(tensor)

    def _state(self) -> dict[str, torch.Tensor]:
        """What this stage writes, under the checkpoint's names: its parameters and persistent
        buffers; a tied weight once, by its owner (the last stage), under the first name."""
        state = dict(self.stage.state_dict())
        for later, first in self.tied_pairs:
            if self.mesh.is_last and later in state:
                state[first] = state.pop(later)
            elif not self.mesh.is_last:
                state.pop(first, None)
        return state

    def _save_shards(self, directory: str, base: nn.Module) -> None:
        """Each stage of replica 0 writes `model-0000{s+1}-of-0000S.safetensors`; rank 0 writes the
        index, built from every stage's names and sizes (no weights cross between ranks)."""
        state = self._state()
        sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
        everyone: list = [None] * self.mesh.num_stages
        dist.all_gather_object(everyone, sizes, group=self.group)
        owner: dict[str, int] = {}
        for stage, names in enumerate(everyone):
            for name in names:
                owner.setdefault(name, stage)  # a buffer every stage holds (rotary tables) is written once
        stages = self.mesh.num_stages
        filename = f"model-{self.mesh.stage + 1:05d}-of-{stages:05d}.safetensors"
        if self.mesh.replica == 0:  # the replicas hold the same weights
            os.makedirs(directory, exist_ok=True)
            mine = {n: t.detach().contiguous().cpu() for n, t in state.items() if owner[n] == self.mesh.stage}
            save_file(mine, os.path.join(directory, filename), metadata={"format": "pt"})
        if self.mesh.rank == 0:
            weight_map = {name: f"model-{stage + 1:05d}-of-{stages:05d}.safetensors" for name, stage in owner.items()}
            total = sum(everyone[stage][name] for name, stage in owner.items())
            with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
            base.config.save_pretrained(directory)
            if getattr(base, "generation_config", None) is not None and base.can_generate():
                base.generation_config.save_pretrained(directory)

    def _save_adapter(self, save_directory, model: nn.Module, base: nn.Module, **kwargs) -> None:
        """Gather the trainable (adapter) tensors of every stage on rank 0 and save with PEFT."""
        own = {name: p.detach().cpu() for name, p in self.stage.named_parameters() if p.requires_grad}
        parts: list = [None] * self.mesh.num_stages
        dist.all_gather_object(parts, own, group=self.group)
        if self.mesh.rank == 0:
            full = {}
            for part in parts:
                full.update(part)
            restore_parameters(base, full, require_all=False)
            model.save_pretrained(save_directory, **kwargs)
            free_other_parameters(base, self.stage)


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


def _peft_key(name: str, adapter_name: str) -> str:
    """Where PEFT's `save_pretrained` stores a stage parameter: `base_model.model.` in front and
    the adapter's name taken out (`...lora_A.default.weight` -> `...lora_A.weight`)."""
    return "base_model.model." + name.replace(f".{adapter_name}.", ".")
