"""The order in which one stage runs its micro-batches: GPipe and 1F1B.

A schedule is a list of actions `("F", i)` (forward of micro-batch i) and `("B", i)` (backward).
Every stage runs backwards in the same micro-batch order, so the gradient messages between two
stages arrive in the order they are expected. Sends never block (they are queued and waited for
at the end of the step), so a stage only ever waits for a message its peer has already been
scheduled to send: the schedules below cannot deadlock.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b")

Action = tuple[str, int]


def stage_actions(schedule: str, stage: int, num_stages: int, micro_batches: int) -> list[Action]:
    """Actions of `stage` (0-based) for one training step.

    GPipe: all forwards, then all backwards (activation memory grows with `micro_batches`).
    1F1B: `num_stages - stage - 1` warm-up forwards, then one forward / one backward alternating,
    then the remaining backwards (at most `num_stages - stage` micro-batches in flight).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not valid. Allowed values: {', '.join(SCHEDULES)}.")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} is outside [0, {num_stages}).")
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1.")
    if schedule == "gpipe":
        return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]
    warmup = min(num_stages - stage - 1, micro_batches)
    actions: list[Action] = [("F", i) for i in range(warmup)]
    for j in range(micro_batches - warmup):
        actions += [("F", warmup + j), ("B", j)]
    actions += [("B", j) for j in range(micro_batches - warmup, micro_batches)]
    return actions
