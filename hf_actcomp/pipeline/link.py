"""The wire format of one boundary direction as one rank sees it: `StageLink`.

A stage has up to four links: activations in from the previous stage and gradients back to it,
activations out to the next stage and gradients in from it. A link owns what a message is
(the codec payload, then the router statistics of MoE models as a float32 side channel), its
size before it arrives, and encode+send / receive+decode, for training (the boundary's stateful
ends: error feedback, AQ-SGD memory) and evaluation (a stateless codec) alike.

Receives are posted ahead (`post`), with their sizes known from shapes and the receiver's own
state; `Transport` decides when they reach the wire (at once on gloo, so a payload travels while
this stage still computes). Each direction has its own tag, so neither waits behind the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..boundary import Boundary, NonFiniteError, check_finite
from ..codecs import Codec
from ..telemetry import TrafficCounter
from .transport import PostedRecv, Transport

# gloo slots of the two directions (the tied-embedding exchange uses the default, 0).
TAGS = {"forward": 1, "backward": 2}
NEXT_TOKENS_TAG = 3  # generation: the chosen ids, from the last stage to every other stage


@contextlib.contextmanager
def naming_the_step(what: str, step: int, stage: int):
    """A non-finite payload's error also names the step and the stage that received it."""
    try:
        yield
    except NonFiniteError as err:
        raise NonFiniteError(f"{what.capitalize()} step {step}, stage {stage}: {err}") from None


class StageLink:
    """One end of one boundary direction (`boundary.name`), joined to rank `peer`.

    Args:
        boundary: the boundary direction, with the end this rank holds (sender or receiver).
        transport: the pipeline's point-to-point transport.
        peer: the global rank at the other end.
        dtype: the dtype of the tensor that crosses (the stages' boundary dtype).
        side_numel: float32 values appended to each message (router statistics), 0 for none.
        side_counter: where the side channel's bytes are counted in training.
    """

    def __init__(self, boundary: Boundary, transport: Transport, peer: int, dtype: torch.dtype, *,
                 side_numel: int = 0, side_counter: TrafficCounter | None = None) -> None:
        self.boundary = boundary
        self.transport = transport
        self.peer = peer
        self.dtype = dtype
        self.side_numel = side_numel
        self.side_counter = side_counter
        self.direction = boundary.name.rsplit(".", 1)[1]
        self.tag = TAGS[self.direction]
        self._posted: dict[int, tuple[PostedRecv, int]] = {}

    @property
    def side_bytes(self) -> int:
        return 4 * self.side_numel

    # ------------------------------------------------------------------ receiving end
    def payload_nbytes(self, shape: Sequence[int], sample_ids: torch.Tensor | None = None,
                       codec: Codec | None = None) -> int:
        """Bytes of the codec payload (without the side channel) of a tensor of `shape`."""
        if codec is not None:
            return codec.payload_nbytes(shape, self.dtype)
        return self.boundary.payload_nbytes(shape, self.dtype, sample_ids)

    def post(self, i: int, shape: Sequence[int], device: torch.device, what: str, *,
             sample_ids: torch.Tensor | None = None, codec: Codec | None = None) -> None:
        """Post the receive of message `i` (micro-batch i) of `shape`; `codec` for evaluation."""
        nbytes = self.payload_nbytes(shape, sample_ids, codec)
        posted = self.transport.post_recv(nbytes + self.side_bytes, self.peer, device, what, tag=self.tag)
        self._posted[i] = (posted, nbytes)

    def receive(self, i: int, shape: Sequence[int], *, sample_ids: torch.Tensor | None = None,
                codec: Codec | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Wait for posted message `i` and decode it: (tensor, side channel or None). Without
        `codec`, through the boundary's receiver (its state updates); with it, statelessly."""
        posted, nbytes = self._posted.pop(i)
        payload = self.transport.wait_recv(posted)
        side = None
        if self.side_numel:
            payload, side = payload[:nbytes], payload[nbytes:].clone().view(torch.float32)
        if codec is not None:
            return check_finite(codec.decode(payload, shape, self.dtype), self.boundary.name, i), side
        return self.boundary.receive(payload, shape, self.dtype, sample_ids=sample_ids, slot=i), side

    # ------------------------------------------------------------------ sending end
    def send(self, i: int, x: torch.Tensor, side: torch.Tensor | None = None, *,
             sample_ids: torch.Tensor | None = None, codec: Codec | None = None,
             counter: TrafficCounter | None = None, with_next_recv: bool = False) -> None:
        """Encode message `i` and send it. Without `codec`, through the boundary's sender (its
        state and counters update); with it (evaluation), statelessly, counted in `counter`."""
        x = x.detach().to(self.dtype).contiguous()
        if codec is None:
            payload = self.boundary.send(x, sample_ids=sample_ids, slot=i)
        else:
            payload = codec.encode(x)
            counter.add(payload.numel(), x.numel() * x.element_size())
        if self.side_numel:
            extra = side.detach().to(torch.float32).contiguous().view(torch.uint8)
            (counter or self.side_counter).add(extra.numel(), extra.numel())
            payload = torch.cat([payload, extra.to(payload.device)])
        self.transport.send(payload, self.peer, tag=self.tag, with_next_recv=with_next_recv)
