"""Identity and half-precision casts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Codec, as_bytes, from_bytes, numel

FP16_MAX = 65504.0


class NoneCodec(Codec):
    """The raw bytes of the tensor: exact, and the baseline every ratio is measured against."""

    name = "none"

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return numel(shape) * dtype.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return as_bytes(x)

    def decode(self, payload, shape, dtype):
        return from_bytes(payload, dtype, numel(shape)).reshape(tuple(shape)).clone()


class _HalfCodec(Codec):
    half: torch.dtype

    def payload_nbytes(self, shape, dtype):
        return numel(shape) * 2

    def _to_half(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.half)

    def encode(self, x):
        return as_bytes(self._to_half(x))

    def decode(self, payload, shape, dtype):
        return from_bytes(payload, self.half, numel(shape)).reshape(tuple(shape)).to(dtype)


class Fp16Codec(_HalfCodec):
    """IEEE half precision; values beyond +-65504 are clamped rather than sent as inf."""

    name = "fp16"
    hub_tag = "fp16-activations"
    half = torch.float16

    def _to_half(self, x):
        return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


class Bf16Codec(_HalfCodec):
    """bfloat16: fp32's range with 8 bits of mantissa."""

    name = "bf16"
    hub_tag = "bf16-activations"
    half = torch.bfloat16
