"""What `ActCompTrainer` refuses before any work, and the AQ-SGD data helpers it uses.

Each check names the bad setting and what to do instead (docs/trainer.md, "Every argument: honoured or
refused", and "Subclassing").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import datasets
from transformers import Trainer, TrainingArguments

from .. import hub
from ..data import SAMPLE_ID, add_sample_ids
from ..pipeline.construction import check_compiled_schedule
from ..plan import Plan, launched_per_replica
from ..trackers import check_trackers

_REFUSED = {
    "deepspeed": "DeepSpeed shards parameters and optimizer state over all ranks, which here hold different stages",
    "fsdp": "FSDP shards every parameter over all ranks, which here hold different stages",
    "fp16": "fp16 needs a loss scaler shared by all stages; use bf16=True",
    "use_liger_kernel": "Liger kernels replace the whole model's forward, which the split model never calls",
    "fp16_full_eval": "the model in fp16 needs a loss scaler shared by all stages, as fp16 does; use bf16_full_eval",
    "parallelism_config": "Accelerate's tensor/context/sequence parallelism spans all ranks, which here hold different "
                          "stages",
}
# Refused with several processes when set to anything but Trainer's default (in one process Trainer
# handles them as usual).
_REFUSED_PIPELINED = {
    "auto_find_batch_size": "an out-of-memory retry would shrink one stage's batch alone, while the stages of a "
                            "pipeline must read the same batches; set per_device_train_batch_size",
    "bf16_full_eval": "each boundary's dtype is fixed when the pipeline is built; use bf16=True (the stages run "
                      "under bfloat16 autocast) or cast the model before building the trainer",
    "enable_jit_checkpoint": "each rank's SIGTERM timer would start the stages' collective checkpoint at a different "
                             "step; use save_steps and resume_from_checkpoint='auto' (docs/reliability.md)",
    **dict.fromkeys(("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph"),
                    "Trainer never wraps a stage in DDP: replicas average gradients as Plan(dp_compression=...) says"),
}


def check_ids_are_rows(dataset: datasets.Dataset, plan: Plan) -> None:
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


def check_arguments(args: TrainingArguments, plan: Plan, kwargs: dict[str, Any]) -> None:
    """Refuse, before any work, what cannot run split into stages, and a wrong process count."""
    world = args.world_size
    for name, reason in _REFUSED.items():
        if getattr(args, name, None):
            raise ValueError(f"ActCompTrainer does not support TrainingArguments({name}=...): {reason}.")
    if getattr(args, "train_sampling_strategy", "random") == "batch_rebalance":
        raise ValueError("ActCompTrainer does not support train_sampling_strategy='batch_rebalance': it deals batches "
                         "per rank, while the stages of a pipeline must read the same batches. Use 'random' or "
                         "'group_by_length'.")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    for name, reason in _REFUSED_PIPELINED.items():
        if world > 1 and getattr(args, name, defaults[name]) != defaults[name]:
            raise ValueError(f"ActCompTrainer with several processes does not support TrainingArguments({name}=...): "
                             f"{reason}.")
    if world > 1 and getattr(getattr(args, "accelerator_config", None), "dispatch_batches", None):
        raise ValueError("ActCompTrainer with several processes does not support accelerator_config.dispatch_batches="
                         "True: it deals one batch's slices out over all ranks, while the stages of a pipeline must "
                         "each read the whole batch. Leave it unset (every stage reads the batches itself).")
    check_compiled_schedule(plan, bool(getattr(args, "torch_compile", False)) and world > 1)
    if args.label_smoothing_factor:
        raise ValueError("ActCompTrainer does not support label_smoothing_factor: the last stage computes the "
                         "model's own loss.")
    check_trackers(args.report_to)
    if args.push_to_hub and hub.hub_constants.HF_HUB_OFFLINE:
        raise RuntimeError("TrainingArguments(push_to_hub=True) but HF_HUB_OFFLINE is set: unset it to upload, or "
                           "train with push_to_hub=False and push the saved folder later (hf_actcomp.hub.push_to_hub).")
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


# Trainer methods a subclass may extend with several processes, as long as its override calls the
# parent's (`super().name(...)`): ActCompTrainer's own does what the stages need there.
_EXTENDABLE = {
    "training_step": "runs this rank's stage of the batch's forward and backward (Pipeline.train_step)",
    "prediction_step": "runs the batch through the stages and shares the last stage's logits with every rank",
    "evaluation_loop": "turns Trainer's gathers across processes off (every rank evaluates the whole set)",
}


def _overriding_class(cls: type, name: str) -> type | None:
    """The class of `cls`'s MRO whose `name` runs, unless it is Trainer's or this package's."""
    owner = next(c for c in cls.__mro__ if name in vars(c))
    return None if owner is Trainer or owner.__module__.split(".")[0] == "hf_actcomp" else owner


def _calls_parent(function, name: str) -> bool:
    """Whether `function`'s code calls `super().name` (both names are looked up in its body)."""
    code = getattr(function, "__code__", None)
    return code is not None and {"super", name} <= set(code.co_names)


def check_overrides(cls: type, pipelined: bool) -> None:
    """With several processes, refuse a subclass's override that the stages would bypass: any
    `compute_loss` (the last stage computes the loss inside the pipeline step), and a
    `training_step` / `prediction_step` / `evaluation_loop` that does not call the parent's. In
    one process each runs as under Trainer. `log` and every other method run on every rank."""
    if not pipelined:
        return
    owner = _overriding_class(cls, "compute_loss")
    if owner is not None:
        raise ValueError(
            f"{owner.__qualname__}.compute_loss would be bypassed: with several processes ActCompTrainer never calls "
            "compute_loss, the last stage computes the model's loss inside the pipeline step. Set the loss on the "
            "model instead (model.loss_function = fn(logits, labels, vocab_size, num_items_in_batch=None, **kw), "
            "which every stage layout calls), or run in one process, where compute_loss is honoured.")
    for name, what in _EXTENDABLE.items():
        owner = _overriding_class(cls, name)
        if owner is not None and not _calls_parent(vars(owner)[name], name):
            raise ValueError(
                f"{owner.__qualname__}.{name} does not call super().{name}(...): with several processes "
                f"ActCompTrainer's {name} {what}, and an override that replaces it would bypass the stages. Call "
                f"super().{name}(...) inside the override (before or after your own code), or run in one process.")


def with_sample_ids(dataset):
    if isinstance(dataset, datasets.Dataset):
        return dataset if SAMPLE_ID in dataset.column_names else add_sample_ids(dataset)
    raise TypeError(
        f"AQ-SGD keys its memory by sample: train_dataset must be a datasets.Dataset (got "
        f"{type(dataset).__name__}), or yield a 'sample_id' per row and use a plan with memory.num_samples."
    )


def with_num_samples(plan: Plan, num_samples: int) -> Plan:
    """The plan with `memory.num_samples` filled (a copy); an explicit value must cover the ids."""
    data = plan.to_dict()
    if data["memory"].get("num_samples") is None:
        data["memory"]["num_samples"] = num_samples
    elif data["memory"]["num_samples"] < num_samples:
        raise ValueError(f"Plan memory.num_samples={data['memory']['num_samples']} does not cover the training "
                         f"set's sample ids (it needs {num_samples}); leave it unset to use the data set's size.")
    return Plan.from_dict(data)


def longest_row(dataset) -> int:
    if isinstance(dataset, datasets.Dataset):
        return max(len(ids) for ids in dataset["input_ids"])
    return max(len(dataset[i]["input_ids"]) for i in range(len(dataset)))
