"""Schedules as data: the actions each stage runs in one training step, in order.

An action is `(kind, micro_batch)`:

- `"F"`: forward of the micro-batch (receive its activations, run the stage, send them on);
- `"B"`: the input gradient (receive the output's gradient, compute the input's, send it back);
- `"W"`: the weight gradient (accumulate into the stage's parameters).

GPipe and 1F1B run each `B` right before its `W`; the executor then makes one backward pass of
the two (the same numbers and messages as a plain `backward()`). Zero-bubble H1 (`"zbh1"`, Qi et
al. 2023) runs 1F1B's forwards and backwards in 1F1B's order but splits them: stage s defers its
weight gradients by s micro-batches, so its input gradients leave upstream a `W` sooner and the
`W`s fill the slots 1F1B idles in at the ends of a step; no stage holds more micro-batches'
activations than 1F1B's first stage does (`num_stages`), so the peak activation memory is 1F1B's.

Every stage runs its `F`s, and its `B`s, in micro-batch order, so the messages between two
stages arrive in the order they are expected. Sends never block (queued, waited for at the end
of the step), so a stage only waits for a message its peer is scheduled to send. zbh1 sends and
receives exactly what 1F1B does, in the same order (a `W` sends nothing), so it is as
deadlock-free as 1F1B.
"""

from __future__ import annotations

from ..plan import SCHEDULES

Action = tuple[str, int]


def stage_actions(schedule: str, stage: int, num_stages: int, micro_batches: int) -> list[Action]:
    """Actions of `stage` (0-based) for one training step.

    GPipe: all forwards, then all backwards (activation memory grows with `micro_batches`).
    1F1B: `num_stages - stage - 1` warm-up forwards, then one forward / one backward alternating,
    then the remaining backwards (at most `num_stages - stage` micro-batches in flight).
    ZB-H1: 1F1B's order with the weight gradients deferred into idle time (`zero_bubble_h1`).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not valid. Allowed values: {', '.join(SCHEDULES)}.")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} is outside [0, {num_stages}).")
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1.")
    if schedule == "zbh1":
        return zero_bubble_h1(num_stages, micro_batches)[stage]
    if schedule == "gpipe":
        order = [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]
    else:
        order = _one_f_one_b(stage, num_stages, micro_batches)
    return [a for kind, i in order for a in ([("F", i)] if kind == "F" else [("B", i), ("W", i)])]


def _one_f_one_b(stage: int, num_stages: int, micro_batches: int) -> list[Action]:
    """1F1B's forwards and backwards (`B` standing for the whole backward)."""
    warmup = min(num_stages - stage - 1, micro_batches)
    order = [("F", i) for i in range(warmup)]
    for j in range(micro_batches - warmup):
        order += [("F", warmup + j), ("B", j)]
    return order + [("B", j) for j in range(micro_batches - warmup, micro_batches)]


def zero_bubble_h1(num_stages: int, micro_batches: int) -> list[list[Action]]:
    """Every stage's actions under ZB-H1: 1F1B's order, stage s's `W`s each `s` backwards late.

    The last stage, which 1F1B keeps idle at the end of the step while the input gradients travel
    upstream, defers the most; the first stage, with no input gradient to send, runs each
    backward whole. In unit time (F = B = W, `step_length`) the step is 3M + S - 1 for M >= S:
    the last stage's 3M units after the S - 1 forwards it must wait for at the start, so no
    synchronous schedule is shorter (1F1B's is 3M + 3(S - 1)). Stage s holds at most
    S - 1 - s warm-up + 1 + s = S micro-batches."""
    actions = []
    for s in range(num_stages):
        order, deferred = [], []
        for kind, i in _one_f_one_b(s, num_stages, micro_batches):
            order.append((kind, i))
            if kind == "B":
                deferred.append(i)
                if len(deferred) > s:
                    order.append(("W", deferred.pop(0)))
        actions.append(order + [("W", i) for i in deferred])
    return _fused_where_free(actions)


def step_length(actions: list[list[Action]]) -> int:
    """The step's length when every stage runs its actions in order (`fused`), waiting for what
    it receives (an `F` for the stage before's, a `B` for the stage after's input gradient), as
    the executor runs them: a forward, a split `B` and a `W` 1 unit each, a fused `BW` 2 (it
    sends its input gradient when the whole backward ends). Raises on a deadlock."""
    num_stages = len(actions)
    runs = [fused(a) for a in actions]
    finished: dict[tuple[str, int, int], int] = {}
    clock, pos = [0] * num_stages, [0] * num_stages
    while any(pos[s] < len(runs[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            while pos[s] < len(runs[s]):
                kind, i = runs[s][pos[s]]
                needs = {"F": [("F", s - 1, i)] if s else [], "W": [("B", s, i)]}.get(
                    kind, [("F", s, i)] + ([("B", s + 1, i)] if s < num_stages - 1 else []))
                if any(n not in finished for n in needs):
                    break
                cost = 2 if kind == "BW" else 1
                clock[s] = max([clock[s]] + [finished[n] for n in needs]) + cost
                finished[(kind[0], s, i)] = clock[s]  # a `BW` finishes its `B` at its end
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"The schedule deadlocks at {pos}.")
    return max(clock)


def _fused_where_free(actions: list[list[Action]]) -> list[list[Action]]:
    """Move each deferred `W` back right after its `B` wherever the step gets no longer: a split
    backward costs autograd bookkeeping that a fused one does not (measured on this CPU:
    benchmarks/results/schedules.md), so only the `W`s that fill idle time stay apart."""
    best = step_length(actions)
    for s in range(len(actions)):
        for _, i in [a for a in actions[s] if a[0] == "B"]:
            order = [a for a in actions[s] if a != ("W", i)]
            at = order.index(("B", i)) + 1
            trial = [*actions[:s], order[:at] + [("W", i)] + order[at:], *actions[s + 1:]]
            if trial[s] != actions[s] and step_length(trial) <= best:
                actions = trial
    return actions


def fused(actions: list[Action]) -> list[Action]:
    """What the executor runs: a `B` right before its own `W` becomes one `("BW", i)`, a single
    backward pass (GPipe and 1F1B are all of this form)."""
    out: list[Action] = []
    for kind, i in actions:
        if kind == "W" and out and out[-1] == ("B", i):
            out[-1] = ("BW", i)
        else:
            out.append((kind, i))
    return out
