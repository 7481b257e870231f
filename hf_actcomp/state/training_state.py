"""Everything a hand-written training loop needs to continue exactly where it stopped, per rank.

`save_training_state(directory, ...)` writes this rank's part of a checkpoint (call it inside
`resume.writing_checkpoint`); `load_training_state(directory, ...)` reads it back, checking first
that it was saved under the same plan, layout and model (the compression state's metadata), so a
checkpoint from another run is a clear error before anything is overwritten. Files, per rank r:

    actcomp_state/rank{r}.json + .safetensors   compression state (boundaries, tie, hook) and its metadata
    weights-rank{r}.safetensors                the module this rank trains (a stage, or the whole model)
    optimizer-rank{r}.pt                       optimizer state (read back with weights_only=True)
    rng-rank{r}.safetensors                    torch's global RNG and the data order's generator
    progress-rank{r}.json                      step, epoch, position in the epoch, and what the loop adds

Tensors go through safetensors; the optimizer's nested state dict through
`torch.load(weights_only=True)`, never a pickle of arbitrary objects.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from .compression import COMPRESSION_STATE_DIR, CompressionState
from .resume import maybe_pause_for_fault_test


def _files(directory: str, rank: int) -> dict[str, str]:
    return {kind: os.path.join(directory, name.format(rank=rank)) for kind, name in (
        ("weights", "weights-rank{rank}.safetensors"), ("optimizer", "optimizer-rank{rank}.pt"),
        ("rng", "rng-rank{rank}.safetensors"), ("progress", "progress-rank{rank}.json"))}


def save_training_state(directory: str | os.PathLike, *, rank: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                        compression: CompressionState, progress: dict[str, Any],
                        generator: torch.Generator | None = None, scheduler=None) -> None:
    """Write this rank's part of a checkpoint to `directory`.

    Args:
        rank: this process's rank (each rank writes its own files).
        module: what this rank trains (`pipe.stage`, or the simulated model).
        optimizer / scheduler: their state dicts.
        compression: the runner's `compression` (`Pipeline.compression`, `SimulatedPipeline.compression`).
        progress: JSON-serialisable loop position (step, epoch, batches done in the epoch, ...).
        generator: the data order's generator, as it was when the current epoch's order was drawn.
    """
    directory = os.fspath(directory)
    files = _files(directory, rank)
    step = int(progress.get("step", -1))
    compression.save(os.path.join(directory, COMPRESSION_STATE_DIR))
    save_model(module, files["weights"])
    maybe_pause_for_fault_test(step, rank, "writing")  # a test may kill this rank here, in the middle of the write
    state = {"optimizer": optimizer.state_dict()}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    torch.save(state, files["optimizer"])
    rng = {"torch": torch.get_rng_state()}
    if generator is not None:
        rng["generator"] = generator.get_state()
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, files["rng"])
    with open(files["progress"], "w", encoding="utf-8") as f:
        json.dump(progress, f, indent=1)


def load_training_state(directory: str | os.PathLike, *, rank: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                        compression: CompressionState, generator: torch.Generator | None = None,
                        scheduler=None) -> dict[str, Any]:
    """Restore this rank's part of a checkpoint written by `save_training_state`; returns its
    `progress`. Raises a ValueError or FileNotFoundError that names the file at fault (a missing
    rank file, a truncated or corrupted one, state from another plan, layout or model) before
    the module, optimizer or compression state is changed; only a file that passes the checks
    but then cannot be applied can leave them half loaded, and the error says which."""
    directory = os.fspath(directory)
    files = _files(directory, rank)
    for path in files.values():
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: this checkpoint has no state of rank {rank}. Was it "
                                    "written by a run with as many processes, and completely?")
    compression_state = compression.read(os.path.join(directory, COMPRESSION_STATE_DIR))  # checks plan and model
    rng = _read_safetensors(files["rng"])
    try:
        state = torch.load(files["optimizer"], map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 (torch raises several kinds for a damaged file)
        raise ValueError(f"{files['optimizer']} cannot be read ({err}); the file is damaged.") from err
    with open(files["progress"], encoding="utf-8") as f:
        progress = json.load(f)
    try:
        missing, unexpected = load_model(module, files["weights"], strict=False)
    except SafetensorError as err:
        raise ValueError(f"{files['weights']} cannot be read ({err}); the file is truncated or damaged.") from err
    except RuntimeError as err:
        raise ValueError(f"{files['weights']} does not fit this rank's module: {err}") from err
    if missing or unexpected:
        raise ValueError(f"{files['weights']} does not fit this rank's module (missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}): it was saved from another model or split.")
    compression.load_state_dict(compression_state)
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(rng["torch"])
    if generator is not None:
        generator.set_state(rng["generator"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return progress


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    try:
        return {k: v.clone() for k, v in load_file(path).items()}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} cannot be read ({err}); the file is truncated or damaged.") from err
