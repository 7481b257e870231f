"""`Plan`: how a model is split into pipeline stages and what crosses each stage boundary.

The one object a user writes (in Python, JSON or YAML); everything else in the package is built
from it. Every field is validated in `__post_init__`, so a bad value fails before any model is
touched; each part's own checks live with that part (`compression`, `memory`, `auto`, `diloco`,
`split`), and its io in `config.ConfigMixin`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..codecs import available_codecs
from .auto_config import AutoConfig
from .compression import AQSGD, Compression
from .config import ConfigMixin, check_choice, known_fields
from .diloco import DILOCO, REPLICA_ENV, DiLoCoConfig, check_dp_compression
from .memory_config import MemoryConfig
from .split import block_ranges, check_boundaries, check_split_points

SCHEDULES = ("gpipe", "1f1b", "zbh1")  # hf_actcomp/pipeline/schedule.py builds their actions


def launched_per_replica(plan: Plan) -> bool:
    """A DiLoCo plan whose replicas are launched one at a time (`REPLICA_GROUP_ID` set)."""
    return plan.diloco is not None and REPLICA_ENV in os.environ


@dataclass
class Plan(ConfigMixin):
    """How a model is split into pipeline stages and what crosses each stage boundary.

    Args:
        num_stages: number of pipeline stages (>= 1). Without `split_points` the blocks are
            balanced by parameter count (embeddings count on the first stage, head on the last).
        split_points: explicit first block index of stages 1..S-1 (strictly increasing, > 0).
        micro_batches: micro-batches per step; each is sent across boundaries separately.
            Defaults to `num_stages` (the fewest 1F1B accepts).
        schedule: pipeline schedule for distributed runs: `gpipe`, `1f1b` or `zbh1` (zero-bubble H1:
            weight gradients deferred into 1F1B's idle time; docs/pipeline.md).
        forward: compression of activations (stage s -> s+1).
        backward: compression of activation gradients (stage s+1 -> s); gradients usually
            need milder compression than activations.
        memory: AQ-SGD memory placement.
        data_parallel: pipeline replicas (D); the job has num_stages x data_parallel processes,
            rank = replica * num_stages + stage. Each stage averages its gradients over its D
            copies with `dp_compression`.
        dp_compression: the data-parallel hook: a name from `hf_actcomp.dp.available_hooks()` (a
            hook of your own once added with `hf_actcomp.dp.register_hook`), or a dict with
            `method` and the hook's parameters, e.g. `{"method": "topk", "ratio": 0.01}`. Or
            `{"method": "diloco", "sync_every": 32, ...}`: replicas that talk only every
            `sync_every` optimizer steps, through torchft (`DiLoCoConfig`, docs/data_parallel.md);
            with `"fragments": F`, Streaming DiLoCo: F parts of each stage that sync in turn.
        tie_compression: how the rows of an embedding tied to the LM head (GPT-2, OPT) travel
            between the first and the last stage, e.g. `Compression("quantize", bits=8)`. None
            (default): exact, in the weight's dtype. Otherwise rows go as deltas against a mirror
            of the first stage's copy (corrected by the next step's delta) and gradient rows
            with error feedback, through any stateless codec (not `aqsgd`; `feedback` is not used).
            Applies to `prepare()` and `simulate()`; no effect without a tie across stages.
        boundaries: per-boundary overrides of `forward` / `backward`: a list of num_stages - 1
            entries (boundary b joins stage b and b + 1), each None (the plan's own) or a dict
            with `"forward"` and/or `"backward"`, e.g. `[None, {"forward": Compression("quantize",
            bits=4)}]` to compress only the second boundary's activations harder (a slow link
            there). `Plan.auto` fills it from measurements. Read them with `forward_at(b)` /
            `backward_at(b)`.
        autotune: set by `Plan.auto(...)`: the pipeline measures each link and the compute at
            its first step and fills `boundaries` (`AutoConfig`).
    """

    num_stages: int = 2
    split_points: list[int] | None = None
    micro_batches: int | None = None
    schedule: str = "1f1b"
    forward: Compression = field(default_factory=Compression)
    backward: Compression = field(default_factory=Compression)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data_parallel: int = 1
    dp_compression: str | dict[str, Any] = "allreduce"
    tie_compression: Compression | None = None
    boundaries: list[dict[str, Compression] | None] | None = None
    autotune: AutoConfig | None = None

    @classmethod
    def auto(cls, num_stages: int = 2, micro_batches: int | None = None, *, quality: str = "safe",
             aqsgd: bool = False, adapt_every: int | None = None, tolerance: float = 0.05, probe_repeats: int = 2,
             **plan_kwargs: Any) -> Plan:
        """A plan whose boundary codecs the pipeline picks itself: at the first training step it
        measures each boundary's bandwidth and round trip in each direction (probe transfers over
        the real process group, counted under `probe`) and each stage's compute per micro-batch,
        then, per boundary and direction, picks the least compression that keeps the step within
        `tolerance` of the fastest the ladder allows (once a transfer hides behind compute, more
        compression buys no speed), among the settings `quality` allows (`AutoConfig`; the rule
        and the measured settings are in docs/auto.md). Rank 0 decides, every rank applies
        it; the decision goes to the logs, `stats()["auto"]`, the saved plan and the card.

            plan = Plan.auto(num_stages=2, micro_batches=4, quality="safe")

        Other keywords are `Plan`'s (`schedule`, `memory`, `data_parallel`, `tie_compression`, ...);
        `forward`, `backward` and `boundaries` are what it chooses, so they are refused.
        """
        chosen = sorted(k for k in ("forward", "backward", "boundaries") if k in plan_kwargs)
        if chosen:
            raise ValueError(f"Plan.auto chooses {', '.join(chosen)} itself; drop them, or build Plan(...) by hand.")
        config = AutoConfig(quality=quality, aqsgd=aqsgd, adapt_every=adapt_every, tolerance=tolerance,
                            probe_repeats=probe_repeats)
        return cls(num_stages=num_stages, micro_batches=micro_batches, autotune=config, **plan_kwargs)

    def __post_init__(self) -> None:
        if isinstance(self.forward, dict):
            self.forward = Compression(**self.forward)
        if isinstance(self.backward, dict):
            self.backward = Compression(**self.backward)
        if isinstance(self.memory, dict):
            self.memory = MemoryConfig(**self.memory)
        if isinstance(self.tie_compression, dict):
            self.tie_compression = Compression(**self.tie_compression)
        if isinstance(self.autotune, dict):
            self.autotune = AutoConfig(**self.autotune)
        if self.autotune is not None and not isinstance(self.autotune, AutoConfig):
            raise TypeError(f"Plan.autotune must be an AutoConfig (use Plan.auto(...)), got {type(self.autotune).__name__}.")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"Plan.num_stages={self.num_stages!r} must be an integer >= 1.")
        if self.micro_batches is None:
            self.micro_batches = self.num_stages
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"Plan.micro_batches={self.micro_batches!r} must be an integer >= 1.")
        check_choice("Plan", "schedule", self.schedule, SCHEDULES)
        if self.schedule in ("1f1b", "zbh1") and self.num_stages > 1 and self.micro_batches < self.num_stages:
            raise ValueError(
                f"Plan.schedule={self.schedule!r} needs micro_batches >= num_stages, got "
                f"micro_batches={self.micro_batches} < num_stages={self.num_stages}. "
                "Raise micro_batches or use schedule='gpipe'."
            )
        self.split_points = check_split_points(self.split_points, self.num_stages)
        if not isinstance(self.data_parallel, int) or self.data_parallel < 1:
            raise ValueError(f"Plan.data_parallel={self.data_parallel!r} must be an integer >= 1.")
        self.dp_compression = check_dp_compression(self.dp_compression, self.data_parallel)
        self.boundaries = check_boundaries(self.boundaries, self.num_stages)
        for b, backward in enumerate(self.backward_at(b) for b in range(max(self.num_stages - 1, 1))):
            if backward.method == "aqsgd":
                where = "Plan.backward" if backward is self.backward else f"Plan.boundaries[{b}]['backward']"
                raise ValueError(
                    f"{where}.method='aqsgd' is not supported: AQ-SGD compresses activations; "
                    "gradients are quantized directly. Use method='quantize' for backward."
                )
        _check_tie_compression(self.tie_compression)
        self._warn_if_measured_to_break_in_training()

    def _warn_if_measured_to_break_in_training(self) -> None:
        """`hadamard_vq` (under one bit a value), AQ-SGD's reused revisits (`refresh_every`) and its
        drift deltas (`deltas="drift"`) held on one boundary of SmolLM2 and broke on three: warn when a
        plan uses them across more than one."""
        boundaries = range(max(self.num_stages - 1, 1))
        codecs = {c.codec_name for b in boundaries for c in (self.forward_at(b), self.backward_at(b))}
        lazy = sum(self.forward_at(b).refresh_every > 1 for b in boundaries)
        if lazy > 1:
            warnings.warn(
                f"AQ-SGD refresh_every > 1 on {lazy} boundaries: on SmolLM2-135M with 4 stages (3 boundaries) the epoch "
                "that reuses the memory was measured to learn nothing (+2.5% eval loss in continued training; at 2 "
                "stages -0.55%: docs/real_model.md). Use it on one boundary, or refresh_every=1 across several.",
                UserWarning, stacklevel=4)
        drift = sum(self.forward_at(b).deltas == "drift" for b in boundaries)
        if drift > 1:
            warnings.warn(
                f"AQ-SGD deltas='drift' on {drift} boundaries: on SmolLM2-135M with 4 stages (3 boundaries) the first "
                "visits' errors, never corrected, were measured to cost +2.8% eval loss in continued training (at 2 "
                "stages -0.37%: docs/real_model.md). Use it on one boundary, or deltas='memory' across several.",
                UserWarning, stacklevel=4)
        if "hadamard_vq" in codecs and self.num_stages > 2:
            warnings.warn(
                f"hadamard_vq at {self.num_stages} stages: on SmolLM2-135M with 4 stages (3 boundaries) it was measured "
                "to cost +2.3% eval loss in continued training and +20% in instruction tuning (at 2 stages within 1%: "
                "docs/real_model.md). Use it on one boundary, or a codec of more bits a value (hadamard_codebook, "
                "hadamard_outliers) across several.", UserWarning, stacklevel=4)

    # ----------------------------------------------------------------------------- boundaries
    def forward_at(self, boundary: int) -> Compression:
        """The compression of boundary `boundary`'s activations (its override, else `forward`)."""
        return self._at(boundary, "forward")

    def backward_at(self, boundary: int) -> Compression:
        """The compression of boundary `boundary`'s activation gradients (its override, else `backward`)."""
        return self._at(boundary, "backward")

    def _at(self, boundary: int, direction: str) -> Compression:
        override = self.boundaries[boundary] if self.boundaries is not None else None
        return (override or {}).get(direction) or getattr(self, direction)

    @property
    def per_boundary(self) -> bool:
        """Whether some boundary has a codec of its own."""
        return any(self.boundaries or [])

    @property
    def uses_aqsgd(self) -> bool:
        """Whether some boundary's activations go through AQ-SGD (training batches then need
        `sample_id`, and the memory its size)."""
        if self.autotune is not None and self.autotune.aqsgd:
            return True
        return any(self.forward_at(b).method == "aqsgd" for b in range(max(self.num_stages - 1, 1)))

    def check_memory(self) -> None:
        """Fail before training when AQ-SGD's memory size is unknown (`ActCompTrainer` fills it
        from the training set; `simulate` and `prepare` need it set)."""
        if self.uses_aqsgd and self.memory.num_samples is None:
            raise ValueError(
                "Plan.forward.method='aqsgd' needs memory.num_samples (len(train_dataset)): AQ-SGD keeps one "
                "activation per training sample. Set MemoryConfig(num_samples=len(train_dataset)), or train "
                "with hf_actcomp.ActCompTrainer, which fills it from train_dataset."
            )

    # ----------------------------------------------------------------------------- stages
    def stage_ranges(self, num_blocks: int, block_costs: list[int] | None = None,
                     first_cost: int = 0, last_cost: int = 0) -> list[range]:
        """Block ranges of each stage for a model with `num_blocks` blocks.

        Uses `split_points` when given, else balances `block_costs` (e.g. parameter counts)
        with the embedding cost on the first stage and the head cost on the last.
        """
        return block_ranges(self.num_stages, self.split_points, num_blocks, block_costs, first_cost, last_cost)

    # ----------------------------------------------------------------------------- data parallel
    @property
    def world_size(self) -> int:
        """Processes this plan needs: num_stages x data_parallel."""
        return self.num_stages * self.data_parallel

    def dp_hook(self) -> tuple[str, dict[str, Any]]:
        """(hook name, hook parameters) of `dp_compression`."""
        if isinstance(self.dp_compression, dict):
            params = dict(self.dp_compression)
            return params.pop("method"), params
        return self.dp_compression, {}

    @property
    def diloco(self) -> DiLoCoConfig | None:
        """The DiLoCo settings when `dp_compression` is `diloco`, else None."""
        name, params = self.dp_hook()
        return DiLoCoConfig.from_params(params, self.data_parallel) if name == DILOCO else None

    # ----------------------------------------------------------------------------- serialisation
    @classmethod
    def _read_fields(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`from_dict`'s nested configs: their dicts become dataclasses, unknown keys dropped."""
        for key, sub in (("forward", Compression), ("backward", Compression), ("memory", MemoryConfig),
                         ("tie_compression", Compression), ("autotune", AutoConfig)):
            if isinstance(kwargs.get(key), dict):
                kwargs[key] = sub(**known_fields(sub, kwargs[key], f"Plan.{key}"))
        if isinstance(kwargs.get("boundaries"), list):
            kwargs["boundaries"] = [
                None if entry is None else
                {d: Compression(**known_fields(Compression, c, f"Plan.boundaries[{b}].{d}")) if isinstance(c, dict)
                 else c for d, c in entry.items()}
                for b, entry in enumerate(kwargs["boundaries"])]
        return kwargs


def _check_tie_compression(value: Any) -> None:
    """`Plan.tie_compression`: None or a stateless `Compression` (the tie keeps its own delta and
    error-feedback state)."""
    if value is None:
        return
    if not isinstance(value, Compression):
        raise ValueError(f"Plan.tie_compression={value!r} must be None, a Compression or a dict.")
    if value.method == AQSGD:
        raise ValueError(
            "Plan.tie_compression.method='aqsgd' is not valid: the tie sends rows as deltas against its own "
            "mirror of the first stage's copy, through a stateless codec. "
            f"Allowed values: {', '.join(available_codecs())}."
        )
    if value.feedback == "ef21":
        raise ValueError(
            "Plan.tie_compression.feedback='ef21' is not valid: gradient rows always use error feedback and rows "
            "go as deltas, whatever feedback says. Allowed values: none, ef."
        )
