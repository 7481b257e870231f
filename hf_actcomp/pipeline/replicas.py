"""The small collectives of a step beside the gradients: label-token counts and the loss, over a
stage's replicas and from the last stage to the whole pipeline; and each replica's data shard.

Kept together because they decide what one replica's loss means in the global batch: each
replica divides its token sum by the global count over D, so that averaging the replicas'
gradients gives the global batch's. `ReplicasMixin` gives `Pipeline` its methods about replicas.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from ..dp.base import ring_allreduce_bytes
from ..dp.outer import OuterSync, bind_host, lighthouses
from ..plan import Plan
from ..telemetry import TrafficCounter
from .mesh import PipelineMesh
from .stats import StageStats

logger = logging.getLogger(__name__)


class StepCollectives:
    """The loss and token-count collectives of one stage, timed (`clock.seconds_collectives`)
    and counted (`counter`: the `collectives` traffic).

    Args:
        mesh: this stage's place; `group`: its pipeline group; `dp_group`: its replicas' group
            (None without data parallelism).
        device: where the small tensors live.
    """

    def __init__(self, mesh: PipelineMesh, group, dp_group, device: torch.device, counter: TrafficCounter,
                 clock: StageStats) -> None:
        self.mesh = mesh
        self.group = group
        self.dp_group = dp_group
        self.device = device
        self.counter = counter
        self.clock = clock

    def loss_normaliser(self, num_tokens: int, num_items_in_batch, micro_batches: int) -> torch.Tensor | None:
        """What this replica divides its token-loss sum by (on the last stage; None = the mean)."""
        mesh = self.mesh
        if not mesh.is_last:
            return None
        if num_items_in_batch is not None:
            return torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=self.device) / mesh.num_replicas
        if self.dp_group is not None:
            total = torch.tensor(float(num_tokens), device=self.device)
            self._all_reduce(total)
            return total / mesh.num_replicas
        if micro_batches > 1:
            return torch.tensor(num_tokens, device=self.device)
        return None

    def eval_normaliser(self, num_tokens: int, num_items_in_batch, micro_batches: int) -> torch.Tensor | None:
        """Evaluation's divisor (on the last stage; None = the mean): every replica evaluates the
        whole batch, so a given `num_items_in_batch` is not shared out over the replicas."""
        if not self.mesh.is_last:
            return None
        if num_items_in_batch is None:
            return self.loss_normaliser(num_tokens, None, micro_batches)
        return torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=self.device)

    def count_over_replicas(self, count: int) -> int:
        """The sum of `count` over this stage's replicas. Collective over the data-parallel group."""
        if self.dp_group is None:
            return int(count)
        total = torch.tensor(int(count), dtype=torch.int64, device=self.device)
        self._all_reduce(total)
        return int(total.item())

    def gather_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        """Every replica's `t` (the same shape on each), concatenated in replica order along dim 0.
        Collective over the data-parallel group; a ring all-gather sends D - 1 times its bytes."""
        if self.dp_group is None:
            return t
        start = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.mesh.num_replicas)]
        dist.all_gather(parts, t.contiguous(), group=self.dp_group)
        self.counter.add((self.mesh.num_replicas - 1) * t.numel() * t.element_size())
        self.clock.seconds_collectives += time.perf_counter() - start
        return torch.cat(parts)

    def _all_reduce(self, t: torch.Tensor) -> None:
        """A small collective over the replicas (token counts, losses), timed and counted."""
        start = time.perf_counter()
        dist.all_reduce(t, group=self.dp_group)
        self.counter.add(ring_allreduce_bytes(t.numel() * t.element_size(), self.mesh.num_replicas))
        self.clock.seconds_collectives += time.perf_counter() - start

    def broadcast_loss(self, total: torch.Tensor) -> torch.Tensor:
        """The last stage's loss on every rank of the pipeline (in place)."""
        mesh = self.mesh
        if mesh.num_stages > 1:
            start = time.perf_counter()
            dist.broadcast(total, src=mesh.ranks[-1], group=self.group)
            if mesh.is_last:
                self.counter.add(total.numel() * total.element_size() * (mesh.num_stages - 1))
            self.clock.seconds_collectives += time.perf_counter() - start
        return total

    def mean_over_replicas(self, total: torch.Tensor) -> torch.Tensor:
        """The global batch's loss from each replica's share (last stages only)."""
        if self.dp_group is not None and self.mesh.is_last:
            self._all_reduce(total)
            total /= self.mesh.num_replicas
        return total


def shard_dataset(dataset, replicas: int, replica: int):
    """`replica`'s contiguous shard of `dataset`, of the same length on every replica (see
    `Pipeline.shard_dataset`)."""
    if replicas == 1:
        return dataset
    usable = len(dataset) - len(dataset) % replicas
    if usable == 0:
        raise ValueError(f"A dataset of {len(dataset)} rows cannot give {replicas} replicas a row each.")
    if usable < len(dataset):
        logger.warning("Dropping the last %d of %d rows so that %d replicas get equal shards.",
                       len(dataset) - usable, len(dataset), replicas)
    return dataset.select(range(usable)).shard(replicas, replica, contiguous=True)


def outer_sync(plan: Plan, trainable, mesh: PipelineMesh, timeout: float) -> tuple[OuterSync, list]:
    """DiLoCo's replica group of this stage (torchft), and the servers this rank started for it
    (the caller keeps them alive)."""
    host = bind_host()
    servers, addresses = lighthouses(plan, host)
    sync = OuterSync(plan.diloco, trainable, stage=mesh.stage, num_stages=mesh.num_stages, replica=mesh.replica,
                     num_replicas=mesh.num_replicas, lighthouse=addresses[mesh.stage], host=host, timeout=timeout)
    return sync, servers


class ReplicasMixin:
    """`Pipeline`'s methods about its replicas (it sets these attributes)."""

    mesh: PipelineMesh
    collectives: StepCollectives
    outer: OuterSync | None

    @property
    def replica(self) -> int:
        """This rank's pipeline replica (0..data_parallel-1): shard the data by it."""
        return self.mesh.replica

    @property
    def num_replicas(self) -> int:
        return self.mesh.num_replicas

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Tell the pipeline which optimizer steps this stage (needed with DiLoCo, whose outer step
        runs after every `sync_every` of its steps; a no-op for every other plan). Call once, after
        building the optimizer and before the first `train_step`. Returns `optimizer`."""
        if self.outer is not None:
            self.outer.attach(optimizer)
        return optimizer

    def count_over_replicas(self, count: int) -> int:
        """The sum of `count` over this stage's replicas (e.g. label tokens of an optimizer step,
        for `num_items_in_batch`). Collective over the data-parallel group."""
        return self.collectives.count_over_replicas(count)

    def gather_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        """Every replica's `t` (e.g. the rewards of a step's pairs, for metrics over the global
        batch), concatenated in replica order. Collective over the data-parallel group."""
        return self.collectives.gather_over_replicas(t)

    def shard_dataset(self, dataset):
        """This replica's shard of a `datasets.Dataset`: contiguous, and of the SAME length on every
        replica (the last `len % data_parallel` rows are dropped), so that replicas run the same
        number of steps and none waits forever at a collective. With AQ-SGD, add sample ids to the
        whole data set first: the replica keeps memory for its shard's ids only (`sample_range`)."""
        return shard_dataset(dataset, self.num_replicas, self.replica)
