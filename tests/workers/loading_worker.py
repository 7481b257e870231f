"""Worker of the per-stage loading tests: `python loading_worker.py CHECKPOINT OUT_DIR DTYPE`.

Each rank runs `prepare(CHECKPOINT, plan)` (only its stage is read), then one train_step, and
writes its stage's parameters, gradients and loss, and how many parameters of the whole model
it materialised, to OUT_DIR/rank{r}.safetensors.
"""

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import hf_actcomp
from hf_actcomp import Plan

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pipeline_cases import padded_batch  # noqa: E402


def main(checkpoint: str, out_dir: str, dtype: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = Plan(num_stages=world, micro_batches=world)
    # 3 stages: with every block recomputed in the backward (the numbers must not change)
    pipe = hf_actcomp.prepare(checkpoint, plan, torch_dtype=getattr(torch, dtype), timeout=60,
                              activation_checkpointing=world == 3)
    held = sum(p.numel() for p in pipe.model.parameters() if p.device.type != "meta")
    out = pipe.train_step(padded_batch(pipe.config.vocab_size))
    tensors = {f"param.{n}": p.detach() for n, p in pipe.stage.named_parameters()}
    tensors.update({(f"grad.{n}" if p.grad is not None else f"nograd.{n}"): (p.grad if p.grad is not None
                    else torch.zeros(1)) for n, p in pipe.stage.named_parameters()})
    tensors["loss"] = out.loss.reshape(1)
    tensors["held"] = torch.tensor([held])
    blocks = [m for m in pipe.stage.modules() if hasattr(m, "gradient_checkpointing")]
    tensors["checkpointed"] = torch.tensor([bool(blocks) and all(m.gradient_checkpointing for m in blocks)])
    tensors["stage_numel"] = torch.tensor([sum(p.numel() for p in pipe.stage.parameters())])
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, f"rank{rank}.safetensors"))
    pipe.save_pretrained(os.path.join(out_dir, "saved"))  # no model= needed: the pipeline keeps its skeleton


if __name__ == "__main__":
    main(*sys.argv[1:])
