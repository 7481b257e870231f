"""Where the model is cut: the checks of `Plan.split_points` and `Plan.boundaries` (a codec of
its own per cut), and the block ranges of each stage, balanced by cost when no split is given.

Apart from `Plan` because it is arithmetic on block indices and boundary numbers: no model needed.
"""

from __future__ import annotations

from typing import Any

from .compression import Compression


def check_split_points(value: Any, num_stages: int) -> list[int] | None:
    """`Plan.split_points`, checked: None, or num_stages - 1 strictly increasing block indices > 0."""
    if value is None:
        return None
    points = list(value)
    if len(points) != num_stages - 1:
        raise ValueError(
            f"Plan.split_points={points} must have num_stages - 1 = {num_stages - 1} entries."
        )
    if any(not isinstance(p, int) for p in points) or any(p <= 0 for p in points):
        raise ValueError(f"Plan.split_points={points} must be positive integers (block indices).")
    if any(b <= a for a, b in zip(points, points[1:], strict=False)):
        raise ValueError(f"Plan.split_points={points} must be strictly increasing.")
    return points


def block_ranges(num_stages: int, split_points: list[int] | None, num_blocks: int,
                  block_costs: list[int] | None, first_cost: int, last_cost: int) -> list[range]:
    """`Plan.stage_ranges`: `split_points` when given, else `block_costs` balanced."""
    if num_stages > num_blocks:
        raise ValueError(
            f"Plan.num_stages={num_stages} is more than the model's {num_blocks} blocks; "
            f"use at most {num_blocks} stages."
        )
    if split_points is not None:
        if split_points and split_points[-1] >= num_blocks:
            raise ValueError(
                f"Plan.split_points={split_points} must all be < the model's {num_blocks} blocks."
            )
        points = split_points
    else:
        costs = block_costs if block_costs is not None else [1] * num_blocks
        points = _balanced_split_points(costs, num_stages, first_cost, last_cost)
    bounds = [0, *points, num_blocks]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _balanced_split_points(costs: list[int], num_stages: int, first_cost: int, last_cost: int) -> list[int]:
    """Split points minimising the largest stage cost (each stage gets at least one block).

    A small dynamic programme over (blocks, stages); models have at most a few hundred blocks.
    """
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int, stage: int) -> int:
        extra = (first_cost if stage == 0 else 0) + (last_cost if stage == num_stages - 1 else 0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # best[s][i]: minimal max cost to place blocks [0, i) on stages 0..s-1; arg stores the split.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    arg = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(j, i, s - 1))
                if value < best[s][i]:
                    best[s][i], arg[s][i] = value, j
    points, i = [], n
    for s in range(num_stages, 1, -1):
        i = arg[s][i]
        points.append(i)
    return sorted(points)


def check_boundaries(value: Any, num_stages: int) -> list[dict[str, Compression] | None] | None:
    """`Plan.boundaries`, checked: None, or num_stages - 1 entries of None or {"forward"/"backward":
    Compression (or its dict)}; all-None lists become None."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != num_stages - 1:
        raise ValueError(f"Plan.boundaries={value!r} must be a list of num_stages - 1 = {num_stages - 1} entries "
                         "(one per boundary: None or a dict with 'forward' and/or 'backward').")
    out: list[dict[str, Compression] | None] = []
    for b, entry in enumerate(value):
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, dict) or not set(entry) <= {"forward", "backward"}:
            raise ValueError(f"Plan.boundaries[{b}]={entry!r} must be None or a dict with the keys 'forward' "
                             "and/or 'backward'.")
        checked = {}
        for direction, compression in entry.items():
            if isinstance(compression, dict):
                compression = Compression(**compression)
            if not isinstance(compression, Compression):
                raise TypeError(f"Plan.boundaries[{b}][{direction!r}] must be a Compression (or its dict), got "
                                f"{type(compression).__name__}.")
            checked[direction] = compression
        out.append(checked or None)
    return out if any(out) else None

