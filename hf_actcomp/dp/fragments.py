"""Streaming DiLoCo's fragments: how a stage's trainable parameters are split into the parts that
sync in turn (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication").

Each fragment is a run of whole tensors, contiguous in name order, with about the same number of
elements: a sync's bytes are about 1/F of the stage's, and every replica splits the same way
(it sees the same names and shapes), which the exchange needs.
"""

from __future__ import annotations

from itertools import pairwise

from torch import nn

Named = list[tuple[str, nn.Parameter]]


def split_fragments(named: Named, fragments: int, stage: int = 0) -> list[Named]:
    """`named` (in name order) cut into `fragments` non-empty contiguous runs of whole tensors.
    Cut k (1..F-1) falls after the tensor whose running element count is nearest to
    k/F of the total (the earlier on a tie), leaving at least one tensor to each fragment."""
    if fragments == 1:
        return [list(named)]
    if len(named) < fragments:
        raise ValueError(f"Plan.dp_compression (diloco) fragments={fragments}: stage {stage} has {len(named)} "
                         f"trainable tensor(s), and a fragment is one or more whole tensors. Use fragments <= "
                         f"{max(len(named), 1)} (the smallest stage's count of trainable tensors).")
    running, total = [], 0
    for _, p in named:
        total += p.numel()
        running.append(total)  # running[i]: elements of tensors 0..i
    cuts, start = [], 0  # a cut c: the fragment ends after tensor c - 1
    for k in range(1, fragments):
        target = k * total / fragments
        candidates = range(start + 1, len(named) - (fragments - k) + 1)
        cut = min(candidates, key=lambda c: (abs(running[c - 1] - target), c))
        cuts.append(cut)
        start = cut
    return [list(named[a:b]) for a, b in pairwise([0, *cuts, len(named)])]
