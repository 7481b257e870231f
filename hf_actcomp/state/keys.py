"""State-dict key prefixes: the one place that adds and strips a name in front of state keys.

Every stateful object (a boundary, a feedback sender, a tie, a data-parallel compressor) nests
the state of its parts under `part.`; these two helpers do it, for all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

V = TypeVar("V")


def prefixed(state: Mapping[Any, V], prefix: str) -> dict[str, V]:
    """`state` with `prefix.` in front of every key (keys other than strings, such as slot
    numbers, are written with `str`)."""
    return {f"{prefix}.{k}": v for k, v in state.items()}


def unprefixed(state: Mapping[str, V], prefix: str) -> dict[str, V]:
    """The entries of `state` under `prefix.`, with the prefix removed."""
    head = f"{prefix}."
    return {k[len(head):]: v for k, v in state.items() if k.startswith(head)}
