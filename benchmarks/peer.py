"""The peer every benchmark compares with: the same model split in two as a user of
`torch.distributed.pipelining` would write it (PipelineStage + Schedule1F1B, fp32 activations and
gradients), optionally with DDP over replicas as torchtitan does for PP x DP. One place, so that
every results file's peer is the same code."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_actcomp import Plan
from hf_actcomp.models import get_adapter
from hf_actcomp.models.split import stage_ranges

TIE = ("lm_head.weight", "transformer.wte.weight")  # GPT-2's head and input embedding


def build_peer(model, micro_batches: int, tied: bool, pipe_group=None, dp_group=None, tie: tuple[str, str] = TIE,
               split: list[int] | None = None):
    """`model` split in two as a user of torch.distributed.pipelining would: this rank's stage
    module (the same modules as ours), a `step(batch)` running Schedule1F1B over it, and (with
    `tied`) this rank's copy of the tied embedding, whose gradient `step` all-reduces so that the
    two copies stay equal (`tie`: the head's and the input embedding's names). `split`: where the
    blocks are cut (default: the plan's balanced split). Returns (module, step, tied parameter or None).

    With `pipe_group` (this rank's 2 pipeline ranks) and `dp_group` (its stage's replicas) the
    stage module is wrapped in DDP over `dp_group`, as torchtitan does for PP x DP: PipelineStage
    runs every micro-batch's backward but the last under `no_sync`, so DDP all-reduces once per step."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank(pipe_group) if pipe_group is not None else dist.get_rank()
    adapter = get_adapter(model)
    r = stage_ranges(adapter, Plan(num_stages=2, micro_batches=micro_batches, split_points=split))[rank]
    module = adapter.build_stage(r.start, r.stop, first=rank == 0, last=rank == 1)
    wrapped = module if dp_group is None else DistributedDataParallel(module, process_group=dp_group)
    stage = PipelineStage(wrapped, stage_index=rank, num_stages=2, device=torch.device("cpu"), group=pipe_group)
    copy = dict(module.named_parameters())[tie[1] if rank == 0 else tie[0]] if tied else None

    def loss_fn(logits, labels):
        return model.loss_function(logits, labels, vocab_size=model.config.vocab_size)

    schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=loss_fn)

    def step(batch: dict) -> None:
        if rank == 0:
            schedule.step(batch["input_ids"], attention_mask=batch["attention_mask"])
        else:
            schedule.step(attention_mask=batch["attention_mask"], target=batch["labels"])
        if copy is not None:  # both copies get the summed gradient, so they stay equal
            dist.all_reduce(copy.grad, group=pipe_group)

    return module, step, copy
