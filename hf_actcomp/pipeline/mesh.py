"""Which rank runs which pipeline stage, and the process groups the stages talk over."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from ..plan import Plan


@dataclass(frozen=True)
class PipelineMesh:
    """Ranks of one pipeline: stage `s` runs on global rank `ranks[s]`."""

    ranks: tuple[int, ...]
    rank: int

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    @property
    def stage(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first else self.ranks[self.stage - 1]

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last else self.ranks[self.stage + 1]


def build_mesh(plan: Plan, timeout: float) -> tuple[PipelineMesh, dist.ProcessGroup, dist.ProcessGroup | None]:
    """Check the world size against the plan; create the pipeline group and the group that
    joins the first and last stage (tied embeddings). Collective: every rank must call it."""
    world = dist.get_world_size()
    if world != plan.num_stages:
        raise ValueError(
            f"Plan.num_stages={plan.num_stages} needs exactly {plan.num_stages} processes (one per stage), "
            f"but the world size is {world}. Launch with --num_processes {plan.num_stages} or change the plan."
        )
    ranks = tuple(range(world))
    delta = datetime.timedelta(seconds=timeout)
    group = dist.new_group(list(ranks), timeout=delta)
    ends = sorted({ranks[0], ranks[-1]})
    tie_group = dist.new_group(ends, timeout=delta) if len(ends) > 1 else None
    return PipelineMesh(ranks, dist.get_rank()), group, tie_group
