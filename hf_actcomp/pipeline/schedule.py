"""Schedules as data: the actions each stage runs in one training step, in order.

An action is `(kind, micro_batch)`:

- `"F"`: forward of the micro-batch (receive its activations, run the stage, send them on);
- `"B"`: the input gradient (receive the output's gradient, compute the input's, send it back);
- `"W"`: the weight gradient (accumulate into the stage's parameters).

GPipe and 1F1B run each `B` right before its `W`; the executor then makes one backward pass of
the two (the same numbers and messages as a plain `backward()`). The first stage has no input
gradient to send: its split `B` only receives the output's gradient, and its `W` runs the whole
backward, so that its next forward leaves sooner. Zero-bubble H1 (`"zbh1"`, Qi et
al. 2023) runs `B` as soon as it can (the stage upstream waits for it) and moves `W` into the
idle slots that 1F1B leaves at the ends of a step; no stage holds more micro-batches' activations
than 1F1B's first stage does (`num_stages`), so the peak activation memory is 1F1B's.

Every stage runs its `F`s, and its `B`s, in micro-batch order, so the messages between two
stages arrive in the order they are expected. Sends never block (queued, waited for at the end
of the step), so a stage only waits for a message its peer is scheduled to send; the zero-bubble
order is made by simulating the step with unit-time actions, so it is deadlock-free by
construction (a stage runs its actions in the order the simulation ran them).
"""

from __future__ import annotations

from ..plan import SCHEDULES

Action = tuple[str, int]


def stage_actions(schedule: str, stage: int, num_stages: int, micro_batches: int) -> list[Action]:
    """Actions of `stage` (0-based) for one training step.

    GPipe: all forwards, then all backwards (activation memory grows with `micro_batches`).
    1F1B: `num_stages - stage - 1` warm-up forwards, then one forward / one backward alternating,
    then the remaining backwards (at most `num_stages - stage` micro-batches in flight).
    ZB-H1: the input gradients first, the weight gradients deferred into idle time (`zero_bubble_h1`).
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
        warmup = min(num_stages - stage - 1, micro_batches)
        order = [("F", i) for i in range(warmup)]
        for j in range(micro_batches - warmup):
            order += [("F", warmup + j), ("B", j)]
        order += [("B", j) for j in range(micro_batches - warmup, micro_batches)]
    return [a for kind, i in order for a in ([("F", i)] if kind == "F" else [("B", i), ("W", i)])]


def zero_bubble_h1(num_stages: int, micro_batches: int) -> list[list[Action]]:
    """Every stage's actions under ZB-H1, from a simulation of the step in unit time slots.

    At each slot every stage runs at most one action, chosen among those whose inputs are there:
    a `B` first (the stage upstream is waiting for it), then an `F` if the stage holds fewer
    than `num_stages` micro-batches whose weight gradient is still to do (1F1B's peak, on its
    first stage), else a `W`, the oldest first. A stage's `W` thus fills the slots where 1F1B
    would idle. Messages take the slot after the one that sent them."""
    S, M = num_stages, micro_batches
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro-batch) -> the slot it ran in
    next_f, next_b = [0] * S, [0] * S
    pending_w: list[list[int]] = [[] for _ in range(S)]
    actions: list[list[Action]] = [[] for _ in range(S)]
    slot, total = 0, 3 * S * M
    while sum(len(a) for a in actions) < total:
        ran = []
        for s in range(S):
            choice = None
            i = next_b[s]
            if i < M and done.get(("F", s, i), slot) < slot and (s == S - 1 or done.get(("B", s + 1, i), slot) < slot):
                choice = ("B", i)
            elif next_f[s] < M and next_f[s] - _w_done(actions[s]) < S and (
                    s == 0 or done.get(("F", s - 1, next_f[s]), slot) < slot):
                choice = ("F", next_f[s])
            elif pending_w[s]:
                choice = ("W", pending_w[s][0])
            if choice is not None:
                ran.append((s, choice))
        if not ran and slot > total * 4:
            raise RuntimeError(f"zero_bubble_h1({S}, {M}) found no order: this is a bug.")
        for s, (kind, i) in ran:
            actions[s].append((kind, i))
            done[(kind, s, i)] = slot
            if kind == "F":
                next_f[s] += 1
            elif kind == "B":
                next_b[s] += 1
                pending_w[s].append(i)
            else:
                pending_w[s].pop(0)
        slot += 1
    return _fused_where_free(actions)


def step_length(actions: list[list[Action]]) -> int:
    """The step's length when every stage runs its actions in order (`fused`), waiting for what
    it receives (an `F` for the stage before's, a `B` for the stage after's input gradient), as
    the executor runs them: a forward, a split `B` and a `W` 1 unit each, a fused `BW` 2 (it
    sends its input gradient when the whole backward ends); on the first stage a split `B` only
    receives (0) and its `W` is the whole backward (2). Raises on a deadlock."""
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
                cost = 0 if (s, kind) == (0, "B") else 2 if kind == "BW" or (s, kind) == (0, "W") else 1
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


def _w_done(actions: list[Action]) -> int:
    return sum(1 for kind, _ in actions if kind == "W")


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
