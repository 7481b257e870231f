"""Configuration dataclasses: what to compress at each stage boundary and how to split the model.

`Plan` is the one object a user writes (in Python, JSON or YAML); everything else in the package
is built from it. Every field is validated in `__post_init__` so a bad value fails before any
model is touched, with a message naming the value and the allowed ones. Codec names and their
fields are checked against the codec registry (`hf_actcomp.codecs`), data-parallel hooks against
the hook registry (`hf_actcomp.dp`): a codec or hook registered there is accepted here as is.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import yaml

from .codecs import CODECS, available_codecs

logger = logging.getLogger(__name__)

CONFIG_NAME = "actcomp_config.json"
FORMAT_VERSION = 1

# `aqsgd` is a method, not a codec: it wraps one of these (`inner`) with a per-sample memory. Every
# other method is a registered codec, and only those are stateless enough for a warm-up
# (`first_visit`) or the tied-embedding rows (`Plan.tie_compression`).
AQSGD = "aqsgd"
FEEDBACK_KINDS = ("none", "ef", "ef21")
AQSGD_INNER = ("quantize", "topk")
FIRST_VISIT = ("full", "direct")
INFERENCE_FALLBACK = ("direct", "none")
SCHEDULES = ("gpipe", "1f1b")
MEMORY_STORES = ("device", "host", "mmap")
MEMORY_DTYPES = ("fp32", "fp16", "bf16", "int8")


def _check_choice(owner: str, name: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name}={value!r} is not valid. Allowed values: {', '.join(map(str, allowed))}.")


def _registered_choices(key: str) -> list[Any]:
    """Every value a registered codec accepts for the choice field `key`, in declaration order
    (empty when no codec declares `key` as a choice)."""
    allowed: list[Any] = []
    for codec in CODECS.values():
        param = codec.params.get(key)
        allowed += [c for c in (param.choices if param is not None else ()) if c not in allowed]
    return allowed


def compression_methods() -> list[str]:
    """What `Compression(method=...)` accepts: `aqsgd` and every registered codec, sorted."""
    return sorted((AQSGD, *CODECS))


@dataclass
class Compression:
    """How one direction (forward activations or backward gradients) of every boundary is compressed.

    Args:
        method: codec name (`none`, `fp16`, `bf16`, `quantize`, `topk`, `randk`, `hadamard`, or one
            registered with `hf_actcomp.register_codec`) or `aqsgd` (delta against a per-sample
            memory, forward direction only). `hadamard`
            rotates each token by a random-sign Hadamard matrix before tile-wise quantization with
            per-tile widths: stateless, for data sets too large for AQ-SGD's memory.
        bits: bit width 1..8 for `quantize`, `hadamard` (average) and for `aqsgd` with `inner="quantize"`.
            Each codec declares the fields it takes and their checks (`Codec.params`); the fields
            a codec does not take are ignored, except that a choice field must hold a value some
            registered codec accepts.
        ratio: fraction of elements kept, in (0, 1], for `topk`, `randk` and `aqsgd` with `inner="topk"`.
        granularity: `group` (one scale per `group_size` elements) or `channel` (one scale per
            hidden channel, as in the AQ-SGD reference code).
        group_size: elements per scale when `granularity="group"` (`hadamard`: per tile).
        rounding: `deterministic` or `stochastic` (unbiased) rounding for quantization.
        value_dtype: dtype of the values a sparsifier sends.
        feedback: `none`, `ef` (error feedback) or `ef21`; not combinable with `aqsgd`.
        inner: the codec AQ-SGD applies to deltas: `quantize` or `topk`.
        first_visit: what AQ-SGD sends the first time a sample is seen: `full` (uncompressed, as
            the reference code's warm-up epoch), `direct` (the inner codec on the activation), or a
            stateless `Compression` (a compressed warm-up, e.g. `Compression("hadamard", bits=4)`:
            its decoded value becomes the sample's memory entry, which later deltas correct). A
            dict (from JSON or YAML) is read as a `Compression`.
        inference: what `aqsgd` becomes at inference, where there is no memory: `direct` (the
            inner codec on the activation) or `none`.
        seed: seed of stochastic rounding and random-k index streams (shared by both sides).
    """

    method: str = "none"
    bits: int | None = None
    ratio: float | None = None
    granularity: str = "group"
    group_size: int = 128
    rounding: str = "deterministic"
    value_dtype: str = "fp16"
    feedback: str = "none"
    inner: str = "quantize"
    first_visit: str | Compression = "full"
    inference: str = "direct"
    seed: int = 0

    def __post_init__(self) -> None:
        owner = "Compression"
        if self.method not in compression_methods():
            raise ValueError(
                f"Compression.method={self.method!r} is not valid. Allowed values: {', '.join(compression_methods())}. "
                "A codec of your own must be registered (hf_actcomp.register_codec) in every process before "
                "the plan is built or read."
            )
        _check_choice(owner, "feedback", self.feedback, FEEDBACK_KINDS)
        _check_choice(owner, "inner", self.inner, AQSGD_INNER)
        self.first_visit = _check_first_visit(self.first_visit)
        _check_choice(owner, "inference", self.inference, INFERENCE_FALLBACK)
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"Compression.group_size={self.group_size!r} must be a positive integer.")
        self._check_codec_fields()
        if self.method == AQSGD and self.feedback != "none":
            raise ValueError(
                f"Compression.feedback={self.feedback!r} cannot be combined with method='aqsgd' "
                "(AQ-SGD already compensates through its delta memory). Use feedback='none'."
            )

    def _check_codec_fields(self) -> None:
        """The fields the codec takes, by the codec's own checks (`Codec.params`). A choice field it
        ignores must still hold a value some registered codec accepts: a typo in a saved plan fails
        now, not the day the plan switches codec."""
        codec = CODECS[self.codec_name]
        names = [f.name for f in fields(self)]
        for key, param in codec.params.items():
            if key not in names:
                raise ValueError(f"Codec {codec.name!r} declares the field {key!r}, which Compression does not have "
                                 f"(fields: {', '.join(sorted(names))}).")
            value = getattr(self, key)
            if value is None and param.required:
                raise ValueError(f"Compression(method={self.method!r}) needs {key} (allowed: {param.allowed()}).")
            if value is not None:
                setattr(self, key, param.check(f"Compression.{key}", value))
        for key in (name for name in names if name not in codec.params):
            allowed = _registered_choices(key)
            if allowed:
                _check_choice("Compression", key, getattr(self, key), allowed)

    @property
    def codec_name(self) -> str:
        """The codec that actually encodes tensors (for `aqsgd`, its inner codec)."""
        return self.inner if self.method == AQSGD else self.method

    def codec_params(self) -> dict[str, Any]:
        """Constructor arguments of the codec named by `codec_name`: the fields it declares in
        `Codec.params` that are set."""
        return {key: getattr(self, key) for key in CODECS[self.codec_name].params if getattr(self, key) is not None}

    def describe(self) -> str:
        """Short label such as `aqsgd-quantize4`, `topk0.1+ef` or, with a compressed warm-up,
        `aqsgd-quantize2 (warm-up hadamard4)`, for tables and logs (the codec's `label`)."""
        label = CODECS[self.codec_name].label(self.codec_params())
        if self.method == AQSGD:
            label = f"aqsgd-{label}"
            if isinstance(self.first_visit, Compression):
                label += f" (warm-up {self.first_visit.describe()})"
        if self.feedback != "none":
            label += f"+{self.feedback}"
        return label


def _check_first_visit(value: Any) -> str | Compression:
    """`Compression.first_visit`: `full`, `direct`, or a stateless `Compression` (a dict is read
    as one, warning about keys a newer version may have added)."""
    owner = "Compression.first_visit"
    if isinstance(value, dict):
        try:
            value = Compression(**_known_fields(Compression, value, owner))
        except ValueError as err:
            raise ValueError(f"{owner}: {err}") from err
    if isinstance(value, Compression):
        if value.method == AQSGD:
            raise ValueError(
                f"{owner}.method={value.method!r} is not valid: the warm-up codec must be stateless. "
                f"Allowed values: {', '.join(available_codecs())}."
            )
        if value.feedback != "none":
            raise ValueError(
                f"{owner}.feedback={value.feedback!r} is not valid: the warm-up codec must be stateless. "
                "Allowed values: none."
            )
        return value
    if isinstance(value, str) and value in FIRST_VISIT:
        return value
    raise ValueError(
        f"{owner}={value!r} is not valid. Allowed values: {', '.join(FIRST_VISIT)}, or a stateless "
        f"Compression (method: {', '.join(available_codecs())}; feedback: none)."
    )


@dataclass
class MemoryConfig:
    """Where AQ-SGD keeps its per-sample activation memory.

    Args:
        store: `device` (a tensor next to the model), `host` (CPU memory, not pinned: rows are
            copied out anyway) or `mmap` (a memory-mapped file, for data sets whose memory does not
            fit in RAM). A device or host store larger than the free memory there is refused
            before it is allocated.
        dtype: storage dtype: `fp32`, `fp16`, `bf16` or `int8` (per-token max-abs quantized).
        num_samples: number of samples in the training set (`len(train_dataset)`); every
            `sample_id` must lie in `[0, num_samples)`. Required for `aqsgd` before training
            (`ActCompTrainer` fills it from the training set).
        path: directory of the memory-mapped files (`store="mmap"`); a temporary directory if None.
    """

    store: str = "host"
    dtype: str = "fp16"
    num_samples: int | None = None
    path: str | None = None

    def __post_init__(self) -> None:
        _check_choice("MemoryConfig", "store", self.store, MEMORY_STORES)
        _check_choice("MemoryConfig", "dtype", self.dtype, MEMORY_DTYPES)
        if self.num_samples is not None and (
            not isinstance(self.num_samples, int) or self.num_samples < 1
        ):
            raise ValueError(f"MemoryConfig.num_samples={self.num_samples!r} must be a positive integer.")


def _stateless_compression(value: Any, owner: str) -> Compression:
    """A stateless `Compression` (or its dict) for a part that keeps its own error feedback."""
    if isinstance(value, dict):
        try:
            value = Compression(**_known_fields(Compression, value, owner))
        except ValueError as err:
            raise ValueError(f"{owner}: {err}") from err
    if not isinstance(value, Compression):
        raise ValueError(f"{owner}={value!r} must be a Compression, a dict or None.")
    if value.method == AQSGD or value.feedback != "none":
        raise ValueError(
            f"{owner}={value.describe()!r} is not valid: it needs a stateless codec (error feedback is always on "
            f"there). Allowed methods: {', '.join(available_codecs())}; feedback: none."
        )
    return value


DILOCO = "diloco"
REPLICA_ENV = "REPLICA_GROUP_ID"  # torchft's name: this launch's replica, when each replica is launched alone


def launched_per_replica(plan: Plan) -> bool:
    """A DiLoCo plan whose replicas are launched one at a time (`REPLICA_GROUP_ID` set)."""
    return plan.diloco is not None and REPLICA_ENV in os.environ


@dataclass(frozen=True)
class DiLoCoConfig:
    """`Plan(dp_compression={"method": "diloco", ...})`.

    Args:
        sync_every: inner steps (optimizer steps) between outer steps (H).
        outer_lr: learning rate of the outer SGD step.
        outer_momentum: momentum of the outer step (0: none).
        nesterov: Nesterov momentum (needs outer_momentum > 0).
        compression: codec of the pseudo-gradient, with error feedback: a stateless
            `Compression` or its dict, e.g. `{"method": "quantize", "bits": 8}` or
            `{"method": "hadamard", "bits": 4}`. None: fp32, exact.
        stagger: offset stage s's syncs by s * sync_every / num_stages steps, so that the stages'
            bursts do not share the link at the same moment.
        min_replicas: replicas an outer step needs; with fewer than `data_parallel`, the others
            go on when one is lost. None: all of them.
    """

    sync_every: int = 32
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compression: Any = None
    stagger: bool = False
    min_replicas: int | None = None

    @classmethod
    def from_params(cls, params: dict[str, Any], data_parallel: int) -> DiLoCoConfig:
        """Checked settings from `dp_compression` without its `method` key; errors name the key."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"Plan.dp_compression (diloco) does not take {unknown}. "
                             f"Its settings: {', '.join(sorted(known))}.")
        config = cls(**params)
        owner = "Plan.dp_compression (diloco)"
        if not isinstance(config.sync_every, int) or isinstance(config.sync_every, bool) or config.sync_every < 1:
            raise ValueError(f"{owner} sync_every={config.sync_every!r} must be an integer >= 1.")
        if not isinstance(config.outer_lr, int | float) or not config.outer_lr > 0:
            raise ValueError(f"{owner} outer_lr={config.outer_lr!r} must be a number > 0.")
        if not isinstance(config.outer_momentum, int | float) or not 0 <= config.outer_momentum < 1:
            raise ValueError(f"{owner} outer_momentum={config.outer_momentum!r} must be in [0, 1).")
        if not isinstance(config.nesterov, bool):
            raise ValueError(f"{owner} nesterov={config.nesterov!r} must be True or False.")
        if config.nesterov and config.outer_momentum == 0:
            raise ValueError(f"{owner} nesterov=True needs outer_momentum > 0; set nesterov=False for plain SGD.")
        if not isinstance(config.stagger, bool):
            raise ValueError(f"{owner} stagger={config.stagger!r} must be True or False.")
        minimum = config.min_replicas
        if minimum is not None and (not isinstance(minimum, int) or not 1 <= minimum <= data_parallel):
            raise ValueError(f"{owner} min_replicas={minimum!r} must be an integer in 1..data_parallel "
                             f"({data_parallel}), or None for all of them.")
        compression = config.compression
        if compression is not None:
            compression = _stateless_compression(compression, f"{owner} compression")
        return cls(**{**asdict(config), "compression": compression})

    def to_params(self) -> dict[str, Any]:
        """The JSON-ready dict `Plan.dp_compression` holds (with `method`)."""
        params = asdict(self)
        if self.compression is not None:
            params["compression"] = asdict(self.compression)
        return {"method": DILOCO, **params}

    def offset(self, stage: int, num_stages: int) -> int:
        """Inner steps stage `stage` waits before its first sync (0 without `stagger`)."""
        return stage * self.sync_every // num_stages if self.stagger else 0

    def label(self) -> str:
        """Short label for cards and logs, e.g. `diloco-H32-quantize8`."""
        codec = self.compression.describe() if self.compression is not None else "fp32"
        return f"diloco-H{self.sync_every}-{codec}"


AUTO_QUALITY = ("safe", "fast")


@dataclass(frozen=True)
class AutoConfig:
    """`Plan.auto(...)`: the codecs of each boundary direction chosen from measurements.

    Args:
        quality: which measured settings may be picked (docs/quality.md), and at what charge:
            `"safe"` those within 0.3% of uncompressed fine-tuning's eval loss in every seed, the
            ones measured to need more steps to a target loss charged the worst run's extra steps
            (docs/auto.md); `"fast"` those within 1% (median over seeds), charged the median.
        aqsgd: pick AQ-SGD for activations (needs `memory.num_samples` and a `sample_id` in
            every training batch; `ActCompTrainer` fills both); else stateless quantization.
        adapt_every: re-measure every N optimizer steps and switch a boundary's codec when the
            choice changes (None: measure once, at the first step; keeps runs reproducible).
        tolerance: the share of a step's compute that more compression may still save and yet
            not be chosen, over the whole step (each boundary direction and the tie gets an
            equal part; docs/auto.md: the least compression within it of the fastest).
        probe_repeats: transfers and compute runs timed per measurement (the median is kept).
        decision: what was measured and chosen (filled by the pipeline; saved with the plan).
    """

    quality: str = "safe"
    aqsgd: bool = False
    adapt_every: int | None = None
    tolerance: float = 0.05
    probe_repeats: int = 2
    decision: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_choice("Plan.auto", "quality", self.quality, AUTO_QUALITY)
        if not isinstance(self.aqsgd, bool):
            raise ValueError(f"Plan.auto aqsgd={self.aqsgd!r} must be True or False.")
        every = self.adapt_every
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ValueError(f"Plan.auto adapt_every={every!r} must be an integer >= 1 (optimizer steps), or None.")
        if not isinstance(self.tolerance, int | float) or not 0 <= self.tolerance <= 1:
            raise ValueError(f"Plan.auto tolerance={self.tolerance!r} must be a number in [0, 1].")
        if not isinstance(self.probe_repeats, int) or not 1 <= self.probe_repeats <= 100:
            raise ValueError(f"Plan.auto probe_repeats={self.probe_repeats!r} must be an integer in 1..100.")


@dataclass
class Plan:
    """How a model is split into pipeline stages and what crosses each stage boundary.

    Args:
        num_stages: number of pipeline stages (>= 1). Without `split_points` the blocks are
            balanced by parameter count (embeddings count on the first stage, head on the last).
        split_points: explicit first block index of stages 1..S-1 (strictly increasing, > 0).
        micro_batches: micro-batches per step; each is sent across boundaries separately.
            Defaults to `num_stages` (the fewest 1F1B accepts).
        schedule: pipeline schedule for distributed runs: `gpipe` or `1f1b`.
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
            `sync_every` optimizer steps, through torchft (`DiLoCoConfig`, docs/data_parallel.md).
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
        _check_choice("Plan", "schedule", self.schedule, SCHEDULES)
        if self.schedule == "1f1b" and self.num_stages > 1 and self.micro_batches < self.num_stages:
            raise ValueError(
                f"Plan.schedule='1f1b' needs micro_batches >= num_stages, got "
                f"micro_batches={self.micro_batches} < num_stages={self.num_stages}. "
                "Raise micro_batches or use schedule='gpipe'."
            )
        if self.split_points is not None:
            points = list(self.split_points)
            if len(points) != self.num_stages - 1:
                raise ValueError(
                    f"Plan.split_points={points} must have num_stages - 1 = {self.num_stages - 1} entries."
                )
            if any(not isinstance(p, int) for p in points) or any(p <= 0 for p in points):
                raise ValueError(f"Plan.split_points={points} must be positive integers (block indices).")
            if any(b <= a for a, b in zip(points, points[1:], strict=False)):
                raise ValueError(f"Plan.split_points={points} must be strictly increasing.")
            self.split_points = points
        if not isinstance(self.data_parallel, int) or self.data_parallel < 1:
            raise ValueError(f"Plan.data_parallel={self.data_parallel!r} must be an integer >= 1.")
        method = self.dp_compression.get("method") if isinstance(self.dp_compression, dict) else self.dp_compression
        if method == DILOCO:
            if self.data_parallel < 2:
                raise ValueError(f"Plan.dp_compression='diloco' needs data_parallel >= 2 replicas, got "
                                 f"data_parallel={self.data_parallel}.")
            params = {k: v for k, v in self.dp_compression.items() if k != "method"} \
                if isinstance(self.dp_compression, dict) else {}
            self.dp_compression = DiLoCoConfig.from_params(params, self.data_parallel).to_params()
        # The hook registry (hf_actcomp.dp.base imports nothing of the package), imported here: at the
        # top, importing it would first run hf_actcomp.dp, which imports this module via checkpoint.
        from .dp.base import available_hooks

        _check_choice("Plan", "dp_compression", method, [*available_hooks(), DILOCO])
        self.boundaries = _check_boundaries(self.boundaries, self.num_stages)
        for b, backward in enumerate(self.backward_at(b) for b in range(max(self.num_stages - 1, 1))):
            if backward.method == "aqsgd":
                where = "Plan.backward" if backward is self.backward else f"Plan.boundaries[{b}]['backward']"
                raise ValueError(
                    f"{where}.method='aqsgd' is not supported: AQ-SGD compresses activations; "
                    "gradients are quantized directly. Use method='quantize' for backward."
                )
        _check_tie_compression(self.tie_compression)

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
        if self.num_stages > num_blocks:
            raise ValueError(
                f"Plan.num_stages={self.num_stages} is more than the model's {num_blocks} blocks; "
                f"use at most {num_blocks} stages."
            )
        if self.split_points is not None:
            if self.split_points and self.split_points[-1] >= num_blocks:
                raise ValueError(
                    f"Plan.split_points={self.split_points} must all be < the model's {num_blocks} blocks."
                )
            points = self.split_points
        else:
            costs = block_costs if block_costs is not None else [1] * num_blocks
            points = _balanced_split_points(costs, self.num_stages, first_cost, last_cost)
        bounds = [0, *points, num_blocks]
        return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]

    # ----------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        data = dict(data)
        version = data.pop("format_version", FORMAT_VERSION)
        if isinstance(version, int) and version > FORMAT_VERSION:
            logger.warning(
                "actcomp config format_version %s is newer than this hf-actcomp (%s); "
                "unknown fields are ignored.", version, FORMAT_VERSION,
            )
        kwargs = _known_fields(cls, data, "Plan")
        for key, sub in (("forward", Compression), ("backward", Compression), ("memory", MemoryConfig),
                         ("tie_compression", Compression), ("autotune", AutoConfig)):
            if isinstance(kwargs.get(key), dict):
                kwargs[key] = sub(**_known_fields(sub, kwargs[key], f"Plan.{key}"))
        if isinstance(kwargs.get("boundaries"), list):
            kwargs["boundaries"] = [
                None if entry is None else
                {d: Compression(**_known_fields(Compression, c, f"Plan.boundaries[{b}].{d}")) if isinstance(c, dict)
                 else c for d, c in entry.items()}
                for b, entry in enumerate(kwargs["boundaries"])]
        return cls(**kwargs)

    def to_json_string(self) -> str:
        return json.dumps({"format_version": FORMAT_VERSION, **self.to_dict()}, indent=2) + "\n"

    @classmethod
    def from_json_string(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def to_yaml_string(self) -> str:
        return yaml.safe_dump({"format_version": FORMAT_VERSION, **self.to_dict()}, sort_keys=False)

    @classmethod
    def from_yaml_string(cls, text: str) -> Plan:
        return cls.from_dict(yaml.safe_load(text) or {})

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Plan:
        """Read a plan from a `.json`, `.yaml` or `.yml` file."""
        text = open(path, encoding="utf-8").read()
        if str(path).endswith((".yaml", ".yml")):
            return cls.from_yaml_string(text)
        return cls.from_json_string(text)

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Write `actcomp_config.json` into `save_directory` (created if needed); return its path."""
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())
        return path

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **hub_kwargs: Any) -> Plan:
        """Read `actcomp_config.json` from a local directory, or from a Hub model repo
        (`huggingface_hub.hf_hub_download`, which uses the local cache and `HF_HUB_OFFLINE`).
        `hub_kwargs` (revision, token, cache_dir, ...) go to `hf_hub_download`."""
        path = os.path.join(name_or_path, CONFIG_NAME)
        if os.path.isdir(name_or_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"No {CONFIG_NAME} in {name_or_path!s}.")
        else:
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import (
                EntryNotFoundError,
                HFValidationError,
                LocalEntryNotFoundError,
                RepositoryNotFoundError,
            )

            try:
                path = hf_hub_download(os.fspath(name_or_path), CONFIG_NAME, **hub_kwargs)
            except (EntryNotFoundError, HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError) as err:
                raise FileNotFoundError(
                    f"No {CONFIG_NAME} for {name_or_path!s}: not a local directory, and the Hub (or its cache) "
                    f"has no such file ({type(err).__name__})."
                ) from err
        return cls.from_json_string(open(path, encoding="utf-8").read())


def _check_boundaries(value: Any, num_stages: int) -> list[dict[str, Compression] | None] | None:
    """`Plan.boundaries`, checked: None, or num_stages - 1 entries of None or {"forward"/"backward":
    Compression (or its dict)}; all-None lists become None."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != num_stages - 1:
        raise ValueError(f"Plan.boundaries={value!r} must be a list of num_stages - 1 = {num_stages - 1} entries "
                         "(one per boundary: None or a dict with 'forward' and/or 'backward').")
    out: list[dict[str, Compression] | None] = []
    for b, entry in enumerate(value):
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, dict) or not set(entry) <= {"forward", "backward"}:
            raise ValueError(f"Plan.boundaries[{b}]={entry!r} must be None or a dict with the keys 'forward' "
                             "and/or 'backward'.")
        checked = {}
        for direction, compression in entry.items():
            if isinstance(compression, dict):
                compression = Compression(**compression)
            if not isinstance(compression, Compression):
                raise TypeError(f"Plan.boundaries[{b}][{direction!r}] must be a Compression (or its dict), got "
                                f"{type(compression).__name__}.")
            checked[direction] = compression
        out.append(checked or None)
    return out if any(out) else None


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


def _known_fields(cls: type, data: dict[str, Any], owner: str) -> dict[str, Any]:
    """Drop (with a warning) keys a newer version may have added; keep the known ones."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        logger.warning("Ignoring unknown %s fields %s (written by a newer hf-actcomp?).", owner, unknown)
    return {k: v for k, v in data.items() if k in names}


def _balanced_split_points(costs: list[int], num_stages: int, first_cost: int, last_cost: int) -> list[int]:
    """Split points minimising the largest stage cost (each stage gets at least one block).

    A small dynamic programme over (blocks, stages); models have at most a few hundred blocks.
    """
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int, stage: int) -> int:
        extra = (first_cost if stage == 0 else 0) + (last_cost if stage == num_stages - 1 else 0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # best[s][i]: minimal max cost to place blocks [0, i) on stages 0..s-1; arg stores the split.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    arg = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(j, i, s - 1))
                if value < best[s][i]:
                    best[s][i], arg[s][i] = value, j
    points, i = [], n
    for s in range(num_stages, 1, -1):
        i = arg[s][i]
        points.append(i)
    return sorted(points)
