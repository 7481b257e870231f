"""A codec of a user's own, for tests/test_codec_registry.py and its worker processes.

Defined here and not registered on import: each test (and each worker) registers it the way a
user's script would, with `hf_actcomp.register_codec`, and the tests remove it afterwards so that
the other test files see the built-in registry.
"""

from __future__ import annotations

import torch

from hf_actcomp.codecs import Codec, Param
from hf_actcomp.codecs.base import as_bytes, from_bytes, numel
from hf_actcomp.codecs.packing import pack_bits, packed_nbytes, unpack_bits


class AbsMaxCodec(Codec):
    """One fp32 max-abs scale s per tensor, then signed codes round(x / s * M), M = 2**(bits-1) - 1,
    stored as code + M in [0, 2M] and packed at `bits` bits. Zero is a level; one bit would leave
    nothing else, so `bits` is 2..8 (the built-in codecs allow 1..8)."""

    name = "absmax"
    hub_tag = "absmax-quantization"
    params = {"bits": Param(required=True, integer=True, low=2, high=8)}

    def __init__(self, bits: int) -> None:
        self.bits = self.check_params(bits=bits)["bits"]
        self.levels = (1 << (bits - 1)) - 1

    def payload_nbytes(self, shape, dtype):
        return 4 + packed_nbytes(numel(shape), self.bits)

    def encode(self, x):
        flat = x.detach().reshape(-1).float()
        scale = flat.abs().amax().reshape(1) if flat.numel() else flat.new_zeros(1)
        ratio = torch.where(scale > 0, flat / scale, torch.zeros_like(flat))
        codes = torch.round(ratio * self.levels).add_(self.levels).to(torch.uint8)
        return torch.cat([as_bytes(scale), pack_bits(codes, self.bits)])

    def decode(self, payload, shape, dtype):
        scale = from_bytes(payload, torch.float32, 1)
        codes = unpack_bits(payload[4:], self.bits, numel(shape))
        values = (codes.float() - self.levels) * (scale / self.levels)
        return values.reshape(tuple(shape)).to(dtype)
