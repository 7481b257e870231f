"""Which rank runs which pipeline stage of which replica, and the process groups they talk over.

Layout: rank = replica * num_stages + stage. A replica's stages form its pipeline group; the
copies of one stage across replicas form that stage's data-parallel group.

With DiLoCo (`dp_compression="diloco"`) replicas talk only through torchft, never through a group
of this job: either one launch holds every replica (rank = replica * num_stages + stage, as
above), or each replica is its own launch of num_stages processes, named by `REPLICA_GROUP_ID`.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from ..plan import REPLICA_ENV, Plan


@dataclass(frozen=True)
class PipelineMesh:
    """Ranks of this rank's pipeline (`ranks[s]` runs stage s) and of its stage's DP group."""

    ranks: tuple[int, ...]
    rank: int
    dp_ranks: tuple[int, ...] = ()
    # (replica, replicas) when replicas are joined by outer steps (DiLoCo), not by a group of this job
    outer_replica: tuple[int, int] | None = None

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    @property
    def stage(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def replica(self) -> int:
        if self.outer_replica is not None:
            return self.outer_replica[0]
        return self.dp_ranks.index(self.rank) if self.dp_ranks else 0

    @property
    def num_replicas(self) -> int:
        if self.outer_replica is not None:
            return self.outer_replica[1]
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


def launched_replica(plan: Plan) -> int | None:
    """With DiLoCo launched one replica at a time (world size = num_stages), that launch's replica
    (`REPLICA_GROUP_ID`); None when one launch holds every replica."""
    if plan.diloco is None or dist.get_world_size() != plan.num_stages:
        return None
    value = os.environ.get(REPLICA_ENV)
    if value is None or not value.isdigit() or int(value) >= plan.data_parallel:
        raise ValueError(
            f"This job has {plan.num_stages} processes for a DiLoCo plan of {plan.data_parallel} replicas: one launch "
            f"per replica needs REPLICA_GROUP_ID set to this replica's index, 0..{plan.data_parallel - 1} (got "
            f"{value!r}). Or launch all {plan.world_size} processes at once."
        )
    return int(value)


def check_world_size(plan: Plan) -> None:
    """The job must have one process per stage and replica (per stage, with DiLoCo launched one
    replica at a time)."""
    world = dist.get_world_size()
    if world != plan.world_size and launched_replica(plan) is None:
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
    own = launched_replica(plan)  # DiLoCo launched one replica at a time: this launch's replica
    groups = Groups(pipeline=None, data_parallel=None)
    mine = rank // stages
    for replica in range(1 if own is not None else replicas):
        ranks = list(range(replica * stages, (replica + 1) * stages))
        group = dist.new_group(ranks, timeout=delta)
        if replica == mine:
            groups.pipeline = group
    pipeline_ranks = tuple(range(mine * stages, (mine + 1) * stages))
    if plan.diloco is not None:  # replicas talk through torchft only, never through a group of this job
        outer = (own if own is not None else mine, replicas)
        return PipelineMesh(pipeline_ranks, rank, outer_replica=outer), groups
    dp_ranks: tuple[int, ...] = ()
    if replicas > 1:
        for stage in range(stages):
            ranks = [replica * stages + stage for replica in range(replicas)]
            group = dist.new_group(ranks, timeout=delta)
            if rank in ranks:
                groups.data_parallel, dp_ranks = group, tuple(ranks)
    return PipelineMesh(pipeline_ranks, rank, dp_ranks), groups
