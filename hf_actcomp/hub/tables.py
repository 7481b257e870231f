"""The tables in the body of a model card: the plan, the measured traffic, the time per stage and
the evaluation losses.

Each renders one part of a saved run as Markdown, from the plan or `actcomp_results.json`, so the
card template only places them.
"""

from __future__ import annotations

from ..plan import Plan
from ..plan.codec_choice import bandwidth_text
from ..plan.diloco import DiLoCoConfig


def plan_table(plan: Plan, blocks: list | None) -> str:
    """What the run was trained with: stages (and their blocks), schedule, codecs per direction,
    AQ-SGD memory, data parallelism and the tie."""
    rows = [("pipeline stages", str(plan.num_stages) + (
        f" (blocks {', '.join(f'[{a}, {b})' for a, b in blocks)})" if blocks else "")),
        ("micro-batches, schedule", f"{plan.micro_batches}, {plan.schedule}"),
        ("forward (activations)", f"`{plan.forward.describe()}`"),
        ("backward (activation gradients)", f"`{plan.backward.describe()}`")]
    if plan.per_boundary:
        rows[2:] = [row for b in range(plan.num_stages - 1) for row in (
            (f"boundary {b} forward", f"`{plan.forward_at(b).describe()}`"),
            (f"boundary {b} backward", f"`{plan.backward_at(b).describe()}`"))]
    if plan.autotune is not None:
        rows.append(("codecs chosen by", _describe_auto(plan)))
    if plan.uses_aqsgd:
        m = plan.memory
        rows.append(("AQ-SGD memory", f"{m.num_samples} samples, {m.dtype}, on {m.store}"))
    if plan.diloco is not None:
        rows.append(("data parallel", f"{plan.data_parallel} replicas, {_describe_diloco(plan.diloco)}"))
    elif plan.data_parallel > 1:
        hook, params = plan.dp_hook()
        rows.append(("data parallel", f"{plan.data_parallel} replicas, gradients by `{hook}` {params or ''}".strip()))
    if plan.tie_compression is not None:
        rows.append(("tied embedding rows", f"`{plan.tie_compression.describe()}` (rows as deltas, gradient rows "
                                            "with error feedback)"))
    return _table(("setting", "value"), rows)


def _describe_auto(plan: Plan) -> str:
    """`Plan.auto`'s row of the card: the quality level and what it measured per boundary."""
    auto = plan.autotune
    text = f"`Plan.auto` (quality {auto.quality}" + (f", re-measured every {auto.adapt_every} steps" if auto.adapt_every
                                                    else "") + ")"
    decision = auto.decision
    if decision is None:
        return text + ", not measured yet"
    links = decision["measurements"]["links"]
    measured = "; ".join(f"boundary {b}: {bandwidth_text(link['forward'])} forward, {bandwidth_text(link['backward'])} "
                         f"backward, {link['forward']['rtt_ms']:.3g} ms RTT" for b, link in enumerate(links))
    return (f"{text} from measured links ({measured}) and {decision['compute_seconds'] * 1e3:.1f} ms of compute per "
            "micro-batch")


def _describe_diloco(config: DiLoCoConfig) -> str:
    """DiLoCo's settings in words, for the card's plan table."""
    momentum = (f", {'Nesterov ' if config.nesterov else ''}momentum {config.outer_momentum:g}"
                if config.outer_momentum else "")
    codec = (f"`{config.compression.describe()}` with error feedback" if config.compression is not None
             else "fp32 (exact)")
    streaming = (f"Streaming DiLoCo: {config.fragments} fragments in turn, one every {config.fragment_every} steps"
                 if config.fragments > 1 else "")
    delay = f"each sync overlapped with {config.fragment_sync_delay} inner step(s)" if config.fragment_sync_delay else ""
    alpha = (f"local weights mixed in at {config.fragment_update_alpha:g}" if config.fragment_update_alpha else "")
    extras = [streaming, delay, alpha, f"at least {config.min_replicas} per sync" if config.min_replicas else "",
              "stages staggered" if config.stagger else ""]
    return (f"DiLoCo: an outer step every {config.sync_every} optimizer steps (outer SGD lr {config.outer_lr:g}"
            f"{momentum}), pseudo-gradients as {codec}" + "".join(f"; {e}" for e in extras if e))


def communication_table(stats: dict) -> str | None:
    """Bytes sent per boundary direction and per other traffic category against uncompressed, or
    None when the run measured no traffic."""
    channels = stats.get("channels") or {}
    if not channels:
        return None
    rows = [(name, f"{c['bytes_sent']:,}", f"{c['bytes_uncompressed']:,}", f"{c['compression_ratio']:.2f}x",
             f"{c['relative_error']:.4f}") for name, c in sorted(channels.items())]
    for name, c in sorted((stats.get("categories") or {}).items()):
        if name not in ("activations", "activation_gradients") and c["bytes_sent"]:
            rows.append((name, f"{c['bytes_sent']:,}", f"{c['bytes_uncompressed']:,}",
                         f"{c['compression_ratio']:.2f}x", "lossless" if c["compression_ratio"] == 1 else ""))
    rows.append(("**all traffic**", f"{stats['bytes_sent']:,}", f"{stats['bytes_uncompressed']:,}",
                 f"{stats['compression_ratio']:.2f}x", ""))
    return _table(("boundary / traffic", "bytes sent", "uncompressed", "ratio", "relative error"), rows)


def timing_table(stats: dict) -> str | None:
    """Seconds each stage computed and waited, or None when the run kept no stage times."""
    stages = stats.get("stages") or {}
    if not stages:
        return None
    rows = [(str(s), str(t.get("steps", "")), f"{t['seconds_computing']:.1f}", f"{t['seconds_waiting']:.1f}")
            for s, t in sorted(stages.items(), key=lambda kv: int(kv[0]))]
    return _table(("stage", "steps", "seconds computing", "seconds waiting"), rows)


def evaluation_table(metrics: dict) -> str | None:
    """The eval loss and perplexity with the codec and without it, or None before any evaluation."""
    loss = metrics.get("eval_loss")
    if loss is None:
        return None
    rows = [("with the codec at inference", f"{loss:.4f}", f"{metrics.get('eval_perplexity', float('nan')):.2f}")]
    if metrics.get("eval_plain_loss") is not None:
        rows.append(("without compression", f"{metrics['eval_plain_loss']:.4f}",
                     f"{metrics.get('eval_plain_perplexity', float('nan')):.2f}"))
    return _table(("evaluation", "loss", "perplexity"), rows)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)

