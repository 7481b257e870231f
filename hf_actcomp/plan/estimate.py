"""What a plan costs per optimizer step, worked out before training from the model's config: the
bytes each boundary direction sends, the AQ-SGD memory, the link time, DiLoCo's pseudo-gradient
traffic, and what `Plan.auto` would choose.

Apart from the `hf-actcomp estimate` command so the numbers are a plain function of a config and a
plan, with no argument parsing or printing in the way.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..aqsgd_memory import MemoryStore
from ..feedback import build_codec, build_first_visit_codec
from . import AutoConfig, Compression, MemoryConfig, Plan
from .codec_choice import Link, Measurements, choose

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def first_visit_label(compression: Compression) -> str:
    """How AQ-SGD sends a sample's first visit, for the estimate: uncompressed, with the inner
    codec (`direct`) or with the warm-up codec."""
    first_visit = compression.first_visit
    if isinstance(first_visit, Compression):
        return f"warm-up {first_visit.describe()}"
    if first_visit == "full":
        return "first visits uncompressed"
    return f"first visits {compression.describe().removeprefix('aqsgd-')} (direct)"


def hidden_size(config: PretrainedConfig) -> int:
    """The width of what crosses a boundary, which the estimate prices as (rows, tokens, hidden);
    a clear error for a model without one (ResNet: its feature maps change shape with depth)."""
    if getattr(config, "hidden_size", None) is None:
        raise ValueError(f"The estimate prices boundaries of (rows, tokens, config.hidden_size); model type "
                         f"{config.model_type!r} has no hidden_size (its boundaries change shape with depth). Count "
                         "its bytes with simulate(model, plan) on a batch and .stats() instead.")
    return int(config.hidden_size)


def estimate(config: PretrainedConfig, plan: Plan, batch_size: int, seq_len: int, link_bits_per_second: float,
             dtype: torch.dtype = torch.float32, num_samples: int | None = None,
             compute_seconds: float | None = None) -> dict:
    """Bytes per optimizer step of every boundary direction, the AQ-SGD memory, and link time."""
    hidden = hidden_size(config)
    micro = plan.micro_batches
    if batch_size < micro:
        raise ValueError(f"--batch-size {batch_size} is smaller than the plan's {micro} micro-batches.")
    rows = [len(part) for part in torch.arange(batch_size).tensor_split(micro)]
    raw = batch_size * seq_len * hidden * torch.finfo(dtype).bits // 8

    def step_bytes(codec) -> int:
        return sum(codec.payload_nbytes((r, seq_len, hidden), dtype) for r in rows)

    boundaries = []
    for b in range(plan.num_stages - 1):
        compression = plan.forward_at(b)
        forward = step_bytes(build_codec(compression))  # AQ-SGD: its inner codec on deltas (revisits)
        if compression.method == "aqsgd":  # deltas on one revisit in `refresh_every`: the revisits' mean
            forward = -(-forward // compression.refresh_every)
        backward = step_bytes(build_codec(plan.backward_at(b)))
        entry = {"boundary": b, "forward": compression.describe(), "backward": plan.backward_at(b).describe(),
                 "forward_bytes": forward, "backward_bytes": backward, "uncompressed_bytes": raw,
                 "forward_ratio": raw / forward, "backward_ratio": raw / backward,
                 "link_seconds": (forward + backward) * 8 / link_bits_per_second,
                 "link_seconds_uncompressed": 2 * raw * 8 / link_bits_per_second}
        if compression.method == "aqsgd":
            samples = num_samples or plan.memory.num_samples
            if samples is None:
                raise ValueError("AQ-SGD memory size needs the number of training rows: set memory.num_samples in "
                                 "the plan or pass --num-samples.")
            memory = MemoryConfig(store=plan.memory.store, dtype=plan.memory.dtype, num_samples=samples)
            # AQ-SGD's first epoch: every sample once, with the first-visit codec (none, inner or warm-up).
            entry["first_epoch_forward_bytes"] = step_bytes(build_first_visit_codec(compression))
            entry["first_visit"] = first_visit_label(compression)
            entry["aqsgd_memory_bytes"] = MemoryStore(samples, memory).nbytes_for((seq_len, hidden))
            entry["aqsgd_memory_store"] = f"{plan.memory.store} of stage {b + 1}"
            if compression.deltas == "drift":  # the sender's exact record beside its mirror
                entry["aqsgd_memory_store"] += f"; as much again on stage {b} for its drift record"
        boundaries.append(entry)
    total = sum(e["link_seconds"] for e in boundaries)
    total_raw = sum(e["link_seconds_uncompressed"] for e in boundaries)
    out = {"hidden_size": hidden, "batch_size": batch_size, "seq_len": seq_len, "micro_batches": micro,
           "link_bits_per_second": link_bits_per_second, "boundaries": boundaries,
           "link_seconds_per_step": total, "link_seconds_per_step_uncompressed": total_raw}
    if getattr(config, "tie_word_embeddings", False) and plan.num_stages > 1:
        # Rows of the batch's distinct tokens (at most every token, at most the vocabulary), values
        # one way and gradients back: fp32 weights, exact or through the plan's tie codec.
        count = min(batch_size * seq_len, getattr(config, "vocab_size", None) or batch_size * seq_len)
        exact = 2 * count * hidden * 4
        out["tied_embedding_bytes_at_most"] = exact
        if plan.tie_compression is not None:
            tie = build_codec(plan.tie_compression).payload_nbytes((count, hidden), torch.float32)
            out["tied_embedding_bytes_at_most"] = 2 * tie
            out["tied_embedding_bytes_at_most_uncompressed"] = exact
            out["tie_compression"] = plan.tie_compression.describe()
    if compute_seconds is not None:
        out["step_seconds"] = compute_seconds + total
        out["step_seconds_uncompressed"] = compute_seconds + total_raw
        out["expected_speedup"] = out["step_seconds_uncompressed"] / out["step_seconds"]
        # With overlap (the pipeline posts receives early), a step is at least the compute and at
        # least the busiest direction of the busiest boundary (each direction of a link runs in parallel).
        busiest = max(max(e["forward_bytes"], e["backward_bytes"]) for e in boundaries)
        out["step_seconds_overlapped"] = max(compute_seconds, busiest * 8 / link_bits_per_second)
        out["step_seconds_overlapped_uncompressed"] = max(compute_seconds, raw * 8 / link_bits_per_second)
        out["expected_speedup_overlapped"] = (out["step_seconds_overlapped_uncompressed"]
                                              / out["step_seconds_overlapped"])
    return out


def stage_trainable(config: PretrainedConfig, plan: Plan) -> list[list[tuple[str, torch.Tensor]]]:
    """Each stage's trainable parameters in name order, as the pipeline syncs them (a tied
    embedding on the last stage only), from the model built on the meta device: no weights are
    read or allocated."""
    from transformers import AutoModelForCausalLM

    from ..models import get_adapter
    from ..models.split import stage_ranges

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    adapter = get_adapter(model)
    ranges = stage_ranges(adapter, plan)
    tied = {name for pair in adapter.tied_weights() for name in pair}
    stages = []
    for s, r in enumerate(ranges):
        stage = adapter.build_stage(r.start, r.stop, first=s == 0, last=s == len(ranges) - 1)
        stages.append([(name, p) for name, p in sorted(stage.named_parameters())
                       if p.requires_grad and not (s == 0 and len(ranges) > 1 and name in tied)])
    return stages


def stage_parameter_counts(config: PretrainedConfig, plan: Plan) -> list[int]:
    """Trainable parameters each stage owns (a tied embedding counted on the last stage only)."""
    return [sum(p.numel() for _, p in named) for named in stage_trainable(config, plan)]


def diloco_estimate(config: PretrainedConfig, plan: Plan, link_bits_per_second: float) -> list[dict]:
    """Per stage: the pseudo-gradient bytes each replica sends per sync (with Streaming DiLoCo's
    fragments: the largest fragment's, the peak) and per optimizer step, the link time of a sync,
    and the bytes DDP's per-step all-reduce would send instead."""
    from ..dp.base import ring_allreduce_bytes
    from ..dp.diloco import payload_nbytes
    from ..dp.fragments import split_fragments

    diloco, replicas = plan.diloco, plan.data_parallel

    def sync_bytes(numel: int) -> int:
        if diloco.compression is None:
            return ring_allreduce_bytes(4 * numel, replicas)
        return payload_nbytes(diloco.compression, numel) * (replicas - 1)

    rows = []
    for stage, named in enumerate(stage_trainable(config, plan)):
        numel = sum(p.numel() for _, p in named)
        ddp = ring_allreduce_bytes(4 * numel, replicas)
        per_fragment = [sync_bytes(sum(p.numel() for _, p in fragment))
                        for fragment in split_fragments(named, diloco.fragments, stage)]
        per_sync, per_h = max(per_fragment), sum(per_fragment)  # every fragment syncs once per H steps
        rows.append({"stage": stage, "parameters": numel, "bytes_per_sync": per_sync,
                     "bytes_per_step": per_h / diloco.sync_every, "ddp_bytes_per_step": ddp,
                     "ratio_vs_ddp": ddp * diloco.sync_every / per_h,
                     "link_seconds_per_sync": per_sync * 8 / link_bits_per_second})
    return rows


def auto_estimate(config: PretrainedConfig, plan: Plan, batch_size: int, seq_len: int, links_bits: list[float],
                  rtts: list[float], compute_seconds: float, dtype: torch.dtype, auto: AutoConfig) -> dict:
    """What `Plan.auto` would choose: every stage computing `compute_seconds` per step (the
    busiest stage's), each boundary's link as given in both directions (`rtts` in seconds)."""
    micro = plan.micro_batches
    shape = (math.ceil(batch_size / micro), seq_len, hidden_size(config))
    links = [{d: Link(bandwidth=bits / 8, rtt=rtt) for d in ("forward", "backward")}
             for bits, rtt in zip(links_bits, rtts, strict=True)]
    measured = Measurements(compute=[compute_seconds / micro] * plan.num_stages, links=links, payload_shape=shape,
                            micro_batches=micro, dtype=dtype)
    return choose(measured, auto)

