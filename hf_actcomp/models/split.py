"""How a model is cut into pipeline stages: the block range of every stage."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from ..plan import Plan
    from .base import ModelAdapter


def stage_ranges(adapter: ModelAdapter, plan: Plan) -> list[range]:
    """The plan's block ranges for this model, balanced by parameter count unless explicit.

    Used by the simulation, the distributed pipeline and compressed inference alike, so that the
    same plan cuts a model at the same blocks everywhere.
    """

    def count(modules: list[nn.Module]) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    blocks = adapter.blocks()
    return plan.stage_ranges(
        adapter.num_blocks,
        [count([b]) for b in blocks],
        count(adapter.embedding_modules()),
        count(adapter.head_modules()),
    )
