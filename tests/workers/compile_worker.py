"""Worker of tests/test_compile.py: `python compile_worker.py OUT_DIR FAMILY BACKEND`.

The same 2-stage identity-codec pipeline twice, eager and with `prepare(..., compile=True)` (torch.compile
`BACKEND`): the first step's gradients of this rank's stage (a padded batch) and the losses of 3 SGD steps.
Writes per rank `{eager,compiled}-rank{r}.safetensors` and `rank{r}.json` (losses, graphs compiled).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch._dynamo.testing import CompileCounterWithBackend

import hf_actcomp
from hf_actcomp import Plan
from hf_actcomp.debug import debug_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_cases import padded_batch, sgd_losses  # noqa: E402
from pipeline_worker import stage_grads  # noqa: E402


def run(out_dir: str, family: str, backend: str | None) -> dict:
    """One pipeline (eager when `backend` is None): its first step's grads saved, its losses returned."""
    rank = dist.get_rank()
    counter = CompileCounterWithBackend(backend) if backend else None
    model = debug_model(family, seed=0)
    plan = Plan(num_stages=dist.get_world_size(), micro_batches=2)
    pipe = hf_actcomp.prepare(model, plan, timeout=120, compile=counter is not None,
                              compile_kwargs={"backend": counter} if counter else None)
    pipe.train_step(padded_batch(model.config.vocab_size))
    name = "compiled" if counter else "eager"
    save_file({k: v.contiguous() for k, v in stage_grads(pipe).items()},
              os.path.join(out_dir, f"{name}-rank{rank}.safetensors"))
    pipe.zero_grad()
    losses = sgd_losses(pipe, lambda batch: pipe.train_step(batch).loss, steps=3)
    return {"losses": losses, "graphs": counter.frame_count if counter else 0}


def main() -> None:
    out_dir, family, backend = sys.argv[1:]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    result = {"eager": run(out_dir, family, None), "compiled": run(out_dir, family, backend)}
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
