"""A lost worker, for real: `torchrun --max-restarts 1` runs the 2-stage recipe with checkpoints,
this test SIGKILLs one worker by pid (once between checkpoints, once while one is being written),
and the restarted group must resume by itself and end with the weights of a run nobody touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
RECIPE = os.path.join(ROOT, "recipes", "finetune_gpt2.py")
ARGS = ["--max_train_samples", "32", "--max_eval_samples", "8", "--epochs", "2", "--seq_len", "32",
        "--batch_size", "4", "--save_steps", "2", "--logging_steps", "4", "--timeout", "60"]
DEADLINE = 240  # seconds for all three runs together (they run side by side)


def launch(out_dir, log, fault: str | None = None, pid_file=None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    if fault:
        env.update(HF_ACTCOMP_FAULT_AT=fault, HF_ACTCOMP_FAULT_PID_FILE=str(pid_file))
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
           RECIPE, "--output_dir", str(out_dir), *ARGS]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def final_weights(out_dir) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("model-") and name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out_dir, name)))
    return tensors


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun is not installed next to this Python")
def test_a_killed_worker_restarts_resumes_and_ends_with_the_untouched_runs_weights(tmp_path):
    faults = {"between": "4:1:after", "writing": "6:0:writing"}  # step:rank:moment
    procs, logs, pid_files = {}, {}, {}
    try:
        for name in ("untouched", *faults):
            logs[name] = open(tmp_path / f"{name}.log", "w+")  # noqa: SIM115 - closed below
            pid_files[name] = tmp_path / f"{name}.pid"
            procs[name] = launch(tmp_path / name, logs[name], faults.get(name), pid_files[name])
        killed: dict[str, int] = {}
        deadline = time.monotonic() + DEADLINE
        while len(killed) < len(faults) and time.monotonic() < deadline:
            for name in faults:
                if name not in killed and pid_files[name].exists():
                    pid = int(pid_files[name].read_text())
                    os.kill(pid, signal.SIGKILL)  # the worker paused at its fault, by pid: ours only
                    killed[name] = pid
            time.sleep(0.1)
        assert len(killed) == len(faults), f"no worker reached its fault point: {killed}"
        for proc in procs.values():
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # our torchrun's own process group
        text = {}
        for name, log in logs.items():
            log.seek(0)
            text[name] = log.read()
            log.close()
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name} run failed:\n{text[name][-4000:]}"

    # The group restarted and resumed from the newest complete checkpoint by itself.
    assert f"resuming from {tmp_path / 'between' / 'checkpoint-4'}" in text["between"]
    assert "Resumed from" in text["between"] and "at step 4" in text["between"]
    # Killed while writing checkpoint-6: it was torn, so the run went back to checkpoint-4.
    assert f"Skipping the incomplete checkpoint {tmp_path / 'writing' / 'checkpoint-6'}" in text["writing"]
    assert f"resuming from {tmp_path / 'writing' / 'checkpoint-4'}" in text["writing"]
    assert "Resumed from" not in text["untouched"]

    expected = final_weights(tmp_path / "untouched")
    assert expected
    for name in faults:
        got = final_weights(tmp_path / name)
        assert got.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(got[key], tensor), f"{name}: {key} differs from the untouched run"
