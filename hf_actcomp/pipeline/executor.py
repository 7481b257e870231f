"""Runs one training step's action list (schedule.py) on a stage's runner.

The schedule is data and the runner knows one micro-batch; this loop joins them, keeping each
forward's tensors until its backward and pairing each send with the receive that follows it.
"""

from __future__ import annotations

import torch

from ..batching import MicroBatch
from .runner import StageRunner
from .schedule import Action


def run_actions(runner: StageRunner, actions: list[Action], micro: list[MicroBatch], normaliser) -> torch.Tensor:
    """Run `actions` (fused: `F`, `B`, `W`, `BW`) over `micro`; returns the sum of the
    micro-batches' losses on the last stage (zero elsewhere), detached, in float32."""
    saved: dict[int, tuple] = {}
    split = {i for kind, i in actions if kind == "B"}  # a `B` apart from its `W`: a split backward
    total = torch.zeros((), dtype=torch.float32, device=runner.device)
    for k, (kind, i) in enumerate(actions):
        pair = k + 1 < len(actions) and runner.receives(actions[k + 1][0])
        if kind == "F":
            saved[i] = runner.forward(i, micro[i], normaliser, pair, split=i in split)
            if runner.is_last:
                total += saved[i][1].detach().float()
        elif kind == "W":
            runner.weight(i)
        else:
            runner.backward(i, *saved.pop(i), pair, split=kind == "B")
    return total
