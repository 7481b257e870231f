"""Worker of tests/test_heads.py's two-process runs: `python heads_worker.py OUT_DIR`.

Per case (a family's sequence or token classifier): one `train_step` and one
`eval_step(keep_logits=True)` of a 4-row batch in 2 micro-batches; every rank saves its stage's
gradients, the losses, the bytes its train step counted under `collectives` and (the last
stage) the logits.
"""

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import hf_actcomp
from hf_actcomp import Plan
from hf_actcomp.debug import debug_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_heads import PIPELINE_CASES, case_batch  # noqa: E402


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case, (family, task, overrides) in PIPELINE_CASES.items():
        model = debug_model(family, task=task, **overrides)
        batch = case_batch(case, model)
        pipe = hf_actcomp.prepare(model, Plan(num_stages=2, micro_batches=2), timeout=60)
        collectives = pipe.traffic["collectives"]
        before = collectives.bytes_sent
        loss = pipe.train_step(batch).loss
        step_collectives = collectives.bytes_sent - before
        out = pipe.eval_step(batch, keep_logits=True)
        tensors = {f"grad.{n}": p.grad for n, p in pipe.stage.named_parameters() if p.grad is not None}
        tensors["loss"] = loss.reshape(1)
        tensors["collective_bytes"] = torch.tensor([step_collectives])
        tensors["eval_loss"] = out.loss.reshape(1)
        if out.logits is not None:
            tensors["logits"] = out.logits
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, f"{case}-rank{rank}.safetensors"))


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    finally:
        dist.destroy_process_group()
