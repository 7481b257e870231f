"""The last stage's predictions on every rank of its pipeline, for Trainer's metrics.

Only the last stage has logits. `Trainer.evaluation_loop` runs on every rank and hands what
`prediction_step` returns to `compute_metrics`, so each rank needs the same predictions: the last
stage runs `preprocess_logits_for_metrics` on its logits (before anything crosses a link: an
argmax is V times smaller than the logits) and broadcasts the result over the pipeline group.
Shapes and dtypes are not known in advance, so a small header goes first (no pickle): the
number of tensors, then per tensor its dtype, rank and shape. Every byte is counted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..telemetry import TrafficCounter

# What a prediction may hold; bool crosses as uint8 (one byte either way).
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
MAX_DIMS = 8
ENTRY = 2 + MAX_DIMS  # dtype index, number of dims, the dims (padded)
_SINGLE, _TUPLE, _LIST, _NONE = 0, 1, 2, 3


def _flatten(value) -> tuple[list[torch.Tensor], int]:
    if value is None:
        return [], _NONE
    if isinstance(value, torch.Tensor):
        return [value], _SINGLE
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value), _TUPLE if isinstance(value, tuple) else _LIST
    raise TypeError(
        "preprocess_logits_for_metrics must return a tensor, or a tuple or list of tensors, for the last stage to "
        f"share it with the other stages; got {type(value).__name__}."
    )


def _header(tensors: list[torch.Tensor], kind: int) -> torch.Tensor:
    rows = [kind, len(tensors)]
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(f"A prediction of dtype {t.dtype} cannot be shared; allowed: {[str(d) for d in DTYPES]}.")
        if t.dim() > MAX_DIMS:
            raise ValueError(f"A prediction of {t.dim()} dimensions cannot be shared (at most {MAX_DIMS}).")
        rows += [DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (MAX_DIMS - t.dim())]
    return torch.tensor(rows, dtype=torch.int64)


def share_from_last(value, *, ranks: tuple[int, ...], rank: int, group, device: torch.device,
                    counter: TrafficCounter):
    """`value` of the rank `ranks[-1]` (a tensor, a tuple or list of tensors, or None) on every
    rank of `ranks`; collective over `group` (the pipeline). Bytes are counted on the sender, as
    a flat broadcast sends them: once to each other rank."""
    if len(ranks) == 1:
        return value
    src, sending = ranks[-1], rank == ranks[-1]
    sent = 0

    def broadcast(t: torch.Tensor) -> torch.Tensor:
        nonlocal sent
        dist.broadcast(t, src=src, group=group)
        sent += t.numel() * t.element_size()
        return t

    if sending:
        tensors, kind = _flatten(value)
        header = _header(tensors, kind).to(device)
        broadcast(torch.tensor([header.numel()], dtype=torch.int64, device=device))
        broadcast(header)
        for t in tensors:
            wire = t.detach().contiguous()
            broadcast(wire.view(torch.uint8) if wire.dtype == torch.bool else wire)
        counter.add(sent * (len(ranks) - 1), sent * (len(ranks) - 1))
        return value
    length = broadcast(torch.empty(1, dtype=torch.int64, device=device))
    header = broadcast(torch.empty(int(length), dtype=torch.int64, device=device)).tolist()
    kind, count = header[0], header[1]
    tensors = []
    for i in range(count):
        entry = header[2 + i * ENTRY: 2 + (i + 1) * ENTRY]
        dtype, shape = DTYPES[entry[0]], entry[2: 2 + entry[1]]
        wire = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=device)
        broadcast(wire)
        tensors.append(wire.bool() if dtype == torch.bool else wire)
    if kind == _NONE:
        return None
    return tensors[0] if kind == _SINGLE else tuple(tensors) if kind == _TUPLE else tensors
