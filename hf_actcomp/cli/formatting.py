"""How the `hf-actcomp` command prints a byte count: B, then KiB, MiB, GiB, TiB with one decimal.

Shared by `inspect` (tensor sizes) and `estimate` (bytes per step), so both read the same.
"""

from __future__ import annotations


def size_text(nbytes: float) -> str:
    """`nbytes` in the largest binary unit that keeps it under 1024 (TiB at most)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""  # pragma: no cover
