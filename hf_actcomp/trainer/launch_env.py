"""What a launcher started, as `TrainingArguments` must see it on a machine without a GPU.

`torchrun` and `accelerate launch` set `WORLD_SIZE`, `RANK`, `LOCAL_RANK` for every process. On a
machine without an accelerator, Accelerate counts those processes (gloo, `MULTI_CPU`) only when
it is told to use the CPU (`TrainingArguments(use_cpu=True)` or `ACCELERATE_USE_CPU=1`); otherwise
every process believes it is the only one and the main one, and the stages of a pipeline would
each write the checkpoint as if alone. `ActCompTrainer` needs the real process count, so where the
launcher started several processes and nothing but the CPU is there, it sets `use_cpu=True`
itself (saying so once) and lets the arguments set their devices up again.
"""

from __future__ import annotations

import logging
import os

import torch
from accelerate.utils import parse_flag_from_env

logger = logging.getLogger(__name__)


def launched_processes() -> int:
    """How many processes the launcher started (`WORLD_SIZE`; 1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _has_accelerator() -> bool:
    current = getattr(torch, "accelerator", None)
    if current is not None and hasattr(current, "is_available"):
        return bool(current.is_available())
    return torch.cuda.is_available()


def count_every_process(args) -> bool:
    """Make `args` (TrainingArguments) see every process a launcher started on a CPU-only
    machine; returns whether it had to. Call it before `Trainer.__init__`: setting the devices up
    again resets Accelerate's state."""
    if launched_processes() <= 1 or args.use_cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or _has_accelerator():
        return False
    args.use_cpu = True
    args.__dict__.pop("_setup_devices", None)  # a functools.cached_property: set the devices up again,
    _ = args._setup_devices  # now, before Trainer creates its Accelerator (this resets Accelerate's state)
    if int(os.environ.get("RANK", "0")) == 0:
        logger.warning(
            "hf_actcomp: %d processes were launched on a machine without a GPU, so TrainingArguments(use_cpu=True) "
            "was set for Trainer to count them (otherwise each would act as the only, main process). Set it yourself, "
            "or ACCELERATE_USE_CPU=1, to silence this.", launched_processes())
    return True
