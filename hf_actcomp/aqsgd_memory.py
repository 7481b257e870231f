"""Per-sample AQ-SGD memory: one stored activation per training sample, keyed by `sample_id`.

Both sides of a boundary keep an identical store (the sender's is a mirror of the receiver's), so
the choice of backend only changes where the bytes live: next to the model (`device`), in CPU
memory (`host`; not pinned: rows are gathered with `index_select`, whose result is a new
pageable tensor anyway, so pinning the whole table would only lock RAM) or in a memory-mapped file (`mmap`) for data sets whose
memory does not fit in RAM. Storage can be fp32/fp16/bf16, or int8 with one max-abs scale per
token (the low-memory variant of the reference code). Allocation is lazy (the per-sample shape
is known at the first write) and the size is logged before anything is allocated.

Memory-mapped files get a unique name (store name, distributed rank, a random part) so stores and
processes never share or truncate each other's files; a store removes the files (and temporary
directory) it created when it is closed or garbage collected.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence

import torch

from .plan import MEMORY_DTYPES, MEMORY_STORES, MemoryConfig

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def _remove_created(created: list[str]) -> None:
    """Remove the files and directories in `created` (newest first); a missing one is skipped."""
    while created:
        path = created.pop()
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def replica_sample_range(num_samples: int, num_replicas: int, replica: int) -> range:
    """The sample ids whose AQ-SGD memory data-parallel replica `replica` keeps: its contiguous,
    equal shard of the data set (`Pipeline.shard_dataset` gives each replica these rows)."""
    if num_samples < num_replicas:
        raise ValueError(f"memory.num_samples={num_samples} cannot give {num_replicas} replicas a sample each.")
    size = num_samples // num_replicas
    return range(replica * size, (replica + 1) * size)


def check_sample_ids(sample_ids: torch.Tensor | None, num_samples: int | range, batch_size: int) -> torch.Tensor:
    """Validate a batch's `sample_id` column and return it as a CPU int64 tensor.

    `num_samples` is the data set's size, or the range of ids this process keeps memory for (a
    data-parallel replica's shard). AQ-SGD writes memory at these indices, so a wrong id would
    silently corrupt another sample's memory: every problem is an error naming the bad value.
    """
    if sample_ids is None:
        raise ValueError(
            "AQ-SGD needs a 'sample_id' entry in every batch (the dataset index of each row). "
            "Add it with hf_actcomp.add_sample_ids(dataset)."
        )
    if not isinstance(sample_ids, torch.Tensor):
        sample_ids = torch.as_tensor(sample_ids)
    if sample_ids.dtype.is_floating_point or sample_ids.dtype == torch.bool:
        raise ValueError(f"sample_id must be an integer tensor, got dtype {sample_ids.dtype}.")
    ids = sample_ids.reshape(-1).to("cpu", torch.int64)
    if ids.numel() != batch_size:
        raise ValueError(f"sample_id has {ids.numel()} entries but the batch has {batch_size} rows.")
    if ids.numel() == 0:
        return ids
    low, high = int(ids.min()), int(ids.max())
    if isinstance(num_samples, range):
        shard = num_samples
        if low < shard.start or high >= shard.stop:
            bad = low if low < shard.start else high
            raise ValueError(
                f"sample_id {bad} is outside this data-parallel replica's shard [{shard.start}, {shard.stop}): "
                "each replica keeps AQ-SGD memory for its contiguous shard of the data set only. Shard with "
                "Pipeline.shard_dataset(dataset) after add_sample_ids (ActCompTrainer does both)."
            )
    elif low < 0:
        raise ValueError(f"sample_id {low} is negative; ids must lie in [0, {num_samples}).")
    elif high >= num_samples:
        raise ValueError(
            f"sample_id {high} is out of range: memory.num_samples={num_samples}, so ids must lie "
            f"in [0, {num_samples}). Set MemoryConfig(num_samples=len(train_dataset))."
        )
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"sample_id has duplicates within one batch: {ids.tolist()}.")
    return ids


def free_memory_bytes(device: torch.device) -> int | None:
    """Free bytes on `device`: CUDA's free memory, or the host's available RAM (None if unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class MemoryStore:
    """A table of `num_samples` activations with a `seen` flag and a visit count per sample (the
    count tells `Compression.refresh_every`'s revisits that send a delta from those that reuse
    the memory).

    Args:
        num_samples: rows of the table (every sample id lies in `[0, num_samples)`).
        config: backend and storage dtype.
        name: identifies the store in logs and names its file for `mmap`.

    `close()` (or garbage collection) removes the files an `mmap` store created.
    """

    def __init__(self, num_samples: int, config: MemoryConfig, name: str = "memory") -> None:
        if config.store not in MEMORY_STORES:
            raise ValueError(f"Unknown memory store {config.store!r}; allowed: {', '.join(MEMORY_STORES)}.")
        if config.dtype not in MEMORY_DTYPES:
            raise ValueError(f"Unknown memory dtype {config.dtype!r}; allowed: {', '.join(MEMORY_DTYPES)}.")
        self.num_samples = num_samples
        self.config = config
        self.name = name
        self.seen = torch.zeros(num_samples, dtype=torch.bool)
        self.visits = torch.zeros(num_samples, dtype=torch.int64)
        self.sample_shape: tuple[int, ...] | None = None
        self.values: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None  # int8 storage only: one scale per token
        # A checkpoint loaded before the tables exist: copied in at the first access, whose device
        # places the tables exactly as for a store that never went through a checkpoint.
        self._loaded: dict[str, torch.Tensor] | None = None
        self._created: list[str] = []  # mmap files and temporary directory this store made
        self._temp_dir: str | None = None
        self._finalizer = weakref.finalize(self, _remove_created, self._created)

    # ------------------------------------------------------------------ sizing and allocation
    def nbytes_for(self, sample_shape: Sequence[int]) -> int:
        """Bytes the table takes for samples of `sample_shape` (scales included for int8)."""
        per_sample = math.prod(sample_shape) * _TORCH_DTYPES[self.config.dtype].itemsize
        if self.config.dtype == "int8":
            per_sample += math.prod(sample_shape[:-1]) * 4
        return per_sample * self.num_samples

    def _allocate(self, sample_shape: tuple[int, ...], device: torch.device) -> None:
        nbytes = self.nbytes_for(sample_shape)
        logger.info(
            "AQ-SGD memory %s: %d samples x %s x %s = %.2f MiB (%s store).",
            self.name, self.num_samples, tuple(sample_shape), self.config.dtype, nbytes / 2**20,
            self.config.store,
        )
        self._check_fits(nbytes, device)
        shape = (self.num_samples, *sample_shape)
        dtype = _TORCH_DTYPES[self.config.dtype]
        self.values = self._new_table(shape, dtype, device, "values")
        if self.config.dtype == "int8":
            self.scales = self._new_table((*shape[:-1], 1), torch.float32, device, "scales")
        self.sample_shape = sample_shape

    def _check_fits(self, nbytes: int, device: torch.device) -> None:
        """Refuse, before allocating, a device or host table larger than the free memory there."""
        store = self.config.store
        if store == "mmap":
            return
        where = device if store == "device" else torch.device("cpu")
        free = free_memory_bytes(where)
        if free is not None and nbytes > free:
            raise MemoryError(
                f"AQ-SGD memory {self.name} needs {nbytes / 2**30:.2f} GiB on {where} (store={store!r}) but only "
                f"{free / 2**30:.2f} GiB is free there. Alternatives: MemoryConfig(store='host') (CPU memory), "
                "store='mmap' with path= on a large disk, dtype='int8' (about half of fp16), or fewer samples / "
                "a shorter sequence length."
            )

    def _new_table(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, part: str) -> torch.Tensor:
        store = self.config.store
        if store == "device":
            return torch.zeros(shape, dtype=dtype, device=device)
        if store == "host":
            return torch.zeros(shape, dtype=dtype)
        return self._new_mapped_table(shape, dtype, part)

    def _new_mapped_table(self, shape: tuple[int, ...], dtype: torch.dtype, part: str) -> torch.Tensor:
        """A table in a new, uniquely named sparse file: `<name>[.rank<r>].<part>.<random>.bin`."""
        directory = self.config.path
        if directory is None:
            if self._temp_dir is None:
                self._temp_dir = tempfile.mkdtemp(prefix="hf_actcomp_memory_")
                self._created.append(self._temp_dir)
            directory = self._temp_dir
        os.makedirs(directory, exist_ok=True)
        prefix = self.name.replace("/", "_")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            prefix += f".rank{torch.distributed.get_rank()}"
        fd, path = tempfile.mkstemp(prefix=f"{prefix}.{part}.", suffix=".bin", dir=directory)  # O_EXCL
        self._created.append(path)
        numel = math.prod(shape)
        try:
            os.ftruncate(fd, numel * dtype.itemsize)  # sparse: no bytes written until used
        finally:
            os.close(fd)
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)

    def close(self) -> None:
        """Empty the store and remove the files it created (`mmap`). Safe to call twice."""
        self.values = self.scales = self.sample_shape = self._loaded = self._temp_dir = None
        self.seen.zero_()
        self.visits.zero_()
        _remove_created(self._created)

    def _materialize(self, device: torch.device) -> None:
        """Allocate the tables for `device` and copy in the checkpoint loaded before any access."""
        loaded, self._loaded = self._loaded, None
        self._allocate(tuple(loaded["values"].shape[1:]), device)
        self.values.copy_(loaded["values"])
        if self.scales is not None:
            self.scales.copy_(loaded["scales"])

    # ------------------------------------------------------------------ access
    def is_seen(self, ids: torch.Tensor) -> torch.Tensor:
        """Bool mask (CPU) of the ids that already have memory."""
        return self.seen[ids]

    def visit_counts(self, ids: torch.Tensor) -> torch.Tensor:
        """How many times each of `ids` (CPU int64) was visited before (0: never)."""
        return self.visits[ids]

    def count_visit(self, ids: torch.Tensor) -> None:
        """One more visit of each of `ids` (once per batch that carries them, on both ends)."""
        self.visits[ids] += 1

    def read(self, ids: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Stored activations of `ids` (CPU int64), as `dtype` on `device`."""
        if self.values is None and self._loaded is not None:
            self._materialize(device)
        if self.values is None:
            raise RuntimeError(f"AQ-SGD memory {self.name} was read before any write.")
        index = ids.to(self.values.device)
        rows = self.values.index_select(0, index).to(device, non_blocking=True)
        if self.scales is None:
            return rows.to(dtype)
        scales = self.scales.index_select(0, index).to(device, non_blocking=True)
        return (rows.to(torch.float32) * scales).to(dtype)

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store `rows` (batch, *sample_shape) for `ids` and mark them seen."""
        sample_shape = tuple(rows.shape[1:])
        if self.values is None and self._loaded is not None:
            self._materialize(rows.device)
        if self.values is None:
            self._allocate(sample_shape, rows.device)
        elif sample_shape != self.sample_shape:
            raise ValueError(
                f"AQ-SGD memory {self.name} holds samples of shape {self.sample_shape} but got "
                f"{sample_shape}: AQ-SGD needs a fixed sequence length (pad every batch to the "
                "same max_length)."
            )
        index = ids.to(self.values.device)
        rows = rows.detach()
        if self.scales is not None:
            scale = rows.abs().amax(dim=-1, keepdim=True).to(torch.float32) / 127.0
            codes = torch.round(rows.to(torch.float32) / scale.clamp_min(torch.finfo(torch.float32).tiny))
            self.values.index_copy_(0, index, codes.clamp_(-127, 127).to(torch.int8).to(self.values.device))
            self.scales.index_copy_(0, index, scale.to(self.scales.device))
        else:
            self.values.index_copy_(0, index, rows.to(self.values.dtype).to(self.values.device))
        self.seen[ids] = True

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"seen": self.seen.clone(), "visits": self.visits.clone()}
        if self._loaded is not None:
            state.update(self._loaded)
        if self.values is not None:
            state["values"] = self.values
        if self.scales is not None:
            state["scales"] = self.scales
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state` into this store's own tables (its store type, dtype and device).

        Everything is checked before anything changes. Tables not yet allocated are allocated at
        the next read or write, on that call's device, like a store that never went through a
        checkpoint.
        """
        seen = state["seen"]
        if seen.numel() != self.num_samples:
            raise ValueError(
                f"AQ-SGD memory {self.name}: checkpoint has {seen.numel()} samples, this plan has "
                f"{self.num_samples}."
            )
        visits = state.get("visits")
        if visits is not None and visits.shape != seen.shape:
            raise ValueError(f"AQ-SGD memory {self.name}: checkpoint has {visits.numel()} visit counts for "
                             f"{seen.numel()} samples.")
        values = state.get("values")
        if values is not None:
            saved = _DTYPE_NAMES.get(values.dtype, str(values.dtype))
            if (saved == "int8") != (self.config.dtype == "int8"):
                raise ValueError(
                    f"AQ-SGD memory {self.name}: the checkpoint holds {saved} memory but this store is "
                    f"configured with dtype={self.config.dtype!r} (store={self.config.store!r}); int8 "
                    "and float memory cannot be converted. Resume with the MemoryConfig.dtype the "
                    "checkpoint was saved with."
                )
            if self.values is not None and tuple(values.shape) != tuple(self.values.shape):
                raise ValueError(
                    f"AQ-SGD memory {self.name}: the checkpoint holds samples of shape "
                    f"{tuple(values.shape[1:])}, this store {self.sample_shape}."
                )
        self.seen.copy_(seen)
        # A checkpoint from before visits were counted: one visit per seen sample (only the
        # schedule of `refresh_every` > 1 reads the count).
        self.visits.copy_(visits if visits is not None else seen.to(torch.int64))
        if values is None:
            return
        if self.values is None and self.config.store != "device":
            # Host and mmap tables live on the CPU whatever the stage's device: allocate them now
            # and copy, so that a mapped checkpoint streams from disk into the table.
            self._allocate(tuple(values.shape[1:]), torch.device("cpu"))
        if self.values is None:
            self._loaded = {k: state[k].clone() for k in ("values", "scales") if k in state}  # a snapshot
            return
        self.values.copy_(values)
        if self.scales is not None:
            self.scales.copy_(state["scales"])
