"""Fused codecs: a quantizer's encode and decode under `torch.compile` (`compile=True`).

Eager, a quantizer is a chain of elementwise and reduction kernels (abs, group max, scale, round,
clamp, pack; unpack, scale), each a full pass over the tensor: on an H200 quantize-4 of an
8 x 2048 x 8192 fp32 activation takes 3.0 ms against 0.28 ms for a plain copy. Compiled, inductor
fuses the chain: 0.71 ms (2.6x a copy; bf16 3.8x; docs/gpu.md, codecs_cuda_8x2048x8192_compiled.md).

Only the deterministic `quantize` and `hadamard` codecs are fused whole (`FUSIBLE`), as measured:
`hadamard_outliers` compiled decodes slower than eager in fp32 (86 ms against 1 ms: its channel
scatter), stochastic rounding draws from a generator a graph would not share with eager code, and
the sparsifiers are one `torch.topk` already. Of `hadamard_codebook` only the search for each
tile's scale is compiled (its `best_trials`: 7 trial scales, each a few compares and a sum over
the whole tensor, one fused pass compiled); its sink, channels and scatter stay eager.
Everything else stays eager.

What compiling changes: the payload may differ from eager's in the last rounding step of a few
values (a fused multiply-add rounds once), so a compiled sender and an eager one send different,
equally valid payloads; the decoder of a payload is the same function on both ends of a boundary
(the plan and `compile` are the same in every process), which is what AQ-SGD's mirrored memory and
error feedback need. `dynamic=False`: a codec's sizes and bit width are constants of the graph
(torch 2.11 failed to trace the unpacking's `1 << bits` once it made them symbolic), so each new
boundary shape compiles once more, up to torch's recompile limit, after which that call runs eager.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import Codec

# The codecs `fuse` compiles and which of their methods: the deterministic quantizers measured to
# gain from it on a GPU, and hadamard_codebook's search for its tiles' scales (on this CPU).
FUSIBLE = {"quantize": ("encode", "decode"), "hadamard": ("encode", "decode"),
           "hadamard_codebook": ("_best_trials",)}


def fusible(codec: Codec) -> bool:
    """Whether `fuse` compiles `codec`: a FUSIBLE codec with deterministic rounding."""
    return codec.name in FUSIBLE and getattr(codec, "rounding", "deterministic") == "deterministic"


def fuse(codec: Codec, compile_kwargs: Mapping[str, Any] | None = None) -> Codec:
    """`codec` with its FUSIBLE methods compiled (in place; the same object is returned), if
    `fusible`; any other codec is returned unchanged. `compile_kwargs`: torch.compile's backend and
    mode as the blocks get them (`dynamic` is always False here)."""
    if not fusible(codec) or getattr(codec, "fused", False):
        return codec
    options = {k: v for k, v in (compile_kwargs or {}).items() if k in ("backend", "mode", "options")}
    for method in FUSIBLE[codec.name]:
        setattr(codec, method, torch.compile(getattr(codec, method), dynamic=False, **options))
    codec.fused = True
    return codec
