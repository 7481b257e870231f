"""The state around a codec on one boundary direction: plain, error feedback, EF21 and AQ-SGD.

A boundary direction is a `Sender` (on the stage that produces the tensor) and a `Receiver` (on
the stage that consumes it). Every stateful sender holds a *mirror* receiver: an exact replica of
what the receiver does with each payload, so both sides keep identical state (EF21 estimates,
AQ-SGD memory) without ever exchanging it. The same objects serve the in-process simulation and
the distributed pipeline: only the transport of the payload differs.

State is kept per micro-batch `slot` for EF / EF21 (so the order in which micro-batches are
processed does not matter) and per `sample_id` for AQ-SGD.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .aqsgd_memory import MemoryStore, check_sample_ids
from .codecs import Codec, make_codec
from .codecs.fused import fuse
from .plan import Compression, MemoryConfig
from .plan.inference_form import resolve_inference
from .state.keys import prefixed, unprefixed

logger = logging.getLogger(__name__)


def build_codec(compression: Compression, compiling: dict | None = None) -> Codec:
    """The codec a `Compression` names (for `aqsgd`, its inner codec). `compiling`: torch.compile's
    options when the stages are compiled (`compile=True`): a quantizer's arithmetic is then fused
    too (hf_actcomp/codecs/fused.py); None: eager."""
    codec = make_codec(compression.codec_name, **compression.codec_params())
    return codec if compiling is None else fuse(codec, compiling)


def build_first_visit_codec(compression: Compression, compiling: dict | None = None) -> Codec:
    """The codec AQ-SGD sends a sample with the first time it is seen: none (`first_visit="full"`),
    its inner codec (`"direct"`), or the stateless warm-up codec `first_visit` names."""
    first_visit = compression.first_visit
    if isinstance(first_visit, Compression):
        return build_codec(first_visit, compiling)
    return make_codec("none") if first_visit == "full" else build_codec(compression, compiling)


def build_inference_codec(compression: Compression, compiling: dict | None = None) -> Codec:
    """The stateless codec used where no training state exists (evaluation, generation): what
    `Compression.inference` resolves to (hf_actcomp/plan/inference_form.py). Feedback wrappers
    are dropped: their state belongs to training."""
    return build_codec(resolve_inference(compression), compiling)


# ---------------------------------------------------------------------------------- receivers
class Receiver:
    """Decodes payloads of one boundary direction. The base class is stateless."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype, sample_ids: torch.Tensor | None = None) -> int:
        """Size of the next payload, known from the receiver's own state before it arrives."""
        return self.codec.payload_nbytes(shape, dtype)

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, *,
               sample_ids: torch.Tensor | None = None, slot: int = 0) -> torch.Tensor:
        return self.codec.decode(payload, shape, dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return _codec_state("codec", self.codec)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        _load_codec_state("codec", self.codec, state)


class EF21Receiver(Receiver):
    """EF21: the receiver keeps an estimate g per slot and adds each decoded correction to it."""

    def __init__(self, codec: Codec) -> None:
        super().__init__(codec)
        self.estimates: dict[int, torch.Tensor] = {}

    def current(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """The estimate for `slot`, reset to zeros when the tensor shape changes."""
        g = self.estimates.get(slot)
        if g is None or g.shape != x.shape or g.device != x.device:
            if g is not None:
                logger.debug("EF21 state of slot %d reset: shape %s -> %s", slot, tuple(g.shape), tuple(x.shape))
            g = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            self.estimates[slot] = g
        return g

    def decode(self, payload, shape, dtype, *, sample_ids=None, slot=0):
        correction = self.codec.decode(payload, shape, torch.float32)
        g = self.current(slot, correction)
        g.add_(correction)
        # A copy: g is updated in place by the next decode, which must not change a tensor the
        # caller (autograd, for one) still holds.
        return g.to(dtype, copy=True)

    def state_dict(self):
        state = super().state_dict()
        state.update(prefixed(self.estimates, "estimate"))
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.estimates = {int(slot): g.clone().float() for slot, g in unprefixed(state, "estimate").items()}


class AQSGDReceiver(Receiver):
    """AQ-SGD: m(xi) per sample; the payload carries Q(a - m) for seen samples, and the first-visit
    encoding for new ones. The output, and the new m, is m + decoded delta. With
    `Compression.refresh_every` = k > 1 only every k-th revisit of a sample carries its delta; on
    the others nothing crosses for it and the output is m as stored."""

    def __init__(self, compression: Compression, memory: MemoryConfig, name: str,
                 sample_range: range | None = None, compiling: dict | None = None) -> None:
        super().__init__(build_codec(compression, compiling))
        self.refresh_every = compression.refresh_every
        # Its decoded value becomes the memory entry (see `decode`), which later deltas correct.
        self.first_codec = build_first_visit_codec(compression, compiling)
        # A data-parallel replica keeps rows for its shard's ids only; row = id - shard start.
        self.sample_range = sample_range
        rows = len(sample_range) if sample_range is not None else memory.num_samples
        self.memory = MemoryStore(rows, memory, name=name)

    def _split(self, shape: Sequence[int], sample_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(memory rows of the batch, positions of unseen rows, of seen rows whose delta crosses
        this visit, of seen rows that reuse their memory as is: `refresh_every`'s other revisits)."""
        shard = self.sample_range
        ids = check_sample_ids(sample_ids, shard if shard is not None else self.memory.num_samples, shape[0])
        if shard is not None:
            ids = ids - shard.start
        seen = self.memory.is_seen(ids)
        refresh = seen & (self.memory.visit_counts(ids) % self.refresh_every == 0)
        return (ids, (~seen).nonzero().flatten(), refresh.nonzero().flatten(),
                (seen & ~refresh).nonzero().flatten())

    def _sizes(self, shape: Sequence[int], dtype: torch.dtype, n_new: int, n_seen: int) -> tuple[int, int]:
        rest = tuple(shape[1:])
        new_bytes = self.first_codec.payload_nbytes((n_new, *rest), dtype) if n_new else 0
        seen_bytes = self.codec.payload_nbytes((n_seen, *rest), dtype) if n_seen else 0
        return new_bytes, seen_bytes

    def payload_nbytes(self, shape, dtype, sample_ids=None):
        _, new, seen, _ = self._split(shape, sample_ids)
        return sum(self._sizes(shape, dtype, new.numel(), seen.numel()))

    def decode(self, payload, shape, dtype, *, sample_ids=None, slot=0):
        ids, new, seen, reused = self._split(shape, sample_ids)
        new_bytes, seen_bytes = self._sizes(shape, dtype, new.numel(), seen.numel())
        if payload.numel() != new_bytes + seen_bytes:
            raise ValueError(
                f"AQ-SGD payload has {payload.numel()} bytes, expected {new_bytes + seen_bytes}: "
                "sender and receiver memories are out of step."
            )
        rest = tuple(shape[1:])
        out = torch.empty(tuple(shape), dtype=dtype, device=payload.device)
        if new.numel():
            rows = self.first_codec.decode(payload[:new_bytes], (new.numel(), *rest), dtype)
            out.index_copy_(0, new.to(out.device), rows)
        if seen.numel():
            seen_ids = ids[seen]
            delta = self.codec.decode(payload[new_bytes:], (seen.numel(), *rest), torch.float32)
            m = self.memory.read(seen_ids, out.device, torch.float32)
            out.index_copy_(0, seen.to(out.device), (m + delta).to(dtype))
        if reused.numel():
            out.index_copy_(0, reused.to(out.device), self.memory.read(ids[reused], out.device, dtype))
            crossed = torch.cat([new, seen])  # a reused row's memory stays as stored
            if crossed.numel():
                self.memory.write(ids[crossed], out.index_select(0, crossed.to(out.device)))
        else:
            self.memory.write(ids, out)
        self.memory.count_visit(ids)
        return out

    def state_dict(self):
        state = super().state_dict()
        state.update(_codec_state("first_codec", self.first_codec))
        state.update(prefixed(self.memory.state_dict(), "memory"))
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        _load_codec_state("first_codec", self.first_codec, state)
        self.memory.load_state_dict(unprefixed(state, "memory"))


# ---------------------------------------------------------------------------------- senders
class Sender:
    """Encodes tensors of one boundary direction.

    `mirror` (when present) replays the receiver on each payload; `last_reconstruction` is then
    exactly what the receiver will output, used for stateful schemes and error statistics.
    """

    def __init__(self, codec: Codec, mirror: Receiver | None = None) -> None:
        self.codec = codec
        self.mirror = mirror
        self.last_reconstruction: torch.Tensor | None = None

    def encode(self, x: torch.Tensor, *, sample_ids: torch.Tensor | None = None, slot: int = 0) -> torch.Tensor:
        payload = self.codec.encode(x)
        self._replay(payload, x, sample_ids, slot)
        return payload

    def _replay(self, payload, x, sample_ids, slot) -> None:
        if self.mirror is not None:
            self.last_reconstruction = self.mirror.decode(payload, x.shape, x.dtype, sample_ids=sample_ids, slot=slot)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = _codec_state("codec", self.codec)
        if self.mirror is not None:
            state.update(prefixed(self.mirror.state_dict(), "mirror"))
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        _load_codec_state("codec", self.codec, state)
        if self.mirror is not None:
            self.mirror.load_state_dict(unprefixed(state, "mirror"))


class EFSender(Sender):
    """Error feedback: send C(x + e), keep e = x + e - decoded (per slot)."""

    def __init__(self, codec: Codec, mirror: Receiver) -> None:
        super().__init__(codec, mirror)
        self.errors: dict[int, torch.Tensor] = {}

    def encode(self, x, *, sample_ids=None, slot=0):
        e = self.errors.get(slot)
        if e is None or e.shape != x.shape or e.device != x.device:
            e = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        corrected = x.detach().float() + e
        payload = self.codec.encode(corrected.to(x.dtype))
        self._replay(payload, x, sample_ids, slot)
        self.errors[slot] = corrected - self.last_reconstruction.float()
        return payload

    def state_dict(self):
        state = super().state_dict()
        state.update(prefixed(self.errors, "error"))
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.errors = {int(slot): e.clone().float() for slot, e in unprefixed(state, "error").items()}


class EF21Sender(Sender):
    """EF21: send C(x - g) where g is the shared estimate; both sides then add the decoded value."""

    mirror: EF21Receiver

    def encode(self, x, *, sample_ids=None, slot=0):
        g = self.mirror.current(slot, x)
        payload = self.codec.encode((x.detach().float() - g).to(x.dtype))
        self._replay(payload, x, sample_ids, slot)
        return payload


class AQSGDSender(Sender):
    """AQ-SGD sender: new samples go out with the first-visit encoding, seen ones as Q(a - m).

    `first_codec` encodes first visits; it is the sender's own object, apart from the mirror's
    (which decodes), as `codec` is: a codec whose decode draws from its stream (random-k) would
    otherwise advance the shared counter twice per payload and fall out of step with the receiver.

    `drift` (`Compression.deltas="drift"`): the sender's exact record of each sample, its first
    visit as it was and every decoded delta added since. Deltas are taken against it instead of
    the receiver's memory (the mirror, which stays an exact copy of the receiver's), so they carry
    the sender stage's drift only: the receiver's memory stays off the exact record by the first
    visit's coding error, constant from then on. A sample the record lacks while the receiver has
    it (a plan switched to drift deltas mid-run, a checkpoint saved without a record) starts from
    the receiver's memory.
    """

    mirror: AQSGDReceiver

    def __init__(self, codec: Codec, mirror: AQSGDReceiver, first_codec: Codec,
                 drift: MemoryStore | None = None) -> None:
        super().__init__(codec, mirror)
        self.first_codec = first_codec
        self.drift = drift

    def encode(self, x, *, sample_ids=None, slot=0):
        mirror = self.mirror
        ids, new, seen, _ = mirror._split(x.shape, sample_ids)  # reused rows send nothing
        parts = []
        x = x.detach()
        if new.numel():
            parts.append(self.first_codec.encode(x.index_select(0, new.to(x.device))))
        if seen.numel():
            m = mirror.memory.read(ids[seen], x.device, torch.float32)
            base = m if self.drift is None else self._record(ids[seen], m)
            delta = x.index_select(0, seen.to(x.device)).float() - base
            parts.append(self.codec.encode(delta.to(x.dtype)))
        if not parts:  # every row reuses its memory: an empty message
            parts.append(torch.empty(0, dtype=torch.uint8, device=x.device))
        payload = torch.cat(parts) if len(parts) > 1 else parts[0]
        self._replay(payload, x, sample_ids, slot)  # the ids, not the memory rows: the mirror maps them again
        if self.drift is not None:
            if new.numel():  # the first visit as it was, not as it was coded
                self.drift.write(ids[new], x.index_select(0, new.to(x.device)))
            if seen.numel():  # plus the delta the receiver decoded
                decoded = self.last_reconstruction.index_select(0, seen.to(x.device)).float() - m
                self.drift.write(ids[seen], base + decoded)
        return payload

    def _record(self, ids: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """The drift record of `ids`; the receiver's `memory` for those it has no record of."""
        known = self.drift.is_seen(ids)
        if not known.any():
            return memory
        record = self.drift.read(ids, memory.device, torch.float32)
        return torch.where(known.to(memory.device).reshape(-1, *(1,) * (memory.dim() - 1)), record, memory)

    def state_dict(self):
        state = super().state_dict()
        state.update(_codec_state("first_codec", self.first_codec))
        if self.drift is not None:
            state.update(prefixed(self.drift.state_dict(), "drift"))
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        _load_codec_state("first_codec", self.first_codec, state)
        record = unprefixed(state, "drift")
        if self.drift is not None and record:  # none saved: every sample starts from the receiver's memory
            self.drift.load_state_dict(record)


# ---------------------------------------------------------------------------------- factory
def build_receiver(compression: Compression, memory: MemoryConfig | None = None, name: str = "boundary",
                   sample_range: range | None = None, compiling: dict | None = None) -> Receiver:
    """The receiving end of one boundary direction (AQ-SGD: memory for `sample_range`'s ids, by
    default every sample's). `compiling`: as for `build_codec`."""
    if compression.method == "aqsgd":
        if memory is None:
            raise ValueError("AQ-SGD needs a MemoryConfig.")
        return AQSGDReceiver(compression, memory, name=f"{name}.receiver", sample_range=sample_range,
                             compiling=compiling)
    if compression.feedback == "ef21":
        return EF21Receiver(build_codec(compression, compiling))
    return Receiver(build_codec(compression, compiling))


def build_sender(compression: Compression, memory: MemoryConfig | None = None, name: str = "boundary",
                 track_error: bool = False, sample_range: range | None = None,
                 compiling: dict | None = None) -> Sender:
    """The sending end of one boundary direction, with a mirror of the receiver when its state
    (or `track_error`) needs the reconstruction. `compiling`: as for `build_codec`."""
    codec = build_codec(compression, compiling)
    if compression.method == "aqsgd":
        if memory is None:
            raise ValueError("AQ-SGD needs a MemoryConfig.")
        mirror = AQSGDReceiver(compression, memory, name=f"{name}.sender", sample_range=sample_range,
                               compiling=compiling)
        drift = (MemoryStore(mirror.memory.num_samples, memory, name=f"{name}.sender.drift")
                 if compression.deltas == "drift" else None)
        return AQSGDSender(codec, mirror, build_first_visit_codec(compression, compiling), drift)
    mirror = build_receiver(compression, compiling=compiling)
    if compression.feedback == "ef21":
        return EF21Sender(codec, mirror)
    if compression.feedback == "ef":
        return EFSender(codec, mirror)
    return Sender(codec, mirror if track_error else None)


def _codec_state(prefix: str, codec: Codec) -> dict[str, torch.Tensor]:
    return prefixed({k: torch.tensor(v) for k, v in codec.state_dict().items()}, prefix)


def _load_codec_state(prefix: str, codec: Codec, state: dict[str, torch.Tensor]) -> None:
    own = {k: v.item() for k, v in unprefixed(state, prefix).items()}
    if own:
        codec.load_state_dict(own)
