"""The part every data-parallel gradient compressor shares: per-parameter state, byte counting,
a DDP communication-hook adapter, and safetensors-friendly `state_dict`.

A compressor reduces ONE flat gradient (a DDP bucket, or a pipeline stage's gradients) over its
process group and returns the average. State such as error-feedback memory is kept per
parameter name, not per bucket: DDP rebuilds its buckets after the first iteration, and a
resumed run starts with the initial layout again, so bucket indices are not stable keys.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

# torch >= 2.13 names it `all_gather_single` (and warns on the old name); older torch has only the old.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GradientCompressor(abc.ABC):
    """Base class of the hooks. Subclasses implement `_reduce(flat, names)`.

    Args:
        process_group: the data-parallel group (default: the world).
        param_names: id(parameter) -> name, to key per-parameter state (set by `register`).
    """

    name: ClassVar[str] = ""
    hub_tag: ClassVar[str | None] = None  # the model-card tag (None: the name)
    stateful: ClassVar[tuple[str, ...]] = ()  # names of per-parameter state tensors
    # Reduce in a canonical element order (parameters sorted by name), so that random streams,
    # chunks and buckets of the compressor do not depend on DDP's bucket layout, which changes
    # after the first iteration and again in a resumed run.
    canonical_order: ClassVar[bool] = True

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if self.world_size < 2:
            raise ValueError(
                f"The '{self.name}' hook got a process group of {self.world_size} process: there is nothing "
                "to average. Use it only with 2 or more data-parallel workers."
            )
        self.param_names: dict[int, str] = {}
        self.cast_dtype: torch.dtype | None = None  # set by `register(cast=...)`
        self.state: dict[str, dict[str, torch.Tensor]] = {key: {} for key in self.stateful}
        self.step = 0
        self.calls = 0  # reductions so far: seeds each call's random stream, identical on every rank
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
        self.seconds = 0.0

    # ------------------------------------------------------------------ the reduction
    def reduce(self, flat: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Average `flat` (the concatenated gradients of `params`, in order) over the group."""
        start = time.perf_counter()
        names = [self._name(p) for p in params]
        sizes = [p.numel() for p in params]
        self.bytes_uncompressed += ring_allreduce_bytes(flat.numel() * flat.element_size(), self.world_size)
        order = sorted(range(len(names)), key=names.__getitem__)
        if not self.canonical_order or order == list(range(len(names))):
            out = self._reduce(flat, names, sizes)
        else:
            pieces = flat.split(sizes)
            canonical = torch.cat([pieces[i] for i in order])
            reduced = self._reduce(canonical, [names[i] for i in order], [sizes[i] for i in order])
            back = dict(zip(order, reduced.split([sizes[i] for i in order]), strict=True))
            out = torch.cat([back[i] for i in range(len(names))])
        self.seconds += time.perf_counter() - start
        return out

    @abc.abstractmethod
    def _reduce(self, flat: torch.Tensor, names: list[str], sizes: list[int]) -> torch.Tensor:
        """The average of `flat` over the group (a new tensor or `flat` itself)."""

    def end_step(self) -> None:
        """Called once per optimizer step (after all buckets); advances schedules and seeds."""
        self.step += 1

    # ------------------------------------------------------------------ per-parameter state
    def _name(self, p: torch.Tensor) -> str:
        return self.param_names.get(id(p), f"param{id(p)}")

    def _gather_state(self, key: str, names: list[str], sizes: list[int], like: torch.Tensor) -> torch.Tensor:
        """The flat state `key` for these parameters (zeros where none yet), fp32."""
        store = self.state[key]
        parts = [store[n] if n in store else torch.zeros(s, dtype=torch.float32, device=like.device)
                 for n, s in zip(names, sizes, strict=True)]
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()

    def _scatter_state(self, key: str, names: list[str], sizes: list[int], flat: torch.Tensor) -> None:
        self.state[key].update(zip(names, flat.split(sizes), strict=True))

    # ------------------------------------------------------------------ communication helpers
    def all_gather_bytes(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's payload (all the same size); counts the bytes of a ring all-gather."""
        out = torch.empty(self.world_size * payload.numel(), dtype=torch.uint8, device=payload.device)
        _all_gather_single(out, payload.contiguous(), group=self.group)
        self.bytes_sent += payload.numel() * (self.world_size - 1)
        return list(out.chunk(self.world_size))

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        self.bytes_sent += ring_allreduce_bytes(t.numel() * t.element_size(), self.world_size)
        return t

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Per-parameter state and counters as flat tensors (safetensors-ready)."""
        out = {f"{key}.{name}": t for key, store in self.state.items() for name, t in store.items()}
        out["step"] = torch.tensor(self.step)
        out["calls"] = torch.tensor(self.calls)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.step = int(state["step"])
        self.calls = int(state["calls"])
        for key in self.stateful:
            prefix = f"{key}."
            self.state[key] = {k[len(prefix):]: v.clone().float() for k, v in state.items() if k.startswith(prefix)}

    def stats(self) -> dict[str, Any]:
        """Bytes this worker put on the wire (ring formulas), the all-reduce equivalent, time."""
        return {
            "hook": self.name,
            "steps": self.step,
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
            "compression_ratio": self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0,
            "seconds": self.seconds,
        }


# The one registry of data-parallel hooks by name, filled by `hf_actcomp.dp` and `register_hook`.
# It lives here, in a module that imports nothing else of the package, so that `Plan` can check
# `dp_compression` against it without an import cycle (hf_actcomp.dp imports plan via checkpoint).
HOOKS: dict[str, type] = {}


def register_hook(cls: type[GradientCompressor]) -> type[GradientCompressor]:
    """Class decorator adding a data-parallel hook under `cls.name`: from then on
    `hf_actcomp.dp.register`, `make_compressor` and `Plan(dp_compression=cls.name)` accept it.
    Register it in every process before building the plan. Refuses a name already taken by
    another class (`del HOOKS[name]` first to replace one)."""
    if not (isinstance(cls, type) and issubclass(cls, GradientCompressor)):
        raise TypeError(f"register_hook expects a GradientCompressor subclass, got {cls!r}.")
    if not isinstance(cls.name, str) or not cls.name:
        raise ValueError(f"{cls.__name__}.name={cls.name!r} must be a non-empty string.")
    if cls.name in HOOKS and HOOKS[cls.name] is not cls:
        raise ValueError(f"A data-parallel hook named {cls.name!r} is already registered ({HOOKS[cls.name].__name__}).")
    HOOKS[cls.name] = cls
    return cls


def available_hooks() -> list[str]:
    """Registered hook names, sorted."""
    return sorted(HOOKS)


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each worker sends in a ring all-reduce of `nbytes`: 2 (W - 1) / W of it."""
    return 2 * (world_size - 1) * nbytes // world_size


def check_ratio(name: str, ratio: float) -> float:
    if not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise ValueError(f"The '{name}' hook needs 0 < ratio <= 1, got ratio={ratio!r}.")
    return float(ratio)
