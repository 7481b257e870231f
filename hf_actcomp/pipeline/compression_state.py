"""This rank's compression state as `Pipeline` exposes it: built from the ends in force, saved and
loaded by hand or through Accelerate's hooks.

A mixin, so that engine.py keeps the steps. Under Plan.auto the ends change when the tuner
switches codecs, so the state is rebuilt then (`_compression_state`), and a saved state is loaded
only after the decision it was saved under is taken back: the state belongs to those codecs.
"""

from __future__ import annotations

import os

import torch

from ..state.compression import (
    DEFAULT_MAX_SHARD_SIZE,
    CompressionState,
    model_fingerprint,
    register_state_hooks,
)
from ..telemetry import CounterState, TrafficCounter
from .auto_tuner import AutoTuner
from .runner import StageRunner
from .tie import TiedEmbedding


def compression_state(runner: StageRunner, tie: TiedEmbedding | None, data_parallel, ranges: list[range],
                      config, traffic: dict[str, TrafficCounter]) -> CompressionState:
    """This rank's compression state with the ends now in force: the boundary ends, the tie's end
    and the data-parallel hook (or DiLoCo), checked at load against the plan, layout and model;
    and what this rank counted (its boundary ends', `traffic`'s and the hook's bytes)."""
    mesh, plan = runner.mesh, runner.plan
    blocks = ranges[mesh.stage]
    counters = CounterState.of(runner.boundaries, traffic, data_parallel)
    return CompressionState(
        {**runner.boundaries, "tie": tie, "data_parallel": data_parallel, "counters": counters},
        rank=mesh.replica * mesh.num_stages + mesh.stage,  # the rank in a launch of every replica
        metadata={"plan": plan.to_dict(), "world_size": plan.world_size, "stage": mesh.stage,
                  "blocks": [blocks.start, blocks.stop], "model": model_fingerprint(config)})


class CompressionStateMixin:
    """`Pipeline`'s compression-state methods (it sets these attributes)."""

    runner: StageRunner
    tie: TiedEmbedding | None
    data_parallel: object
    ranges: list[range]
    config: object
    traffic: dict[str, TrafficCounter]
    compression: CompressionState
    autotuner: AutoTuner | None
    _optimizer_steps: int

    def _compression_state(self) -> CompressionState:
        return compression_state(self.runner, self.tie, self.data_parallel, self.ranges, self.config, self.traffic)

    def compression_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's EF buffers, AQ-SGD memories, codec counters, data-parallel hook state and,
        with `Plan.tie_compression`, its end of the tie (`tie.copy` and `tie.error` on the first
        stage, `tie.mirror` on the last)."""
        return self.compression.state_dict()

    def load_compression_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.compression.load_state_dict(state)

    def save_compression_state(self, directory: str | os.PathLike,
                               max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        """Write this rank's compression state to `directory` (safetensors, sharded when large).
        Call on every rank."""
        self.compression.save(directory, max_shard_size)

    def load_compression_state(self, directory: str | os.PathLike) -> None:
        """Read this rank's state saved by `save_compression_state` under the same plan. Under
        `Plan.auto`, the codecs chosen when it was saved are taken back first (the state is theirs)."""
        self.restore_auto_decision(directory)
        self.compression.load(directory)

    def restore_auto_decision(self, directory: str | os.PathLike) -> None:
        """Under `Plan.auto`: take back the codecs chosen when the compression state in `directory`
        was saved (its metadata holds the plan), so that the state loads into the ends it belongs
        to. A no-op for any other plan. `load_compression_state` calls it; call it yourself before
        reading the state another way (`hf_actcomp.state.training_state.load_training_state`)."""
        if self.autotuner is not None and self.autotuner.restore(directory, self.compression.rank,
                                                                   self._optimizer_steps):
            self.compression = self._compression_state()

    def register_for_checkpointing(self, accelerator) -> None:
        """Make `accelerator.save_state(dir)` / `load_state(dir)` also save / load every rank's
        compression state under `dir/actcomp_state` (each rank registers its own hooks: Accelerate
        saves custom objects on the main process only). The hooks read the state when they run,
        so codecs that Plan.auto chooses or switches to after this call are the ones saved, and a
        load takes the saved codecs back first."""
        register_state_hooks(accelerator, lambda d: self.save_compression_state(d),  # looked up when the hook runs
                             lambda d: self.load_compression_state(d))
