"""Load only this rank's stage of a checkpoint: the skeleton on the meta device, then this stage's
tensors read one by one from the safetensors shards.

A rank never holds the other stages' weights, so a model that does not fit in one process's
memory still trains when its stages do. Tied weights (GPT-2's head and input embedding) keep
their identity, so the pipeline still sees the tie; non-persistent buffers (rotary `inv_freq`)
are computed on the CPU as usual (`init_empty_weights` leaves buffers alone).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from ..models import get_adapter
from ..models.split import stage_ranges
from ..plan import Plan


def resolve_checkpoint(name_or_path: str | os.PathLike, **hub_kwargs) -> str:
    """A local directory with the checkpoint: `name_or_path` itself, or the Hub snapshot in the
    local cache (downloaded if allowed; `HF_HUB_OFFLINE=1` uses the cache only)."""
    if os.path.isdir(name_or_path):
        return os.fspath(name_or_path)
    from huggingface_hub import snapshot_download

    return snapshot_download(os.fspath(name_or_path), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"],
                             **hub_kwargs)


def weight_files(directory: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a transformers checkpoint (one file or sharded)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}
    single = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(
            f"No model.safetensors (or model.safetensors.index.json) in {directory}: per-stage loading reads "
            "safetensors checkpoints only (save with save_pretrained(..., safe_serialization=True))."
        )
    with safe_open(single, framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), single)


def load_stage_model(name_or_path: str | os.PathLike, plan: Plan, *, stage: int | None = None,
                     torch_dtype: torch.dtype | None = None, **hub_kwargs) -> nn.Module:
    """The causal LM of `name_or_path` with only `stage`'s parameters materialised (default: this
    rank's stage, `rank % plan.num_stages`); every other parameter stays on the meta device."""
    directory = resolve_checkpoint(name_or_path, **hub_kwargs)
    config = AutoConfig.from_pretrained(directory)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, **({"dtype": torch_dtype} if torch_dtype else {}))
    model.tie_weights()  # from_config skips it on the meta device; the pipeline finds ties by identity
    model.name_or_path = os.fspath(name_or_path)
    model.eval()  # as from_pretrained returns it
    if stage is None:
        stage = dist.get_rank() % plan.num_stages if dist.is_initialized() else 0
    adapter = get_adapter(model)
    ranges = stage_ranges(adapter, plan)
    last = len(ranges) - 1
    if not 0 <= stage <= last:
        raise ValueError(f"stage={stage} is not a stage of a {plan.num_stages}-stage plan.")
    module = adapter.build_stage(ranges[stage].start, ranges[stage].stop, first=stage == 0, last=stage == last)
    materialise(model, [name for name, _ in module.named_parameters()], directory, torch_dtype)
    return model


def materialise(model: nn.Module, names: list[str], directory: str, dtype: torch.dtype | None) -> None:
    """Replace the meta parameters `names` by the checkpoint's tensors. A tied name missing from
    the file is read under the name it is tied to (checkpoints store a tie once)."""
    files = weight_files(directory)
    aliases = _aliases(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    keys = {}
    for name in names:
        key = next((a for a in [name, *aliases[id(params[name])]] if a in files), None)
        if key is None:
            raise ValueError(f"{directory} has no tensor for {name!r} (nor for what it is tied to)."
                             + _conversion_hint(model))
        keys[name] = key
    tensors = read_tensors(files, keys)
    assign_parameters(model, {n: t.to(dtype) if dtype is not None and t.is_floating_point() else t
                              for n, t in tensors.items()})


def read_tensors(files: dict[str, str], keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """`{name: tensor}` for `keys` (name -> key in the checkpoint), opening each shard once."""
    by_file: dict[str, list[str]] = {}
    for name, key in keys.items():
        by_file.setdefault(files[key], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                out[name] = f.get_tensor(keys[name])
    return out


def assign_parameters(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make each named parameter a new `nn.Parameter` holding the given tensor, in every module
    that holds it, so that a tied parameter stays one object (assigning `.data` cannot move a
    meta parameter to a real device)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, attr))
    params = dict(model.named_parameters(remove_duplicate=False))
    done: set[int] = set()
    for name, tensor in tensors.items():
        param = params[name]
        if id(param) in done:
            continue
        done.add(id(param))
        new = nn.Parameter(tensor.to(param.dtype) if tensor.is_floating_point() and param.dtype.is_floating_point
                           and param.device.type != "meta" else tensor, requires_grad=param.requires_grad)
        for module, attr in holders[id(param)]:  # every module sharing the tensor (tied weights)
            module.register_parameter(attr, new)


def _conversion_hint(model: nn.Module) -> str:
    """Why a name can be missing: transformers renames or merges some families' checkpoint tensors
    on load (Mixtral's per-expert `w1/w2/w3` become one `gate_up_proj`), which this reader does not do."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    model_type = model.config.model_type
    if get_checkpoint_conversion_mapping(type(model).__name__) is None and \
            get_checkpoint_conversion_mapping(model_type) is None:
        return ""
    return (f" {model_type} checkpoints store some weights under names that from_pretrained converts while "
            "loading (e.g. per-expert tensors merged into one); per-stage loading reads tensors by the model's "
            "own names and does not convert them. Load the model with from_pretrained and pass it to "
            "prepare(model, plan) instead.")


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name under which each parameter object appears (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names
