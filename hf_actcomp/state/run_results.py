"""`actcomp_results.json`: what a run measured, saved beside the model.

Its own module because the card, the `hf-actcomp` command and the samples callback all read or
extend the file, and none of them should need the card renderer or the Hub client to do so.
"""

from __future__ import annotations

import json
import os
from typing import Any

RESULTS_NAME = "actcomp_results.json"


def save_results(directory: str | os.PathLike, *, stats: dict | None = None, metrics: dict | None = None,
                 log_history: list[dict] | None = None, **extra: Any) -> str:
    """Write what a run measured to `actcomp_results.json` (the card and the CLI read it)."""
    os.makedirs(directory, exist_ok=True)
    results = {"stats": stats or {}, "metrics": metrics or {}, "log_history": log_history or [], **extra}
    path = os.path.join(directory, RESULTS_NAME)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=float)
    return path


def load_results(directory: str | os.PathLike) -> dict:
    """The saved results of `directory`, or empty ones when the run saved none."""
    path = os.path.join(directory, RESULTS_NAME)
    if not os.path.isfile(path):
        return {"stats": {}, "metrics": {}, "log_history": []}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def update_results(directory: str | os.PathLike, **entries: Any) -> str:
    """Set `entries` in the saved results of `directory`, keeping the rest (the card's metadata
    given after the save, e.g. by `Trainer.push_to_hub(language=...)`)."""
    results = load_results(directory)
    results.update(entries)
    return save_results(directory, **results)
