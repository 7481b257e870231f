"""A trained pipeline as one Transformers checkpoint, saved locally or pushed to the Hub.

`StageWeights` (checkpointing.py) writes and reads each stage's tensors; this adds what makes the
folder a release: the plan, the measured traffic and the model card (rank 0), and the upload.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from ..plan import Plan
from .checkpointing import StageWeights


def save_pretrained(weights: StageWeights, save_directory: str | os.PathLike, model: nn.Module, *, plan: Plan,
                    blocks: list[list[int]], stats: dict, results: dict | None = None, **kwargs) -> None:
    """Write `model`'s checkpoint with every stage's shard, and on rank 0 the plan and the card
    (`stats`: the gathered traffic; `blocks`: each stage's `[start, stop)`). Collective."""
    base = weights.save(save_directory, model, **kwargs)
    if weights.mesh.rank == 0:
        from .. import hub  # the card renderer, only when saving

        plan.save_pretrained(save_directory)
        run = {"base_model": getattr(base, "name_or_path", None), **(results or {})}
        hub.save_run(save_directory, stats=stats, blocks=blocks, **run)
    dist.barrier(group=weights.group)


def push_to_hub(save: Callable[[str], None], weights: StageWeights, repo_id: str, *,
                save_directory: str | None = None, private: bool | None = None, token: str | bool | None = None,
                commit_message: str = "Upload model trained with hf-actcomp") -> None:
    """`save(directory)` on every rank, then rank 0 uploads; without `save_directory`, into a
    temporary folder made by the pipeline's first rank and removed after. Collective."""
    from .. import hub

    mesh, group = weights.mesh, weights.group
    holder = [save_directory]
    if save_directory is None:
        if mesh.rank == mesh.ranks[0]:
            holder = [tempfile.mkdtemp(prefix="hf_actcomp_push_")]
        dist.broadcast_object_list(holder, src=mesh.ranks[0], group=group)
    directory = holder[0]
    try:
        save(directory)
        error = None
        if mesh.rank == 0:
            try:
                hub.push_to_hub(directory, repo_id, private=private, token=token, commit_message=commit_message)
            except Exception as err:  # every rank must leave the barrier, then rank 0 re-raises
                error = err
        dist.barrier(group=group)
        if error is not None:
            raise error
    finally:
        if save_directory is None and mesh.rank == mesh.ranks[0]:
            shutil.rmtree(directory, ignore_errors=True)
