"""One direction of one stage boundary: its sender end, its receiver end, its counters and state.

The same object serves the in-process simulation (both ends in one process, `transfer`) and the
distributed pipeline (one end per rank: `send` on the producing stage, `receive` on the consuming
one). State-dict keys are `sender.*` and `receiver.*`; `prefixed` / `unprefixed` are the one place
that adds and strips a boundary's name in front of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .feedback import build_inference_codec, build_receiver, build_sender
from .plan import Compression, MemoryConfig
from .state.keys import prefixed, unprefixed  # re-exported: existing callers import them here
from .telemetry import ChannelStats


class NonFiniteError(FloatingPointError):
    """A decoded boundary payload holds NaN or inf: the run stops where it arose instead of
    spreading it to every later stage and step (resume from the last checkpoint)."""


def check_finite(x: torch.Tensor, name: str, slot: int) -> torch.Tensor:
    """`x` if every value is finite, else `NonFiniteError` naming the boundary direction and the
    micro-batch. One fp32 sum: a NaN or inf anywhere makes it non-finite, at the cost of one read."""
    if not bool(torch.isfinite(x.sum(dtype=torch.float32))):
        boundary, _, direction = name.partition(".")
        b = int(boundary.removeprefix("boundary"))
        what = (f"activations sent by stage {b} to stage {b + 1}" if direction == "forward"
                else f"activation gradients sent by stage {b + 1} to stage {b}")
        raise NonFiniteError(f"Non-finite values (NaN or inf) in the {what} ({name}), micro-batch {slot}: "
                             "the sending stage diverged (learning rate, loss scale, bad data) or the codec "
                             "cannot represent its range.")
    return x


class Boundary:
    """Boundary direction `name` (e.g. `boundary0.forward`) with the ends this process holds.

    Args:
        name: `boundary{b}.forward` or `boundary{b}.backward` (boundary b joins stage b and b+1).
        compression: the plan's codec for this direction.
        memory: AQ-SGD memory settings (forward direction only).
        sender / receiver: which ends live in this process.
        track_error: let a stateless sender decode its own payload to report relative errors.
        sample_range: AQ-SGD: the sample ids this process keeps memory for (a data-parallel
            replica's shard); default every id in `[0, memory.num_samples)`.
        compiling: torch.compile's options when the stages are compiled (`compile=True`): the
            quantizers' arithmetic is fused too (hf_actcomp/codecs/fused.py); None: eager.
    """

    def __init__(self, name: str, compression: Compression, memory: MemoryConfig | None = None, *,
                 sender: bool = True, receiver: bool = True, track_error: bool = True,
                 sample_range: range | None = None, compiling: dict | None = None) -> None:
        self.name = name
        self.compression = compression
        self.sender = build_sender(compression, memory, name, track_error=track_error,
                                   sample_range=sample_range, compiling=compiling) if sender else None
        self.receiver = (build_receiver(compression, memory, name, sample_range=sample_range, compiling=compiling)
                         if receiver else None)
        # Stateless codec for evaluation: AQ-SGD memory and feedback state belong to training.
        self.inference = build_inference_codec(compression, compiling)
        self.stats = ChannelStats()

    # ------------------------------------------------------------------ training
    def send(self, x: torch.Tensor, *, sample_ids: torch.Tensor | None = None, slot: int = 0) -> torch.Tensor:
        """Encode `x` (sender end); counts the payload and, when known, the reconstruction error."""
        with self.stats.timing("encode"):
            payload = self.sender.encode(x, sample_ids=sample_ids, slot=slot)
        self.stats.record(x, payload.numel(), self.sender.last_reconstruction)
        return payload

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype,
                       sample_ids: torch.Tensor | None = None) -> int:
        """Size of the next payload, known to the receiver before it arrives."""
        return self.receiver.payload_nbytes(shape, dtype, sample_ids)

    def receive(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, *,
                sample_ids: torch.Tensor | None = None, slot: int = 0) -> torch.Tensor:
        """Decode a payload (receiver end), updating the receiver's state."""
        with self.stats.timing("decode"):
            out = self.receiver.decode(payload, shape, dtype, sample_ids=sample_ids, slot=slot)
        return check_finite(out, self.name, slot)

    def transfer(self, x: torch.Tensor, *, sample_ids: torch.Tensor | None = None, slot: int = 0) -> torch.Tensor:
        """Both ends in one process: what the receiver outputs for `x`."""
        with self.stats.timing("encode"):
            payload = self.sender.encode(x, sample_ids=sample_ids, slot=slot)
        out = self.receive(payload, x.shape, x.dtype, sample_ids=sample_ids, slot=slot)
        self.stats.record(x, payload.numel(), out)
        return out

    # ------------------------------------------------------------------ evaluation
    def inference_payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return self.inference.payload_nbytes(shape, dtype)

    def inference_send(self, x: torch.Tensor) -> torch.Tensor:
        return self.inference.encode(x.detach())

    def inference_receive(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self.inference.decode(payload, shape, dtype)

    def inference_transfer(self, x: torch.Tensor) -> torch.Tensor:
        """Stateless compression for evaluation (no memory or feedback updates)."""
        return self.inference_receive(self.inference_send(x), x.shape, x.dtype)

    # ------------------------------------------------------------------ state
    def ends(self) -> dict[str, object]:
        return {name: end for name, end in (("sender", self.sender), ("receiver", self.receiver)) if end is not None}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Feedback buffers, AQ-SGD memory and codec counters of the ends held here."""
        state: dict[str, torch.Tensor] = {}
        for part, end in self.ends().items():
            state.update(prefixed(end.state_dict(), part))
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for part, end in self.ends().items():
            end.load_state_dict(unprefixed(state, part))

    def adopt_memory(self, old: Boundary) -> None:
        """Take over `old`'s AQ-SGD memory (both AQ-SGD, e.g. another bit width): the entries are
        what both ends decoded, whatever the codec that will send the next deltas; and the sender's
        drift record when both take `deltas="drift"`."""
        if self.receiver is not None:
            self.receiver.memory = old.receiver.memory
        if self.sender is not None:
            self.sender.mirror.memory = old.sender.mirror.memory
            if self.sender.drift is not None and old.sender.drift is not None:  # else it starts from the memory
                self.sender.drift = old.sender.drift
