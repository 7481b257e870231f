"""Training checkpoints that a kill cannot tear, and the choice of the one to resume from.

A checkpoint is a directory `checkpoint-{step}` in the run's output directory, written by every
rank at once (each its own files: its stage, its optimizer, its compression state). It counts as
*complete* only once it holds the marker `actcomp_complete.json`, which lists every file with its
size. The marker is written last, by rank 0, after every rank has written and fsynced its files
(a barrier in between), and it is removed first when a directory of that name is written again.
So a kill at any moment leaves either a complete checkpoint or a directory without a valid marker,
which `latest_checkpoint` skips (logging which), falling back to the previous complete one.

`resume_from_checkpoint="auto"` (the recipes' flag, `ActCompTrainer.train(...)`) resolves to the
newest complete checkpoint, or to a fresh start when there is none; it is the default whenever the
process was restarted by torchrun / `accelerate launch --max_restarts`
(`TORCHELASTIC_RESTART_COUNT` > 0), so a restarted group resumes by itself.

Assumes the ranks share the output directory's filesystem, as every per-stage save does.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "actcomp_complete.json"
CHECKPOINT_PREFIX = "checkpoint"
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")
# Test hook (see `maybe_pause_for_fault_test`, docs/reliability.md): never set in production.
FAULT_ENV = "HF_ACTCOMP_FAULT_AT"
FAULT_PID_FILE_ENV = "HF_ACTCOMP_FAULT_PID_FILE"
FAULT_MOMENTS = ("writing", "after", "sync")
FAULT_PAUSE_SECONDS = 120


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this worker group (0: first start)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def init_distributed(timeout: float, backend: str | None = None) -> None:
    """Initialise torch.distributed for a job that torchrun (or `accelerate launch --max_restarts`)
    may restart, with `timeout` seconds on every collective of the default group.

    torchrun's agent keeps one TCP store for the whole job (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE`
    unset), and torch's groups keep their keys there under the same names in every restart: a
    restarted rank may read a dead peer's address and fail to connect (pytorch#135712). Here each
    restart's keys live under their own prefix. Call before creating the `Accelerator`, which then
    uses this group. A no-op outside a launched job or when torch.distributed is up already.
    """
    if dist.is_initialized() or "RANK" not in os.environ:
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    delta = datetime.timedelta(seconds=timeout)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group(backend, timeout=delta, rank=rank, world_size=world_size)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=delta)
    store = dist.PrefixStore(f"hf_actcomp/restart{restart_count()}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=delta)


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> str:
    return os.path.join(os.fspath(output_dir), f"{CHECKPOINT_PREFIX}-{step}")


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why `path` is not a complete checkpoint (the missing marker, or the first listed file that is
    missing or has another size), or None when it is complete."""
    path = os.fspath(path)
    marker = os.path.join(path, COMPLETE_MARKER)
    try:
        with open(marker, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return f"no {COMPLETE_MARKER} (its writing was interrupted)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{marker} is unreadable ({err})"
    for name, size in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if os.path.getsize(file) != size:
            return f"{file} has {os.path.getsize(file)} bytes, {size} when it was written"
    return None


def latest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete `checkpoint-{step}` in `output_dir`, or None. Torn ones are skipped,
    each with a warning that says why."""
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        return None
    steps = sorted((int(m.group(1)) for m in map(_CHECKPOINT_RE.match, os.listdir(output_dir)) if m), reverse=True)
    for step in steps:
        path = checkpoint_dir(output_dir, step)
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        logger.warning("Skipping the incomplete checkpoint %s: %s.", path, problem)
    return None


def resolve_resume_from_checkpoint(value: str | os.PathLike | bool | None, output_dir: str | os.PathLike) -> str | None:
    """The checkpoint to resume from, or None to start fresh.

    Args:
        value: `"auto"` (or True): the newest complete checkpoint in `output_dir`, if any. A path:
            that checkpoint, which must be complete when it has our marker. None or False: a fresh
            start, except after a torchrun restart, where it means `"auto"`.
    """
    if value is None or value is False:
        if restart_count() == 0:
            return None
        value = "auto"
    if value is True or value == "auto":
        path = latest_checkpoint(output_dir)
        if path is None:
            logger.warning("resume_from_checkpoint=auto: no complete checkpoint in %s, starting fresh.", output_dir)
        else:
            logger.warning("resume_from_checkpoint=auto: resuming from %s.", path)
        return path
    path = os.fspath(value)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"resume_from_checkpoint={path!r} is not a directory. Give a checkpoint "
                                "directory, 'auto' (the newest complete one in the output directory) or None.")
    if os.path.exists(os.path.join(path, COMPLETE_MARKER)):
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"The checkpoint {path} is incomplete: {problem}. Resume from an earlier one, "
                             "or use resume_from_checkpoint='auto' to pick the newest complete one.")
    return path


def _fsync_tree(path: str) -> None:
    """Flush every file under `path`, and the directories themselves, to disk."""
    for root, _, files in os.walk(path):
        for name in files:
            try:  # another rank's temporary file may be renamed away meanwhile: its writer syncs it
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


@contextlib.contextmanager
def writing_checkpoint(path: str | os.PathLike, *, group: dist.ProcessGroup | None = None,
                       is_main: bool | None = None) -> Iterator[str]:
    """Write one checkpoint directory from every rank: `with writing_checkpoint(path) as d:` then
    each rank writes its own files under `d`. On exit, every rank fsyncs, all meet at a barrier, and
    the main rank writes the completion marker. Call on every rank of `group` (default: the world).

    A stale marker is removed before anything is written, so a checkpoint written again under the
    same name is never complete before its new files are.
    """
    path = os.fspath(path)
    if is_main is None:
        is_main = not dist.is_initialized() or dist.get_rank() == 0
    if is_main:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, COMPLETE_MARKER))
        os.makedirs(path, exist_ok=True)
        _fsync_dir(path)
    _barrier(group)
    yield path
    _fsync_tree(path)
    _barrier(group)  # every rank's files are on disk
    if is_main:
        files = {os.path.relpath(os.path.join(root, name), path): os.path.getsize(os.path.join(root, name))
                 for root, _, names in os.walk(path) for name in names if name != COMPLETE_MARKER}
        marker = os.path.join(path, COMPLETE_MARKER)
        with open(marker + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"files": files, "written_at": time.time()}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker + ".tmp", marker)
        _fsync_dir(path)
    _barrier(group)


def maybe_pause_for_fault_test(step: int, rank: int, moment: str) -> None:
    """Fault-injection hook for tests: a no-op unless `HF_ACTCOMP_FAULT_AT` is set. It is a test
    hook, not a feature: never set it in production (the named rank stalls for two minutes).

    `HF_ACTCOMP_FAULT_AT=STEP:RANK:MOMENT` (e.g. `4:1:after`) makes the process of global rank
    `RANK` stop at `MOMENT` of step `STEP`: it writes its pid to the file named by
    `HF_ACTCOMP_FAULT_PID_FILE` (if set; written to `FILE.tmp`, then renamed, so a reader never
    sees a partial pid), then sleeps 120 s, for the test to kill it there by that pid
    (tests/test_fault.py, tests/test_diloco.py). Not killed, it goes on as if nothing happened.
    The moments, each called from one place:

    - `writing`: in `hf_actcomp.state.training_state.save_training_state` for the checkpoint of step
      `STEP`, after the stage's weights and compression state are written, before the optimizer
      state, random state and progress (a torn checkpoint; the checkpoints of
      `recipes/finetune_gpt2.py`, not those of `ActCompTrainer`);
    - `after`: in `recipes/finetune_gpt2.py`, once the checkpoint of step `STEP` is complete;
    - `sync`: DiLoCo (`hf_actcomp.dp.outer`), in this process's outer sync number `STEP` (from
      1, syncs that failed included), after the quorum, before the pseudo-gradient exchange;
      `RANK` is `replica * num_stages + stage`.

    Only before the first restart (`TORCHELASTIC_RESTART_COUNT` unset or 0): the restarted group
    runs through. A malformed value raises a ValueError at the first hook reached.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec or restart_count() > 0:
        return
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in FAULT_MOMENTS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected STEP:RANK:MOMENT (e.g. 4:1:after), STEP and RANK "
                         f"non-negative integers, MOMENT one of {', '.join(FAULT_MOMENTS)}. It is a test hook: "
                         "unset it outside the fault tests.")
    want_step, want_rank, want_moment = int(parts[0]), int(parts[1]), parts[2]
    if (want_step, want_rank, want_moment) != (step, rank, moment):
        return
    pid_file = os.environ.get(FAULT_PID_FILE_ENV)
    if pid_file:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
    time.sleep(FAULT_PAUSE_SECONDS)  # killed here by the test
