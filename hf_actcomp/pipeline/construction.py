"""What `Pipeline.__init__` and `prepare` check and wire, so that the constructor reads as a list.

The checks run identically on every rank and before the first collective (`build_mesh`): a
refusal on one rank then cannot leave the others waiting at a collective. The wiring builds the
parts the pipeline hands its state to (the stage module, the data-parallel hook, the router, the
traffic counters), each from the plan and the model.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ..aqsgd_memory import replica_sample_range
from ..dp import make_compressor
from ..models import ModelAdapter, get_adapter
from ..models.compile import compile_blocks, compile_options
from ..models.router import RouterLoss, router_spec
from ..models.split import stage_ranges
from ..plan import Plan
from ..state.weight_shards import free_other_parameters
from ..telemetry import TrafficCounter
from .mesh import PipelineMesh, check_world_size
from .tie import check_tied_embeddings


def resolve_plan(plan: Plan | str) -> Plan:
    """`prepare`'s plan: a `Plan`, or `"auto"` for `Plan.auto` with one stage per process."""
    if not isinstance(plan, str):
        return plan
    if plan != "auto":
        raise ValueError(f"plan={plan!r}: give a hf_actcomp.Plan, or 'auto' (Plan.auto with one stage per process).")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("prepare(model, 'auto') needs torch.distributed to be initialised first (one stage "
                           "per process).")
    return Plan.auto(num_stages=dist.get_world_size())


def check_loadable(plan: Plan) -> None:
    """Before `prepare` reads a checkpoint's weights: the plan, the process group and its size."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a hf_actcomp.Plan, got {type(plan).__name__}.")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("prepare(name_or_path, plan) needs torch.distributed to be initialised first: it "
                           "loads the stage of this rank.")
    check_world_size(plan)


def check_arguments(plan: Plan, *, timeout: float, autocast_dtype: torch.dtype | None, compile: bool,
                    compile_kwargs: dict | None) -> dict | None:
    """Refuse what cannot run, before the model is touched. Returns torch.compile's options for
    the stage's blocks (None: eager)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a hf_actcomp.Plan, got {type(plan).__name__}.")
    compiling = compile_options(compile, compile_kwargs)
    check_compiled_schedule(plan, compiling is not None)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "hf_actcomp.prepare() needs torch.distributed to be initialised: run under `accelerate launch` "
            "(create the Accelerator first) or `torchrun`, or call torch.distributed.init_process_group()."
        )
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
    plan.check_memory()
    if autocast_dtype == torch.float16:
        raise ValueError("autocast_dtype=torch.float16 needs loss scaling (a GradScaler), which the pipeline "
                         "does not do; use autocast_dtype=torch.bfloat16 (or None for full precision).")
    if autocast_dtype not in (None, torch.bfloat16):
        raise ValueError(f"autocast_dtype={autocast_dtype!r} is not supported; use torch.bfloat16 or None.")
    return compiling


def check_compiled_schedule(plan: Plan, compiled: bool) -> None:
    """zbh1 defers each linear layer's weight gradient to its `W` by routing the layer through a
    store, which a compiled block's graph bypasses: compiled, its `W` would have almost nothing to
    do and the schedule would silently run as 1F1B plus bookkeeping."""
    if compiled and plan.schedule == "zbh1":
        raise ValueError("compile=True (TrainingArguments(torch_compile=True)) with Plan(schedule='zbh1'): a compiled "
                         "block runs its linear layers inside its graph, so zbh1's weight-gradient pass has nothing "
                         "to defer. Use schedule='1f1b' with compile, or zbh1 without compile.")


def split_model(model: nn.Module, plan: Plan) -> tuple[ModelAdapter, list[range], list[tuple[str, str]]]:
    """The model's adapter, every stage's blocks and the tied pairs; an unsupported family, split
    or tie fails here, on every rank alike."""
    adapter = get_adapter(model)
    if plan.autotune is not None and not adapter.uniform_boundaries:
        raise ValueError(f"Plan.auto assumes every boundary carries the same shape; {type(model).__name__}'s "
                         "boundaries change with depth. Give a fixed Plan(...).")
    ranges = stage_ranges(adapter, plan)
    tied_pairs = adapter.tied_weights()
    check_tied_embeddings(model, tied_pairs)
    return adapter, ranges, tied_pairs


def stage_device(device: torch.device | str | None) -> torch.device:
    """Where this stage runs: `device`, else `cuda:LOCAL_RANK` under NCCL, else the CPU. A CUDA
    device is made current: NCCL collectives and the *_object calls use the current device. A
    bare "cuda" means the current one, as torch reads it."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif torch.cuda.is_available() and dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def build_stage(model: nn.Module, adapter: ModelAdapter, blocks: range, mesh: PipelineMesh, device: torch.device,
                compiling: dict | None) -> nn.Module:
    """This rank's stage module on `device`, the model's other parameters freed; with
    `compiling`, its blocks compiled in place (the links and glue stay eager; the
    runner fuses the boundary quantizers, hf_actcomp/codecs/fused.py)."""
    stage = adapter.build_stage(blocks.start, blocks.stop, first=mesh.is_first, last=mesh.is_last)
    free_other_parameters(model, stage)
    stage = stage.to(device)
    if compiling is not None:
        compile_blocks(stage, **compiling)
    return stage


def boundary_dtype(model: nn.Module, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """What crosses a boundary: the autocast dtype when set (the stages compute in it, so sending
    fp32 would double the bytes for nothing), else the parameters' dtype."""
    return autocast_dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())


def stage_router(model: nn.Module, stage: nn.Module) -> RouterLoss | None:
    """MoE with output_router_logits: the load-balancing loss's statistics ride along with the
    activations (forward) and its gradient with the activation gradients (backward)."""
    return RouterLoss(model, stage) if router_spec(model) is not None else None


def traffic_counters(plan: Plan, router: RouterLoss | None) -> dict[str, TrafficCounter]:
    """The bytes outside the boundary channels, by category: `evaluation` is everything
    `eval_step` sends, `inference` everything `generate` sends, `predictions` the last stage's
    predictions for Trainer's metrics, `probe` Plan.auto's measurements, `router` the MoE side
    channel."""
    names = ["tie", "collectives", "evaluation", "inference", "predictions"]
    names += ["probe"] if plan.autotune is not None else []
    names += ["router"] if router is not None else []
    return {name: TrafficCounter() for name in names}


def replica_samples(plan: Plan, mesh: PipelineMesh) -> range | None:
    """With data parallelism, AQ-SGD memory holds only this replica's shard of the samples."""
    if plan.uses_aqsgd and mesh.num_replicas > 1:
        return replica_sample_range(plan.memory.num_samples, mesh.num_replicas, mesh.replica)
    return None


def data_parallel_hook(plan: Plan, dp_group, stage: nn.Module):
    """The plan's data-parallel hook over this stage's replicas, or None without replicas."""
    if dp_group is None:
        return None
    hook, params = plan.dp_hook()
    compressor = make_compressor(hook, dp_group, **params)
    compressor.param_names = {id(p): n for n, p in stage.named_parameters()}
    return compressor

