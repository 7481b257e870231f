"""`lowrank`: a tensor as the best rank-r product of two bf16 factors, for AQ-SGD's drift deltas.

An activation is not low-rank (every token carries its own content), but what an epoch of
fine-tuning changes in it is: the weights move by a small, shared update, so the change of a
micro-batch's boundary activation, tokens x hidden, lies mostly in a few directions. On SmolLM2-135M
(benchmarks/results/real_model_delta_statistics.md) rank 4 of a 2 x 128-token micro-batch holds
74-83% of an epoch's drift at blocks 4 and 15 and 39-43% at block 26 (one run). So this codec is
meant for `Compression("aqsgd", inner="lowrank", deltas="drift")`, where the deltas are the drift
alone (measured in training in docs/real_model.md); at inference it is never used
(`inference="auto"` replaces it).

The tensor is read as a matrix (rows: every position but the last dimension; columns: the last,
the hidden size); its truncated SVD U S V^T gives two factors, U sqrt(S) and sqrt(S) V^T, each
cast to bf16: 2 * rank * (rows + hidden) bytes, 88.6x fewer than fp32 at rank 4 for a 2 x 128 x 576
micro-batch. A matrix of lower rank than `rank` pads with zero factors, so the size follows from
the shape alone. Deterministic and stateless; the decoder only multiplies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Codec, Param, as_bytes, from_bytes, numel

RANK = Param(required=True, integer=True, low=1, high=256)
_FACTOR = torch.bfloat16


def _matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, columns) of the matrix a tensor of `shape` is read as: the last dimension apart."""
    if not shape:
        return 1, 1
    columns = int(shape[-1])
    return (numel(shape) // columns if columns else 0), columns


class LowRankCodec(Codec):
    """The best rank-`rank` approximation (truncated SVD) of a tensor read as rows x last
    dimension, sent as two bf16 factors (see the module docstring).

    Args:
        rank: the rank kept, 1..256 (a 2 x 128-token micro-batch of SmolLM2 at rank 4: 88.6x
            fewer bytes than fp32).
    """

    name = "lowrank"
    params = {"rank": RANK}

    def __init__(self, rank: int) -> None:
        self.rank = self.check_params(rank=rank)["rank"]

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        rows, columns = _matrix_shape(shape)
        return _FACTOR.itemsize * self.rank * (rows + columns)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        rows, columns = _matrix_shape(x.shape)
        left = torch.zeros(rows, self.rank, device=x.device)
        right = torch.zeros(self.rank, columns, device=x.device)
        if rows and columns:
            u, s, vh = torch.linalg.svd(x.detach().reshape(rows, columns).float(), full_matrices=False)
            kept = min(self.rank, s.numel())
            root = s[:kept].sqrt()
            left[:, :kept] = u[:, :kept] * root
            right[:kept] = root.unsqueeze(1) * vh[:kept]
        return torch.cat([as_bytes(left.to(_FACTOR)), as_bytes(right.to(_FACTOR))])

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        rows, columns = _matrix_shape(shape)
        split = _FACTOR.itemsize * rows * self.rank
        left = from_bytes(payload[:split], _FACTOR, rows * self.rank).reshape(rows, self.rank).float()
        right = from_bytes(payload[split:], _FACTOR, self.rank * columns).reshape(self.rank, columns).float()
        return (left @ right).reshape(tuple(shape)).to(dtype)


__all__ = ["LowRankCodec", "RANK"]
