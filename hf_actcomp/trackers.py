"""Fail before training when a requested experiment tracker is not installed.

Accelerate only warns (and the run goes on with no logs); Trainer fails deep in its callbacks.
Both get one clear error here, naming the install command.
"""

from __future__ import annotations

import importlib.util

# report_to name -> (modules that provide it, what to install)
TRACKERS = {
    "tensorboard": (("tensorboard", "tensorboardX"), "pip install 'hf-actcomp[tensorboard]'"),
    "wandb": (("wandb",), "pip install 'hf-actcomp[wandb]'"),
    "mlflow": (("mlflow",), "pip install mlflow"),
    "comet_ml": (("comet_ml",), "pip install comet_ml"),
    "clearml": (("clearml",), "pip install clearml"),
    "trackio": (("trackio",), "pip install trackio"),
    "swanlab": (("swanlab",), "pip install swanlab"),
    "aim": (("aim",), "pip install aim"),
    "dvclive": (("dvclive",), "pip install dvclive"),
}


def requested(report_to: str | list[str] | None) -> list[str]:
    """The tracker names in a `report_to` value (`None`, "none" and "all" request none by name)."""
    if report_to is None:
        return []
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    return [n for n in names if n not in ("none", "all")]


def check_trackers(report_to: str | list[str] | None) -> None:
    """Raise `ImportError` naming the install command for every requested tracker that is missing."""
    missing = []
    for name in requested(report_to):
        modules, install = TRACKERS.get(name, ((name,), f"pip install {name}"))
        if not any(importlib.util.find_spec(m) is not None for m in modules):
            missing.append(f"{name!r} ({install})")
    if missing:
        raise ImportError(f"report_to asks for trackers that are not installed: {', '.join(missing)}. "
                          "Install them, or drop them from report_to.")
