"""The gradient path of one pipeline stage after the backward: replica averaging and clipping.

After the micro-batches' backwards have accumulated into `.grad` and the tied embedding's
gradient rows have reached their owner (`tie.py`):

0. Parameters every stage holds (DeBERTa-v2's relative-position embeddings: `shared`) have their
   gradients summed over the pipeline's stages (an all-reduce), so that every copy takes the same
   update and stays equal, as the one tensor of the unsplit model.

1. Replica averaging over the stage's data-parallel group, once per optimizer step
   (`sync=True`), through the plan's hook, over trainable parameters only. It runs after the tie,
   so that a lossy hook compresses the owner's complete gradient, once; the first stage's copy of
   a tied embedding has no gradient of its own and is skipped.
2. The global clip norm over all stages (`clip_grad_norm_`), with torch's `get_total_norm` and
   `clip_grads_with_norm_`.

Frozen parameters (`requires_grad=False`, as PEFT leaves the base model) are never given a
gradient, communicated or counted.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ..dp.base import ring_allreduce_bytes
from ..telemetry import TrafficCounter
from .mesh import PipelineMesh
from .tie import TiedEmbedding


class GradientSync:
    """Replica averaging and global clipping for one stage (see the module docstring).

    Args:
        stage: this rank's stage module.
        mesh: ranks of this pipeline and of the stage's data-parallel group.
        pipeline_group: the pipeline's process group (for the clip norm).
        dp_compressor: the plan's data-parallel hook, or None without replicas.
        tie: this stage's end of the tied embedding, or None.
        collectives: where bytes of the clip-norm and shared-gradient all-reduces are counted.
        shared: names of the parameters every stage holds a copy of (`ModelAdapter.shared_parameters`).
    """

    def __init__(self, stage: nn.Module, mesh: PipelineMesh, pipeline_group: dist.ProcessGroup,
                 dp_compressor, tie: TiedEmbedding | None, collectives: TrafficCounter,
                 shared: list[str] | None = None) -> None:
        self.stage = stage
        self.mesh = mesh
        self.pipeline_group = pipeline_group
        self.dp_compressor = dp_compressor
        self.tie = tie
        self.collectives = collectives
        params = dict(stage.named_parameters())
        self.shared = ([params[n] for n in sorted(shared or []) if n in params and params[n].requires_grad]
                       if mesh.num_stages > 1 else [])
        self._held: list[torch.Tensor | None] = [None] * len(self.shared)
        self.seconds = 0.0

    def hold_shared(self) -> None:
        """Before a step's backward: set aside what the shared gradients hold already (an earlier
        step of the same accumulation, summed over the stages then), so that only this step's
        part is summed and nothing is counted twice."""
        self._held = [p.grad for p in self.shared]
        for p in self.shared:
            p.grad = None

    def sum_shared_over_stages(self) -> None:
        """After the backward: sum this step's gradients of the parameters every stage holds over
        the pipeline's stages (each stage's copy saw only its own layers' use of it) and add them
        to what `hold_shared` set aside: every copy then holds the unsplit model's gradient."""
        if not self.shared:
            return
        start = time.perf_counter()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.shared])
        dist.all_reduce(flat, group=self.pipeline_group)
        self.collectives.add(ring_allreduce_bytes(flat.numel() * flat.element_size(), self.mesh.num_stages))
        for p, before, total in zip(self.shared, self._held, flat.split([p.numel() for p in self.shared]), strict=True):
            total = total.view_as(p)
            p.grad = total.clone() if before is None else before.add_(total)
        self._held = [None] * len(self.shared)
        self.seconds += time.perf_counter() - start

    def reset_stats(self) -> None:
        self.seconds = 0.0

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """Parameters whose gradient this stage owns, in name order (the same on every replica):
        trainable, and not the first stage's copy of a tied embedding."""
        skip = id(self.tie.param) if self.tie is not None and not self.tie.is_owner else None
        return [(n, p) for n, p in sorted(self.stage.named_parameters())
                if p.requires_grad and id(p) != skip]

    def average_over_replicas(self) -> None:
        """Average the accumulated gradients over this stage's replicas, through the hook."""
        if self.dp_compressor is None:
            return
        start = time.perf_counter()
        params = [p for _, p in self.trainable()]
        for p in params:
            if p.grad is None:  # unused in this step: every replica must still send the same layout
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        averaged = self.dp_compressor.reduce(flat, params)
        self.dp_compressor.end_step()
        for p, g in zip(params, averaged.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))
        self.seconds += time.perf_counter() - start

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every stage's gradients so that their global norm is at most `max_norm`.

        Each gradient is counted once (tied copies and replicas included). Returns the norm
        before clipping, on every rank.
        """
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"norm_type={norm_type!r} is not supported; use 2.0 or float('inf').")
        params = [p for _, p in self.trainable() if p.grad is not None]
        # A parameter every stage holds counts once: on the first stage.
        shared = {id(p) for p in self.shared} if self.mesh.stage > 0 else set()
        counted = [p.grad for p in params if id(p) not in shared]
        device = params[0].grad.device if params else torch.device("cpu")
        local = (torch.nn.utils.get_total_norm(counted, norm_type)
                 if counted else torch.zeros((), device=device)).float()
        if self.mesh.num_stages > 1:
            start = time.perf_counter()
            if norm_type == 2.0:
                local = local.square()
                dist.all_reduce(local, group=self.pipeline_group)
                local = local.sqrt()
            else:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.pipeline_group)
            self.collectives.add(ring_allreduce_bytes(local.element_size(), self.mesh.num_stages))
            self.seconds += time.perf_counter() - start
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, local)
        return local
