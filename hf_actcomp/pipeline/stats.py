"""A pipeline stage's telemetry: what it sent and where its time went.

The step only adds to counters and clocks; reading, merging over the pipeline's ranks and
resetting them lives here, so that `stats()` can grow without touching the step.
`TelemetryMixin` gives `Pipeline` its telemetry methods.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from ..boundary import Boundary
from ..telemetry import ChannelStats, TrafficCounter, summarize
from .auto_tuner import AutoTuner
from .gradsync import GradientSync
from .mesh import PipelineMesh
from .runner import StageRunner
from .transport import Transport


class StageStats:
    """This stage's own timers, beside the counters it reads from the parts that keep theirs
    (the transport: waiting on point-to-point messages; the gradient sync: its collectives).

    Args:
        mesh: the ranks of this pipeline; `group`: its process group (for `gather`).
        traffic: the bytes outside the boundary channels, by category.
        transport, grads: the point-to-point transport and the gradient sync of this stage.
        data_parallel: what talks between replicas (a DP hook or DiLoCo), if anything.
        outer: DiLoCo's outer sync, if any (its syncs run inside `optimizer.step()`).
    """

    def __init__(self, mesh: PipelineMesh, group, traffic: dict[str, TrafficCounter], transport: Transport,
                 grads: GradientSync, data_parallel=None, outer=None) -> None:
        self.mesh = mesh
        self.group = group
        self.traffic = traffic
        self.transport = transport
        self.grads = grads
        self.data_parallel = data_parallel
        self.outer = outer
        self.steps = 0
        self.seconds_step = 0.0
        self.seconds_collectives = 0.0  # loss broadcast, token-count and loss all-reduces

    def local(self, channels: dict[str, ChannelStats], seconds_probing: float | None = None) -> dict:
        """This rank's counters: `channels` are its sending ends' (bytes are counted where sent);
        `seconds_probing`: Plan.auto's measurements (outside `seconds_step`), None without it."""
        traffic = {name: c.as_dict() for name, c in self.traffic.items()}
        if self.data_parallel is not None:
            traffic["data_parallel"] = self.data_parallel.stats()
        waiting = self.transport.seconds_waiting + self.grads.seconds + self.seconds_collectives
        timing = {
            "steps": self.steps,
            "seconds_step": self.seconds_step,
            "seconds_waiting": waiting,
            "seconds_computing": max(self.seconds_step - waiting, 0.0),
        }
        if self.outer is not None:  # DiLoCo's syncs run inside optimizer.step(), outside seconds_step
            timing["seconds_outer_sync"] = self.outer.seconds
        if seconds_probing is not None:
            timing["seconds_probing"] = seconds_probing
        return {"stage": self.mesh.stage, "channels": channels, "traffic": traffic, "timing": timing}

    def summary(self, local: dict, gather: bool = False, auto: dict | None = None) -> dict:
        """`local`'s totals (see `Pipeline.stats`); with `gather` (collective over the pipeline),
        merged with every other stage's. `auto`: Plan.auto's decision and switches, if any."""
        if gather and self.mesh.num_stages > 1:
            parts: list = [None] * self.mesh.num_stages
            dist.all_gather_object(parts, local, group=self.group)
        else:
            parts = [local]
        channels = {name: c for part in parts for name, c in part["channels"].items()}
        traffic = {}
        for part in parts:
            for name, counter in part["traffic"].items():
                entry = traffic.setdefault(name, {"bytes_sent": 0, "bytes_uncompressed": 0})
                entry["bytes_sent"] += counter["bytes_sent"]
                entry["bytes_uncompressed"] += counter["bytes_uncompressed"]
        summary = summarize(channels, traffic)
        summary["stages"] = {part["stage"]: part["timing"] for part in parts}
        if self.data_parallel is not None:
            summary["data_parallel"] = self.data_parallel.stats()
        if auto is not None:
            summary["auto"] = auto
        return summary

    def reset(self, boundaries: Iterable[Boundary]) -> None:
        """Every counter and timer back to zero, in place (whoever counts into one keeps it)."""
        for b in boundaries:
            b.stats.reset()
        for counter in self.traffic.values():
            counter.reset()
        self.grads.reset_stats()
        self.transport.reset_stats()
        if self.outer is not None:
            self.outer.reset_stats()
        self.seconds_step = self.seconds_collectives = 0.0
        self.steps = 0


class TelemetryMixin:
    """`Pipeline`'s telemetry methods (it sets these attributes)."""

    counters: StageStats
    runner: StageRunner
    autotuner: AutoTuner | None

    def stats(self, gather: bool = False) -> dict:
        """What THIS rank sent between ranks, by category (`categories`: activations, activation
        gradients, tied-embedding rows, loss/token-count collectives, data-parallel hook), per
        boundary direction (`channels`), the ratio over all of it, relative errors, and this
        stage's seconds computing vs waiting on communication.

        With `gather=True` (collective: call on every rank of the pipeline) the counters of all
        its ranks are merged.
        """
        auto = self.autotuner.summary() if self.autotuner is not None else None
        return self.counters.summary(self._local_counters(), gather, auto)

    def _local_counters(self) -> dict:
        probing = self.autotuner.seconds if self.autotuner is not None else None
        return self.counters.local(self.runner.sending_channels(), probing)

    def reset_stats(self) -> None:
        """Every counter and timer back to zero, in place (whoever counts into one keeps it)."""
        self.counters.reset(self.runner.boundaries.values())

    @property
    def auto_switches(self) -> list[dict]:
        """Plan.auto's codec switches so far (empty for any other plan)."""
        return self.autotuner.switches if self.autotuner is not None else []

    @property
    def seconds_probing(self) -> float:
        return self.autotuner.seconds if self.autotuner is not None else 0.0
