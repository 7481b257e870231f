"""`MemoryConfig`: where AQ-SGD keeps its per-sample activation memory (`Plan.memory`).

Only the settings, checked; the stores themselves are `hf_actcomp.aqsgd_memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import check_choice

MEMORY_STORES = ("device", "host", "mmap")
MEMORY_DTYPES = ("fp32", "fp16", "bf16", "int8")


@dataclass
class MemoryConfig:
    """Where AQ-SGD keeps its per-sample activation memory.

    Args:
        store: `device` (a tensor next to the model), `host` (CPU memory, not pinned: rows are
            copied out anyway) or `mmap` (a memory-mapped file, for data sets whose memory does not
            fit in RAM). A device or host store larger than the free memory there is refused
            before it is allocated.
        dtype: storage dtype: `fp32`, `fp16`, `bf16` or `int8` (per-token max-abs quantized).
        num_samples: number of samples in the training set (`len(train_dataset)`); every
            `sample_id` must lie in `[0, num_samples)`. Required for `aqsgd` before training
            (`ActCompTrainer` fills it from the training set).
        path: directory of the memory-mapped files (`store="mmap"`); a temporary directory if None.
    """

    store: str = "host"
    dtype: str = "fp16"
    num_samples: int | None = None
    path: str | None = None

    def __post_init__(self) -> None:
        check_choice("MemoryConfig", "store", self.store, MEMORY_STORES)
        check_choice("MemoryConfig", "dtype", self.dtype, MEMORY_DTYPES)
        if self.num_samples is not None and (
            not isinstance(self.num_samples, int) or self.num_samples < 1
        ):
            raise ValueError(f"MemoryConfig.num_samples={self.num_samples!r} must be a positive integer.")

