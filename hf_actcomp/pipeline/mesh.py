"""Which rank runs which pipeline stage of which replica, and the process groups they talk over.

Layout: rank = replica * num_stages + stage. A replica's stages form its pipeline group; the
copies of one stage across replicas form that stage's data-parallel group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from ..plan import Plan


@dataclass(frozen=True)
class PipelineMesh:
    """Ranks of this rank's pipeline (`ranks[s]` runs stage s) and of its stage's DP group."""

    ranks: tuple[int, ...]
    rank: int
    dp_ranks: tuple[int, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    @property
    def stage(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def replica(self) -> int:
        return self.dp_ranks.index(self.rank) if self.dp_ranks else 0

    @property
    def num_replicas(self) -> int:
        return max(len(self.dp_ranks), 1)

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


@dataclass
class Groups:
    pipeline: dist.ProcessGroup
    data_parallel: dist.ProcessGroup | None


def check_world_size(plan: Plan) -> None:
    """The job must have one process per stage and replica."""
    world = dist.get_world_size()
    if world != plan.world_size:
        raise ValueError(
            f"Plan.num_stages={plan.num_stages} x data_parallel={plan.data_parallel} needs exactly "
            f"{plan.world_size} processes (one per stage and replica), but the world size is {world}. "
            f"Launch with --num_processes {plan.world_size} or change the plan."
        )


def build_mesh(plan: Plan, timeout: float) -> tuple[PipelineMesh, Groups]:
    """Check the world size against the plan and create every group. Collective: every rank
    must call it (torch requires all ranks to create every group, in the same order)."""
    check_world_size(plan)
    rank, stages, replicas = dist.get_rank(), plan.num_stages, plan.data_parallel
    delta = datetime.timedelta(seconds=timeout)
    groups = Groups(pipeline=None, data_parallel=None)
    mine = rank // stages
    for replica in range(replicas):
        ranks = list(range(replica * stages, (replica + 1) * stages))
        group = dist.new_group(ranks, timeout=delta)
        if replica == mine:
            groups.pipeline = group
    dp_ranks: tuple[int, ...] = ()
    if replicas > 1:
        for stage in range(stages):
            ranks = [replica * stages + stage for replica in range(replicas)]
            group = dist.new_group(ranks, timeout=delta)
            if rank in ranks:
                groups.data_parallel, dp_ranks = group, tuple(ranks)
    pipeline_ranks = tuple(range(mine * stages, (mine + 1) * stages))
    return PipelineMesh(pipeline_ranks, rank, dp_ranks), groups
