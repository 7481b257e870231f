"""Data-parallel gradient compression: DDP communication hooks by name.

    state = hf_actcomp.dp.register(ddp_model, "dgc", ratio=0.001)

works on any `DistributedDataParallel` model, including the one `accelerator.prepare` returns.
Hooks: `allreduce` (no compression, the exact average), `topk`, `randk`, `dgc`, `qsgd`,
`ef_sign`, `marsit`, and torch's `powersgd`. `cast="fp16"` / `"bf16"` composes torch's
half-precision wrapper with any of them. `HOOKS` is the one registry of hook names: `register_hook`
adds a `GradientCompressor` of your own, which `Plan(dp_compression=...)` then accepts.
"""

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ..state import compression as compression_files
from .base import HOOKS, GradientCompressor, available_hooks, register_hook, ring_allreduce_bytes
from .marsit import MarsitCompressor, merge_signs
from .powersgd import PowerSGDCompressor
from .quantized import EFSignCompressor, QSGDCompressor, qsgd_decode, qsgd_encode
from .sparse import DGCCompressor, RandKCompressor, TopKCompressor


class AllReduceCompressor(GradientCompressor):
    """No compression: the exact average by all-reduce (the reference the others are measured by)."""

    name = "allreduce"
    canonical_order = False  # element-wise: the layout does not matter

    def _reduce(self, flat, names, sizes):
        return self.all_reduce_sum(flat.div_(self.world_size))


for _cls in (AllReduceCompressor, TopKCompressor, RandKCompressor, DGCCompressor, QSGDCompressor, EFSignCompressor,
             MarsitCompressor):
    register_hook(_cls)
HOOKS[PowerSGDCompressor.name] = PowerSGDCompressor  # torch's own hook state, not a GradientCompressor
CASTS = ("fp16", "bf16")


def make_compressor(name: str, process_group: dist.ProcessGroup | None = None, **params: Any):
    """The hook state `name` over `process_group`, with the hook's own parameters."""
    if name not in HOOKS:
        raise ValueError(f"Unknown data-parallel hook {name!r}. Available hooks: {', '.join(available_hooks())}.")
    try:
        return HOOKS[name](process_group, **params)
    except TypeError as err:
        raise TypeError(f"Bad parameters for the '{name}' hook: {err}") from err


# No `from __future__ import annotations` here: DDP checks these annotations at registration.
def _ddp_hook(state: GradientCompressor, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if state.cast_dtype is not None:  # compress (and send) a half-precision copy
        out = state.reduce(buffer.to(state.cast_dtype), bucket.parameters()).to(buffer.dtype)
    else:
        out = state.reduce(buffer, bucket.parameters())
    if bucket.is_last():
        state.end_step()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(out)
    return future


def _powersgd_hook(state: PowerSGDCompressor, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.hook(bucket)


def register(ddp_model: DistributedDataParallel, name: str, *, process_group: dist.ProcessGroup | None = None,
             cast: str | None = None, **params: Any):
    """Attach hook `name` to `ddp_model` (before its first backward) and return its state.

    `process_group` defaults to the DDP model's own group. `cast` ("fp16"/"bf16") sends the
    bucket in half precision before the hook compresses it.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"hf_actcomp.dp.register needs a torch DistributedDataParallel model (e.g. from accelerator.prepare "
            f"in a multi-process run), got {type(ddp_model).__name__}."
        )
    # our own marker on the user's DDP object: DDP exposes no getter for a registered comm hook
    if getattr(ddp_model, "_actcomp_hook", None) is not None:
        raise RuntimeError(
            f"This DDP model already has the hf-actcomp hook '{ddp_model._actcomp_hook.name}'; a DDP model takes "
            "one communication hook. Build a new DDP model to change it."
        )
    if cast is not None and cast not in CASTS:
        raise ValueError(f"cast={cast!r} is not valid. Allowed values: {', '.join(CASTS)} (or None).")
    group = process_group if process_group is not None else ddp_model.process_group
    state = make_compressor(name, group, **params)
    state.param_names = {id(p): n for n, p in ddp_model.module.named_parameters()}
    if name == "powersgd":  # torch's own wrappers (bf16 needs CUDA + NCCL there)
        hook = _powersgd_hook
        if cast == "fp16":
            hook = default_hooks.fp16_compress_wrapper(hook)
        elif cast == "bf16":
            hook = default_hooks.bf16_compress_wrapper(hook)
    else:
        hook = _ddp_hook
        state.cast_dtype = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}[cast]
    try:
        ddp_model.register_comm_hook(state, hook)
    except RuntimeError as err:
        raise RuntimeError(
            f"Could not register the '{name}' hook: {err}. A DDP model takes one communication hook, registered "
            "before the first backward; do not also pass comm_hook to Accelerate's DistributedDataParallelKwargs."
        ) from err
    ddp_model._actcomp_hook = state
    return state


def save_state(state, directory: str | os.PathLike) -> None:
    """Write this rank's hook state (safetensors + JSON), e.g. next to `accelerator.save_state`."""
    meta = {"plan": {"dp_hook": state.name}, "world_size": dist.get_world_size(), "stage": None, "blocks": None}
    compression_files.save_state(directory, dist.get_rank(), state.state_dict(), meta)


def load_state(state, directory: str | os.PathLike) -> None:
    """Read this rank's hook state written by `save_state` for the same hook and world size."""
    meta = {"plan": {"dp_hook": state.name}, "world_size": dist.get_world_size(), "stage": None, "blocks": None}
    state.load_state_dict(compression_files.load_state(directory, dist.get_rank(), meta))


__all__ = [
    "CASTS", "HOOKS", "AllReduceCompressor", "DGCCompressor", "EFSignCompressor", "GradientCompressor",
    "MarsitCompressor", "PowerSGDCompressor", "QSGDCompressor", "RandKCompressor", "TopKCompressor",
    "available_hooks", "load_state", "make_compressor", "merge_signs", "qsgd_decode", "qsgd_encode", "register",
    "register_hook", "ring_allreduce_bytes", "save_state",
]
