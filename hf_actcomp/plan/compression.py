"""`Compression`: how one direction (activations or gradients) of a stage boundary is compressed.

Its own module because more than the plan's boundaries take one: the tied-embedding rows, a
compressed warm-up of AQ-SGD and DiLoCo's pseudo-gradients. Codec names and their fields are
checked against the codec registry (`hf_actcomp.codecs`): a codec registered there is accepted
here as is.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..codecs import CODECS, available_codecs
from .config import check_choice, known_fields

# `aqsgd` is a method, not a codec: it wraps one of these (`inner`) with a per-sample memory. Every
# other method is a registered codec, and only those are stateless enough for a warm-up
# (`first_visit`) or the tied-embedding rows (`Plan.tie_compression`).
AQSGD = "aqsgd"
FEEDBACK_KINDS = ("none", "ef", "ef21")
AQSGD_INNER = ("quantize", "topk", "hadamard", "hadamard_outliers", "hadamard_codebook", "hadamard_vq", "lowrank")
# What AQ-SGD's deltas are taken against: the receiver's memory (the paper's) or the sender's exact one.
DELTA_KINDS = ("memory", "drift")
FIRST_VISIT = ("full", "direct")
# What a direction sends at inference (hf_actcomp/plan/inference_form.py resolves them).
INFERENCE_CHOICES = ("auto", "direct", "none")
INFERENCE_FALLBACK = INFERENCE_CHOICES  # the name earlier versions exported


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
        method: codec name (`none`, `fp16`, `bf16`, `quantize`, `topk`, `randk`, `hadamard`,
            `hadamard_outliers`, `hadamard_codebook`, `hadamard_vq`, `topk_quantize`, or one registered with
            `hf_actcomp.register_codec`) or `aqsgd` (delta
            against a per-sample memory, forward direction only). `hadamard`
            rotates each token by a random-sign Hadamard matrix before tile-wise quantization with
            per-tile widths: stateless, for data sets too large for AQ-SGD's memory.
            `topk_quantize` keeps the top `ratio` of each chunk of `group_size` elements at `bits`
            bits (SparseLoCo's pseudo-gradient codec for DiLoCo).
        bits: bit width 1..8 for `quantize`, `hadamard` (average), `topk_quantize` (per kept value,
            default 2) and for `aqsgd` with `inner="quantize"`.
            Each codec declares the fields it takes and their checks (`Codec.params`); the fields
            a codec does not take are ignored, except that a choice field must hold a value some
            registered codec accepts.
        ratio: fraction of elements kept, in (0, 1], for `topk`, `randk`, `topk_quantize` (per chunk)
            and `aqsgd` with `inner="topk"`.
        granularity: `group` (one scale per `group_size` elements) or `channel` (one scale per
            hidden channel, as in the AQ-SGD reference code).
        group_size: elements per scale when `granularity="group"` (`hadamard`: per tile;
            `topk_quantize`: per chunk).
        rounding: `deterministic` or `stochastic` (unbiased) rounding for quantization.
        value_dtype: dtype of the values a sparsifier sends (`topk_quantize`: of its chunk scales).
        feedback: `none`, `ef` (error feedback) or `ef21`; not combinable with `aqsgd`.
        inner: the codec AQ-SGD applies to deltas: `quantize` (the AQ-SGD paper's), `topk`,
            `hadamard`, `hadamard_outliers`, `hadamard_codebook`, `hadamard_vq` (`levels`) or `lowrank`
            (`rank`, with `deltas="drift"`). On a real LLM's activations (a massive channel on
            the sink and delimiter tokens) use `hadamard_outliers`: quantize's group scale follows
            that channel's delta and its levels swamp the rest (docs/real_model.md).
        first_visit: what AQ-SGD sends the first time a sample is seen: `full` (uncompressed, as
            the reference code's warm-up epoch), `direct` (the inner codec on the activation), or a
            stateless `Compression` (a compressed warm-up, e.g. `Compression("hadamard_outliers",
            bits=4)`, `Plan.auto`'s: it holds on a real LLM's activations): its decoded value
            becomes the sample's memory entry, which later deltas correct. A dict (from JSON or
            YAML) is read as a `Compression`.
        refresh_every: AQ-SGD only: a seen sample's delta crosses on every `refresh_every`-th revisit
            (1, default: every revisit, the paper's); on the others nothing crosses and the receiver
            reuses its memory (stale by what the sender's stage moved since: 0.5-2% of an
            activation an epoch on SmolLM2). Both ends count visits, so every payload's size stays
            known before it arrives. 2 with three epochs: a first visit, a reused one, a delta.
            Measured on SmolLM2 with a ternary first epoch and 0.75-bit deltas (32x over the run):
            -0.55% at 2 stages, +2.47% at 4, where the reused epoch learns nothing
            (docs/real_model.md): suited to one boundary.
        deltas: AQ-SGD only: what a revisit's delta is taken against. `memory` (default, the
            paper's): the receiver's memory, so each delta also corrects what the earlier visits'
            codes got wrong. `drift`: the sender's own exact record of the sample (its first visit
            exactly, plus every decoded delta since), so a delta carries only what the sender's
            stage changed since (the weights' drift, low-rank on SmolLM2: `inner="lowrank"`) and the
            first visit's coding error stays in the receiver's memory for good. The sender keeps a
            second memory of the same size for it. Measured on SmolLM2 with a ternary first epoch
            and rank-4 `lowrank` deltas (34.8x over the run): -0.37% at 2 stages, +2.77% at 4
            (docs/real_model.md): suited to one boundary.
        inference: what this direction sends at inference (evaluation, `compressed_inference`,
            split `generate`), where AQ-SGD has no memory: `auto` (default: the training codec
            where it was measured to hold within 1% on a real LLM, else `hadamard_outliers` at 6
            bits; hf_actcomp/plan/inference_form.py), `direct` (the training codec; for `aqsgd`
            its inner codec), `none`, or a stateless `Compression` (a dict is read as one).
        seed: seed of stochastic rounding and random-k index streams (shared by both sides).
        outliers: channels per token `hadamard_outliers`, `hadamard_codebook` and `hadamard_vq` send
            apart (None: their defaults, 4, 3 and 0).
        levels: the size of `hadamard_codebook`'s Gaussian codebook, odd, 3..15 (11: 3.5 bits a
            value, 8.0x fewer bytes than fp32 on SmolLM2 with every scale and index counted), or of
            `hadamard_vq`'s codebook of 8-value words, 16..256, a power of two (128: 0.875 bits a
            value, under one bit with the scales: more than 32x fewer bytes than fp32).
        rank: the rank `lowrank` keeps, 1..256 (two bf16 factors: 2 * rank * (rows + hidden) bytes,
            rows being every position but the last dimension's).
        sink_and_mean: whether `hadamard_vq` sends each sequence's sink token and the channel
            mean apart (None: yes). False codes them with the rest, 0.2 bits a value fewer on
            SmolLM2, for AQ-SGD's deltas (`inner="hadamard_vq"`), not for activations; measured
            to cost more than it saves across 3 boundaries (docs/real_model.md).
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
    inference: str | Compression = "auto"
    seed: int = 0
    outliers: int | None = None
    levels: int | None = None
    sink_and_mean: bool | None = None
    refresh_every: int = 1
    rank: int | None = None
    deltas: str = "memory"

    def __post_init__(self) -> None:
        owner = "Compression"
        if self.method not in compression_methods():
            raise ValueError(
                f"Compression.method={self.method!r} is not valid. Allowed values: {', '.join(compression_methods())}. "
                "A codec of your own must be registered (hf_actcomp.register_codec) in every process before "
                "the plan is built or read."
            )
        check_choice(owner, "feedback", self.feedback, FEEDBACK_KINDS)
        check_choice(owner, "inner", self.inner, AQSGD_INNER)
        self.first_visit = _check_first_visit(self.first_visit)
        self.inference = _check_inference(self.inference)
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"Compression.group_size={self.group_size!r} must be a positive integer.")
        self._check_codec_fields()
        if not isinstance(self.refresh_every, int) or isinstance(self.refresh_every, bool) or self.refresh_every < 1:
            raise ValueError(f"Compression.refresh_every={self.refresh_every!r} must be a positive integer (1: a delta on "
                             "every revisit).")
        if self.refresh_every != 1 and self.method != AQSGD:
            raise ValueError(f"Compression.refresh_every={self.refresh_every} applies to method='aqsgd' only (its "
                             f"per-sample memory is what a revisit reuses), not to method={self.method!r}. Allowed "
                             "value here: 1.")
        check_choice(owner, "deltas", self.deltas, DELTA_KINDS)
        if self.deltas != "memory" and self.method != AQSGD:
            raise ValueError(f"Compression.deltas={self.deltas!r} applies to method='aqsgd' only (the deltas of its "
                             f"per-sample memory), not to method={self.method!r}. Allowed value here: 'memory'.")
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
            if allowed and getattr(self, key) is not None:  # None: an optional field left unset
                check_choice("Compression", key, getattr(self, key), allowed)

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
        `aqsgd-quantize2 (warm-up hadamard4)` (`... (deltas every 2 revisits) ...` with
        `refresh_every=2`, `... (drift deltas) ...` with `deltas="drift"`), for tables and logs (the codec's `label`)."""
        label = CODECS[self.codec_name].label(self.codec_params())
        if self.method == AQSGD:
            label = f"aqsgd-{label}"
            if self.deltas == "drift":
                label += " (drift deltas)"
            if self.refresh_every != 1:
                label += f" (deltas every {self.refresh_every} revisits)"
            if isinstance(self.first_visit, Compression):
                label += f" (warm-up {self.first_visit.describe()})"
        if self.feedback != "none":
            label += f"+{self.feedback}"
        return label


def _read_compression(value: dict[str, Any], owner: str) -> Compression:
    """A `Compression` from its dict (JSON, YAML), warning about keys a newer version may have
    added; a bad value fails with `owner` in front of the message."""
    try:
        return Compression(**known_fields(Compression, value, owner))
    except ValueError as err:
        raise ValueError(f"{owner}: {err}") from err


def _check_first_visit(value: Any) -> str | Compression:
    """`Compression.first_visit`: `full`, `direct`, or a stateless `Compression` (a dict is read
    as one, warning about keys a newer version may have added)."""
    owner = "Compression.first_visit"
    if isinstance(value, dict):
        value = _read_compression(value, owner)
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


def _check_inference(value: Any) -> str | Compression:
    """`Compression.inference`: `auto`, `direct`, `none`, or a stateless `Compression` (or its dict)."""
    if isinstance(value, str) and value in INFERENCE_CHOICES:
        return value
    if isinstance(value, dict):
        value = _read_compression(value, "Compression.inference")
    if isinstance(value, Compression):
        if value.method == AQSGD or value.feedback != "none":
            raise ValueError(f"Compression.inference={value.describe()!r} is not valid: inference needs a stateless "
                             f"codec. Allowed methods: {', '.join(available_codecs())}; feedback: none.")
        return value
    raise ValueError(
        f"Compression.inference={value!r} is not valid. Allowed values: {', '.join(INFERENCE_CHOICES)}, or a "
        f"stateless Compression (method: {', '.join(available_codecs())}; feedback: none)."
    )


def stateless_compression(value: Any, owner: str) -> Compression:
    """A stateless `Compression` (or its dict) for a part that keeps its own error feedback."""
    if isinstance(value, dict):
        value = _read_compression(value, owner)
    if not isinstance(value, Compression):
        raise ValueError(f"{owner}={value!r} must be a Compression, a dict or None.")
    if value.method == AQSGD or value.feedback != "none":
        raise ValueError(
            f"{owner}={value.describe()!r} is not valid: it needs a stateless codec (error feedback is always on "
            f"there). Allowed methods: {', '.join(available_codecs())}; feedback: none."
        )
    return value
