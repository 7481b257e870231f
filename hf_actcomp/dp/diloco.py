"""DiLoCo's compressed pseudo-gradient: the part of the outer step that is ours.

DiLoCo (Douillard et al., 2023): each replica trains alone with its own inner optimizer for
`sync_every` steps. Then each stage's replicas average their pseudo-gradient (the weights at the
last sync minus the weights now), apply an outer SGD / Nesterov step to the synced weights, and
all continue from the result. Between syncs no byte crosses between replicas.

torchft runs the rest (quorum, the outer step, restoring a failed sync, healing a restarted
replica): `hf_actcomp.dp.outer`. The settings are `hf_actcomp.plan.DiLoCoConfig`. This module holds what torchft cannot host without a GPU: its
own pseudo-gradient quantization needs triton and sends fp32 without it, so the pseudo-gradient
goes through a codec of our registry with error feedback instead.
"""

from __future__ import annotations

import math

import torch

from ..codecs import make_codec

ROW = 128  # the pseudo-gradient is encoded as rows of this many elements (a power of 2, for `hadamard`)


def rows_shape(numel: int) -> tuple[int, int]:
    """The shape a flat pseudo-gradient of `numel` elements is encoded in (padded to whole rows)."""
    return (math.ceil(numel / ROW), ROW)


def payload_nbytes(compression, numel: int) -> int:
    """Exact bytes of one replica's payload for `numel` elements (no tensor is allocated)."""
    return make_codec(compression.codec_name, **compression.codec_params()).payload_nbytes(rows_shape(numel),
                                                                                          torch.float32)


class PseudoGradientCodec:
    """One replica's pseudo-gradient through a registered codec, with error feedback.

    The flat pseudo-gradient (fp32) is padded to rows of `ROW` elements; what a payload misses
    is kept (`error`) and added to the next sync's pseudo-gradient, so that nothing is lost
    over the run (with `error_decay` < 1, SparseLoCo's buffer: multiplied by it first). Every
    replica decodes every payload in the same order, so all of them get the same average, bit
    for bit.
    """

    def __init__(self, compression, numel: int, device: torch.device, error_decay: float = 1.0) -> None:
        self.compression = compression
        self.error_decay = error_decay
        self.codec = make_codec(compression.codec_name, **compression.codec_params())
        self.numel = numel
        self.shape = rows_shape(numel)
        self.error = torch.zeros(numel, dtype=torch.float32, device=device)

    @property
    def payload_nbytes(self) -> int:
        """Exact bytes of one replica's payload."""
        return self.codec.payload_nbytes(self.shape, torch.float32)

    def _rows(self, flat: torch.Tensor) -> torch.Tensor:
        pad = self.shape[0] * ROW - self.numel
        return torch.nn.functional.pad(flat, (0, pad)).view(self.shape)

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """The payload of C(flat + error_decay * error); `error` keeps what it missed."""
        target = flat.float() + (self.error if self.error_decay == 1 else self.error_decay * self.error)
        payload = self.codec.encode(self._rows(target))
        self.error = target - self.decode(payload)
        return payload

    def encode_nothing(self) -> torch.Tensor:
        """A payload of zeros (a replica that heals this sync contributes nothing); error kept."""
        return self.codec.encode(torch.zeros(self.shape, dtype=torch.float32, device=self.error.device))

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(payload, self.shape, torch.float32).reshape(-1)[: self.numel]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"error": self.error, **{f"codec.{k}": torch.tensor(v) for k, v in self.codec.state_dict().items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["error"].shape != self.error.shape:
            raise ValueError(f"The saved pseudo-gradient error buffer has {state['error'].numel()} elements; this "
                             f"stage's trainable parameters have {self.numel}: a checkpoint of another model or split.")
        self.error.copy_(state["error"])
        self.codec.load_state_dict({k[len("codec."):]: int(v) for k, v in state.items() if k.startswith("codec.")})
