"""What `ActCompTrainer` refuses before any work, and the AQ-SGD data helpers it uses.

Each check names the bad setting and what to do instead (docs/trainer.md, "What is refused").
"""

from __future__ import annotations

from typing import Any

import datasets
from transformers import TrainingArguments

from . import hub
from .data import SAMPLE_ID, add_sample_ids
from .plan import Plan, launched_per_replica
from .trackers import check_trackers

_REFUSED = {
    "deepspeed": "DeepSpeed shards parameters and optimizer state over all ranks, which here hold different stages",
    "fsdp": "FSDP shards every parameter over all ranks, which here hold different stages",
    "fp16": "fp16 needs a loss scaler shared by all stages; use bf16=True",
}


def _check_ids_are_rows(dataset: datasets.Dataset, plan: Plan) -> None:
    """Data-parallel AQ-SGD shards the data set by rows and keeps each replica's memory for the
    ids of its rows, so `sample_id` must be the row index (as `add_sample_ids` makes it)."""
    if plan.memory.num_samples != len(dataset):
        raise ValueError(f"AQ-SGD with data_parallel > 1 shards memory.num_samples={plan.memory.num_samples} "
                         f"like the {len(dataset)} rows of train_dataset: they must be equal.")
    ids = dataset[SAMPLE_ID]
    wrong = next((row for row, sample in enumerate(ids) if sample != row), None)
    if wrong is not None:
        raise ValueError(f"AQ-SGD with data_parallel > 1 needs sample_id == row index (row {wrong} has sample_id "
                         f"{ids[wrong]}): each replica keeps memory for its shard of rows. Drop the column and let "
                         "ActCompTrainer add it, or call hf_actcomp.add_sample_ids(dataset).")


def _check_arguments(args: TrainingArguments, plan: Plan, kwargs: dict[str, Any]) -> None:
    """Refuse, before any work, what cannot run split into stages, and a wrong process count."""
    for name, reason in _REFUSED.items():
        if getattr(args, name, None):
            raise ValueError(f"ActCompTrainer does not support TrainingArguments({name}=...): {reason}.")
    if getattr(args, "train_sampling_strategy", "random") == "batch_rebalance":
        raise ValueError("ActCompTrainer does not support train_sampling_strategy='batch_rebalance': it deals batches "
                         "per rank, while the stages of a pipeline must read the same batches. Use 'random' or "
                         "'group_by_length'.")
    if args.label_smoothing_factor:
        raise ValueError("ActCompTrainer does not support label_smoothing_factor: the last stage computes the "
                         "model's own loss.")
    check_trackers(args.report_to)
    if args.push_to_hub and hub.hub_constants.HF_HUB_OFFLINE:
        raise RuntimeError("TrainingArguments(push_to_hub=True) but HF_HUB_OFFLINE is set: unset it to upload, or "
                           "train with push_to_hub=False and push the saved folder later (hf_actcomp.hub.push_to_hub).")
    world = args.world_size
    if launched_per_replica(plan):  # DiLoCo, one launch per replica (REPLICA_GROUP_ID)
        if world != plan.num_stages:
            raise ValueError(f"A DiLoCo replica launched on its own (REPLICA_GROUP_ID) needs Plan.num_stages="
                             f"{plan.num_stages} processes, but this job has {world}.")
    elif world != 1 and world != plan.world_size:
        raise ValueError(
            f"Plan.num_stages={plan.num_stages} x data_parallel={plan.data_parallel} needs {plan.world_size} "
            f"processes (or 1, to run the stages in-process), but this job has {world}. Launch with "
            f"--num_processes {plan.world_size} or change the plan."
        )
    if world > 1:
        for key, reason in (("compute_loss_func", "the loss is computed on the last stage only"),
                            ("optimizers", "each rank builds the optimizer of its own stage"),
                            ("optimizer_cls_and_kwargs", "each rank builds the optimizer of its own stage")):
            if kwargs.get(key) not in (None, (None, None)):
                raise ValueError(f"ActCompTrainer with several processes does not take {key}=: {reason}. Choose "
                                 "the optimizer with TrainingArguments(optim=..., optim_args=...).")


def _with_sample_ids(dataset):
    if isinstance(dataset, datasets.Dataset):
        return dataset if SAMPLE_ID in dataset.column_names else add_sample_ids(dataset)
    raise TypeError(
        f"AQ-SGD keys its memory by sample: train_dataset must be a datasets.Dataset (got "
        f"{type(dataset).__name__}), or yield a 'sample_id' per row and use a plan with memory.num_samples."
    )


def _with_num_samples(plan: Plan, num_samples: int) -> Plan:
    """The plan with `memory.num_samples` filled (a copy); an explicit value must cover the ids."""
    data = plan.to_dict()
    if data["memory"].get("num_samples") is None:
        data["memory"]["num_samples"] = num_samples
    elif data["memory"]["num_samples"] < num_samples:
        raise ValueError(f"Plan memory.num_samples={data['memory']['num_samples']} does not cover the training "
                         f"set's sample ids (it needs {num_samples}); leave it unset to use the data set's size.")
    return Plan.from_dict(data)


def _longest_row(dataset) -> int:
    if isinstance(dataset, datasets.Dataset):
        return max(len(ids) for ids in dataset["input_ids"])
    return max(len(dataset[i]["input_ids"]) for i in range(len(dataset)))
