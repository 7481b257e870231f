"""Counters for what crosses between ranks: per boundary direction the bytes actually handed over,
the uncompressed size, the relative reconstruction error and the time spent encoding and decoding;
per other category (tied-embedding rows, collectives, data-parallel hook) the bytes."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch


@dataclass
class ChannelStats:
    """Accumulated counters of one boundary direction."""

    messages: int = 0
    bytes_sent: int = 0
    bytes_uncompressed: int = 0
    squared_error: float = 0.0
    squared_norm: float = 0.0
    last_relative_error: float = 0.0
    seconds_encode: float = 0.0
    seconds_decode: float = 0.0

    def record(self, x: torch.Tensor, payload_nbytes: int, x_hat: torch.Tensor | None = None) -> None:
        """Count one message; with `x_hat`, also the error ||x - x_hat|| / ||x||."""
        self.messages += 1
        self.bytes_sent += int(payload_nbytes)
        self.bytes_uncompressed += x.numel() * x.element_size()
        if x_hat is not None:
            x32 = x.detach().float()
            err = float((x32 - x_hat.detach().float()).pow(2).sum())
            norm = float(x32.pow(2).sum())
            self.squared_error += err
            self.squared_norm += norm
            self.last_relative_error = math.sqrt(err / norm) if norm > 0 else 0.0

    def reset(self) -> None:
        """Back to zero, in place: whoever holds this counter keeps counting into it."""
        _reset(self)

    @contextmanager
    def timing(self, kind: str):
        """Add the block's wall time to `seconds_encode` or `seconds_decode`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if kind == "encode":
                self.seconds_encode += elapsed
            else:
                self.seconds_decode += elapsed

    @property
    def compression_ratio(self) -> float:
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0

    @property
    def relative_error(self) -> float:
        """Error over all messages so far: sqrt(sum ||x - x_hat||^2 / sum ||x||^2)."""
        return math.sqrt(self.squared_error / self.squared_norm) if self.squared_norm > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "messages": self.messages,
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
            "compression_ratio": self.compression_ratio,
            "relative_error": self.relative_error,
            "last_relative_error": self.last_relative_error,
            "seconds_encode": self.seconds_encode,
            "seconds_decode": self.seconds_decode,
        }


@dataclass
class TrafficCounter:
    """Bytes of one category of traffic that is not a boundary payload (tie rows, collectives).

    `bytes_uncompressed` is what the same exchange costs without compression; for lossless
    traffic the two are equal.
    """

    messages: int = 0
    bytes_sent: int = 0
    bytes_uncompressed: int = 0

    def reset(self) -> None:
        """Back to zero, in place: whoever holds this counter keeps counting into it."""
        _reset(self)

    def add(self, nbytes: int, uncompressed: int | None = None) -> None:
        self.messages += 1
        self.bytes_sent += int(nbytes)
        self.bytes_uncompressed += int(nbytes if uncompressed is None else uncompressed)

    def as_dict(self) -> dict[str, int | float]:
        return {"messages": self.messages, "bytes_sent": self.bytes_sent,
                "bytes_uncompressed": self.bytes_uncompressed,
                "compression_ratio": self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0}


class CounterState:
    """Byte and error counters as part of a checkpoint's compression state, so that a resumed run
    goes on counting where it stopped (`comm/bytes_sent`, the compression ratio and the relative
    errors Trainer logs are cumulative, like its own token and FLOP counts). Timers are not saved:
    they count this session, as Trainer's `train_runtime` does. A checkpoint without counters (saved
    by an older version) loads and counts from zero.

    Args:
        counters: name -> an object with some of `SAVED` as attributes (ChannelStats, TrafficCounter,
            a data-parallel hook); saved as `{name}.{attribute}`, 0-d int64 or float64 tensors.
    """

    SAVED = ("messages", "bytes_sent", "bytes_uncompressed", "squared_error", "squared_norm", "last_relative_error")

    def __init__(self, counters: dict[str, object]) -> None:
        self.counters = counters

    @classmethod
    def of(cls, boundaries: dict, traffic: dict[str, TrafficCounter], data_parallel=None) -> CounterState:
        """The counters of `boundaries` (name -> Boundary), of `traffic` (saved as `traffic.{name}`)
        and of the data-parallel hook, if any."""
        counted = {**{name: end.stats for name, end in boundaries.items()},
                   **{f"traffic.{name}": counter for name, counter in traffic.items()}}
        if data_parallel is not None:
            counted["data_parallel"] = data_parallel
        return cls(counted)

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {}
        for name, counter in self.counters.items():
            for key in self.SAVED:
                value = getattr(counter, key, None)
                if isinstance(value, (int, float)):
                    dtype = torch.int64 if isinstance(value, int) else torch.float64
                    state[f"{name}.{key}"] = torch.tensor(value, dtype=dtype)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, counter in self.counters.items():
            for key in self.SAVED:
                saved = state.get(f"{name}.{key}")
                if saved is not None and hasattr(counter, key):
                    setattr(counter, key, saved.item())


def _reset(counter) -> None:
    for f in fields(counter):
        setattr(counter, f.name, f.default)


# What crosses between ranks, by category (see `summarize`).
CATEGORIES = ("activations", "activation_gradients", "tie", "collectives", "data_parallel")


def summarize(channels: dict[str, ChannelStats],
              traffic: dict[str, TrafficCounter | dict] | None = None) -> dict:
    """Totals over named boundary channels (e.g. `boundary0.forward`) and other traffic.

    `categories` splits the bytes into activations (`*.forward` channels), activation gradients
    (`*.backward`), and each entry of `traffic` (tie rows, loss/token-count collectives, the
    data-parallel hook; a dict there needs `bytes_sent` and `bytes_uncompressed`). The totals and
    `compression_ratio` cover all of it.
    """
    def total(items) -> dict[str, int]:
        items = list(items)
        return {"bytes_sent": sum(c.bytes_sent for c in items),
                "bytes_uncompressed": sum(c.bytes_uncompressed for c in items)}

    categories = {
        "activations": total(c for n, c in channels.items() if n.endswith(".forward")),
        "activation_gradients": total(c for n, c in channels.items() if n.endswith(".backward")),
    }
    for name, counter in (traffic or {}).items():
        d = counter if isinstance(counter, dict) else counter.as_dict()
        categories[name] = {"bytes_sent": int(d["bytes_sent"]), "bytes_uncompressed": int(d["bytes_uncompressed"])}
    for c in categories.values():
        c["compression_ratio"] = c["bytes_uncompressed"] / c["bytes_sent"] if c["bytes_sent"] else 1.0
    sent = sum(c["bytes_sent"] for c in categories.values())
    raw = sum(c["bytes_uncompressed"] for c in categories.values())
    return {
        "bytes_sent": sent,
        "bytes_uncompressed": raw,
        "compression_ratio": raw / sent if sent else 1.0,
        "categories": categories,
        "relative_error": {name: c.relative_error for name, c in channels.items()},
        "channels": {name: c.as_dict() for name, c in channels.items()},
    }
