"""What a boundary sends at inference (evaluation, `compressed_inference`, split `generate`).

Training and inference need different codecs. AQ-SGD has no memory for an unseen input, and a
real pretrained LLM's activations break low-bit codecs that train well: on SmolLM2-135M
(docs/real_model.md) quantize-4 costs +309% eval loss across 3 boundaries and AQ-SGD fw2's inner
codec (quantize-2) +359% across one. So `Compression.inference` defaults to `"auto"`: the training
codec itself where it was measured to hold within 1% at 2, 4 and 8 stages, else `auto_inference()`
(Hadamard with the sink token and outlier channels sent apart, 6 bits). `"direct"` (the
training codec, for AQ-SGD its inner codec), `"none"` or a stateless `Compression` choose
explicitly; an explicit choice measured to break warns once.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from .compression import AQSGD, Compression

LOSSLESS_ENOUGH = ("none", "fp16", "bf16")
MEASURED = "docs/real_model.md (SmolLM2-135M, eval loss against the plain model at 2, 4 and 8 stages)"


def auto_inference() -> Compression:
    """The default inference codec where the training codec does not hold."""
    return Compression("hadamard_outliers", bits=6)


def holds_at_inference(compression: Compression) -> bool | None:
    """Whether this stateless setting held within 1% on the real model at 2, 4 and 8 stages
    (None: a codec we did not measure, such as one registered by a user)."""
    method, bits = compression.method, compression.bits
    if method in LOSSLESS_ENOUGH:
        return True
    if method == "hadamard":
        return bits >= 8
    if method == "quantize":  # 8 bits, group 128: +0.64% / +0.93% / +1.22% at 2 / 4 / 8 stages
        return False
    if method == "hadamard_outliers":
        return bits >= 6
    if method == "hadamard_codebook":  # holds at 4 stages (11 levels: +0.59%), not at 8 (+1.2-2.8%)
        return False
    if method in ("topk", "randk", "topk_quantize", "hadamard_vq"):  # hadamard_vq: under one bit a value
        return False
    if method == "lowrank":  # for the weights' drift (AQ-SGD deltas), not an activation's content
        return False
    return None


def resolve_inference(compression: Compression) -> Compression:
    """The stateless `Compression` this direction uses at inference (see the module docstring)."""
    choice = compression.inference
    if choice == "none":
        return Compression()
    if isinstance(choice, Compression):
        _warn_if_measured_to_break(choice, "Compression.inference")
        return choice
    own = _stateless_form(compression)
    if choice == "direct":
        _warn_if_measured_to_break(own, "Compression.inference='direct'" + (" (AQ-SGD's inner codec)"
                                                                            if compression.method == AQSGD else ""))
        return own
    return own if holds_at_inference(own) is not False else auto_inference()


def _stateless_form(compression: Compression) -> Compression:
    """The training codec without AQ-SGD's memory or error feedback."""
    method = compression.inner if compression.method == AQSGD else compression.method
    return replace(compression, method=method, feedback="none", first_visit="full", inference="direct",
                   refresh_every=1, deltas="memory")


def _warn_if_measured_to_break(compression: Compression, what: str) -> None:
    if holds_at_inference(compression) is False:
        warnings.warn(
            f"{what} = {compression.describe()} was measured to cost more than 1% eval loss at inference on a real "
            f"pretrained LLM ({MEASURED}); evaluation, compressed_inference and split generate through it may "
            f"produce noise. inference='auto' picks {auto_inference().describe()} there.",
            UserWarning, stacklevel=4,
        )
