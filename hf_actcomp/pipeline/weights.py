"""A trained pipeline as one Transformers checkpoint, saved locally or pushed to the Hub.

`StageWeights` (state/weight_shards.py) writes and reads each stage's tensors; this adds what makes the
folder a release: the plan, the measured traffic and the model card (rank 0), and the upload.
`WeightsMixin` gives `Pipeline` these as methods, so that engine.py keeps the steps.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from ..plan import Plan
from ..state.weight_shards import StageWeights


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


class WeightsMixin:
    """`Pipeline`'s methods that save and load its weights (it sets these attributes)."""

    weights: StageWeights
    model: nn.Module
    plan: Plan
    ranges: list[range]

    def save_pretrained(self, save_directory: str | os.PathLike, model: nn.Module | None = None,
                        results: dict | None = None, **kwargs) -> None:
        """Write ONE Transformers checkpoint: each stage's rank writes its own safetensors shard
        (no weights cross between ranks), rank 0 the index, config, `actcomp_config.json` and the
        model card. Collective: call on every rank.

        `model` defaults to the model passed to `prepare` (its config and class are used on rank 0). For a
        `peft.PeftModel` only the adapter is gathered and written (`adapter_model.safetensors`),
        which `PeftModel.from_pretrained(base, dir)` loads. `results` (eval metrics, log history,
        ...) join the measured traffic in `actcomp_results.json` and the model card.
        """
        stats = self.stats(gather=True)  # collective: every rank, before rank 0 writes
        save_pretrained(self.weights, save_directory, model if model is not None else self.model, plan=self.plan,
                        blocks=[[r.start, r.stop] for r in self.ranges], stats=stats, results=results, **kwargs)

    def push_to_hub(self, repo_id: str, model: nn.Module | None = None, *, save_directory: str | None = None,
                    private: bool | None = None, token: str | bool | None = None,
                    commit_message: str = "Upload model trained with hf-actcomp") -> None:
        """Save (`save_pretrained`, with the model card) and upload to the Hub repo `repo_id`.
        Collective: call on every rank; rank 0 uploads (`hf_actcomp.hub.push_to_hub`). Without
        `save_directory`, a temporary folder made by rank 0 (every stage writes its shard there:
        the ranks must share a filesystem, as for any per-stage save)."""
        push_to_hub(lambda directory: self.save_pretrained(directory, model=model), self.weights, repo_id,
                    save_directory=save_directory, private=private, token=token, commit_message=commit_message)

    def load_stage_weights(self, directory: str | os.PathLike) -> None:
        """Load this stage's parameters from a `save_pretrained` directory, reading only its own
        tensors (for a PEFT pipeline: its adapter weights from `adapter_model.safetensors`)."""
        self.weights.load(directory)
