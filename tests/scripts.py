"""Run the recipes as users do (`python` or plain `torchrun`, no extra environment) and compare
their saved runs: logged values, metrics files, final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from distributed import free_port
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
NO_DROPOUT = "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0"  # the split model draws its masks in another order


def run(script: str, out, args: list[str], processes: int = 1, timeout: float = 240,
        launcher: str = "torchrun") -> str:
    """`python recipes/SCRIPT` (processes=1), or N processes under `torchrun --nproc-per-node N`
    or `accelerate launch --multi_gpu --num_processes N` (no config file, no --cpu), without
    ACCELERATE_USE_CPU; returns its output. Our own process group is killed on a hang."""
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "TORCHELASTIC_RESTART_COUNT")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    path = os.path.join(ROOT, "recipes", script)
    if processes == 1:
        cmd = [sys.executable, path]
    elif launcher == "torchrun":
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(processes), path]
    else:
        cmd = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), path]
    proc = subprocess.Popen([*cmd, "--output_dir", str(out), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
        output, _ = proc.communicate()
        raise AssertionError(f"{script} on {processes} process(es) hung:\n{output[-4000:]}") from None
    assert proc.returncode == 0, f"{script} on {processes} process(es) failed:\n{output[-4000:]}"
    return output


def run_side_by_side(*runs: tuple[str, object, list[str]]) -> list[str]:
    """One-process runs `(script, out, args)` at the same time, one per core (each has one
    thread); returns their outputs in order."""
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        return list(pool.map(lambda job: run(*job), runs))


def logged(out, key: str) -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [h[key] for h in history if key in h]


def weights(out) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors") and name.startswith(("model", "adapter_model")):
            tensors.update(load_file(out / name))
    return tensors


def assert_same_run(reference, other, losses=("loss",), metrics=("eval_loss",), results="eval_results.json",
                    load=None) -> None:
    """The logged `losses`, the `metrics` of `results` and the saved weights (the safetensors
    files, or what `load(folder)` returns as a state dict) of two runs agree. Figures to 1e-5
    relative or 1e-6 absolute: a difference of two near-equal terms (DPO's reward margins, -0.03
    from rewards of 0.15 and 0.19) keeps their absolute rounding, not a relative one (5e-7 apart
    on an AMD EPYC, 1.6e-5 relative)."""
    for key in losses:
        assert logged(other, key) == pytest.approx(logged(reference, key), rel=1e-5, abs=1e-6), key
    expected, got = (json.loads((d / results).read_text()) for d in (reference, other))
    for key in metrics:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    a, b = (load or weights)(reference), (load or weights)(other)
    assert a and a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-4, msg=name)
