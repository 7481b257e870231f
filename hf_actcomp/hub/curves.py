"""`training_curves.png`: the loss and traffic of a run against the optimizer step.

Apart from the card because it is the one piece that needs matplotlib, imported only when a run
with a log history is saved.
"""

from __future__ import annotations

import os

CURVES_NAME = "training_curves.png"


def plot_curves(directory: str | os.PathLike, log_history: list[dict]) -> str | None:
    """`training_curves.png`: training loss, eval loss (with and without the codec) and bytes
    per optimizer step of each boundary direction, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h.get("eval_loss"), h.get("eval_plain_loss")) for h in log_history
             if "eval_loss" in h and "step" in h]
    channels = sorted({k[len("comm/"):-len("/bytes_sent")] for h in log_history for k in h
                       if k.startswith("comm/boundary") and k.endswith("/bytes_sent")})
    if not train and not evals:
        return None
    fig, axes = plt.subplots(1, 2 if channels else 1, figsize=(11 if channels else 6, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train, strict=True), label="training loss")
    if evals:
        steps = [s for s, _, _ in evals]
        ax.plot(steps, [e for _, e, _ in evals], "o-", label="eval loss (codec at inference)")
        if any(p is not None for _, _, p in evals):
            ax.plot(steps, [p for _, _, p in evals], "s--", label="eval loss (no codec)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    if channels:
        ax = axes[0][1]
        for name in channels:
            points = [(0, 0)] + [(h["step"], h[f"comm/{name}/bytes_sent"]) for h in log_history
                      if f"comm/{name}/bytes_sent" in h and "step" in h]
            per_step = [((b - pb) / (s - ps)) for (ps, pb), (s, b) in zip(points, points[1:], strict=False) if s > ps]
            ax.plot([s for (ps, _), (s, _) in zip(points, points[1:], strict=False) if s > ps], per_step, label=name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("bytes per step")
        ax.legend()
    fig.tight_layout()
    path = os.path.join(directory, CURVES_NAME)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
