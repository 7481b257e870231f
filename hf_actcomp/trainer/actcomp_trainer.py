"""`ActCompTrainer`: `transformers.Trainer` with the model run as a plan's compressed pipeline stages.

The same script works in one process and under `accelerate launch` / `torchrun`:

- one process: the plan runs in-process (`simulate`), and Trainer's own loop does the rest;
- `plan.world_size` processes: each rank holds one stage (`prepare`), Trainer's loop drives
  `Pipeline.train_step` for every accumulation micro-step, the global clip norm and a per-stage
  optimizer. Every stage of a pipeline reads the same batches in the same seeded order; replicas
  read disjoint shards of equal length (the sampler runs over the data-parallel group, not the
  world).

What differs from Trainer, and why, is in `docs/trainer.md`.

Trainer's private methods. Moving the model, the dataloaders' signature columns, the token and
label counts, clipping, the gradient norm, checkpoints and their optimizer, loading a checkpoint
or the best model have no public hook in `transformers.Trainer`; each is overridden here (same
name, same arguments) and routed to the backend, which in one process calls Trainer's own
(`backends.Backend.base`). tests/test_trainer.py compares both paths with plain Trainer, so a
transformers release that changes one of them fails there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from functools import partial
from typing import Any

import datasets
import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, seed_worker

from .. import hub
from ..data import SAMPLE_ID
from ..models import unwrap_peft
from ..models.heads import CAUSAL_LM, task_of
from ..plan import CONFIG_NAME, Plan
from ..samples import SAMPLES_KEY, LogSamplesCallback, complete
from ..state.compression import COMPRESSION_STATE_DIR
from ..state.resume import resolve_resume_from_checkpoint, writing_checkpoint
from .backends import OneProcess, backend_for
from .checks import (
    check_arguments,
    check_ids_are_rows,
    check_overrides,
    longest_row,
    with_num_samples,
    with_sample_ids,
)
from .evaluation import EvalExtras, trainer_item_count
from .launch_env import count_every_process


class PadToLength:
    """Wrap a collator so that every training batch is right-padded to one fixed length.

    AQ-SGD keeps one activation per sample of a fixed shape, while Trainer's collators pad each
    batch to its own longest row. Right padding with `attention_mask=0` and `labels=-100` changes
    neither the loss nor any gradient of a causal model: no real token attends to a later one.
    The rows' `sample_id`s (AQ-SGD's memory keys) are carried into the batch where the collator
    builds its batch from known keys only (TRL's SFT collator does). A collator that makes
    `rows_per_example` rows of each example (TRL's preference collators: every chosen row, then
    every rejected one) gets one key per row: example i's j-th row is `rows_per_example * i + j`.
    `length=None`: the ids only (an image model's rows all have one length already).
    """

    def __init__(self, collator: Callable, length: int | None, pad_token_id: int, rows_per_example: int = 1) -> None:
        self.collator = collator
        self.length = length
        self.pad_token_id = pad_token_id
        self.rows_per_example = rows_per_example

    def __call__(self, features: list) -> dict[str, torch.Tensor]:
        batch = self.collator(features)
        if SAMPLE_ID not in batch and features and all(SAMPLE_ID in f for f in features):
            ids = torch.tensor([int(f[SAMPLE_ID]) for f in features], dtype=torch.long)
            k = self.rows_per_example
            batch[SAMPLE_ID] = torch.cat([k * ids + j for j in range(k)])
        if self.length is None:
            return batch
        extra = self.length - batch["input_ids"].shape[1]
        if extra < 0:
            raise ValueError(
                f"The collator produced rows of {batch['input_ids'].shape[1]} tokens, longer than "
                f"pad_to_length={self.length}; pass ActCompTrainer(pad_to_length=...) at least that long."
            )
        if extra:
            fill = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": -100, "completion_mask": 0}
            for key, value in fill.items():
                if key in batch:
                    batch[key] = torch.nn.functional.pad(batch[key], (0, extra), value=value)
        return batch


class ActCompTrainer(Trainer):
    """A `transformers.Trainer` that trains the model split into the stages of `plan`, with the
    plan's compression at every stage boundary.

    Write `ActCompTrainer(..., plan=plan)` where you wrote `Trainer(...)`. Run the script as is
    (one process: the stages run in-process) or with `plan.world_size` processes under
    `accelerate launch` / `torchrun` (one stage per rank). `model` may be a `peft.PeftModel`, or
    a checkpoint's local directory or Hub id: with several processes each rank then builds the
    model on the meta device and reads only its own stage's tensors (`prepare("path", plan)`);
    in one process it is loaded whole with `from_pretrained`.

    Args:
        plan: how the model is split and what crosses each boundary. For AQ-SGD, an unset
            `memory.num_samples` is filled with `len(train_dataset)` and a `sample_id` column is
            added to `train_dataset` when missing.
        pad_to_length: AQ-SGD only: the length every training batch is padded to (default: the
            longest `input_ids` row of `train_dataset`).
        timeout: seconds any wait on a peer stage may take before the step fails.
        torch_dtype: the dtype a checkpoint given by name is loaded in (default: as saved).
        eval_plain_loss: evaluation also runs every batch without the boundary codecs and reports
            `eval_plain_loss` / `_plain_token_loss` / `_plain_perplexity` beside the loss with
            them; False skips that second forward pass (and, distributed, its uncompressed traffic).
        **kwargs: everything `transformers.Trainer` takes.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, *, plan: Plan,
                 pad_to_length: int | None = None, timeout: float = 300.0, torch_dtype: torch.dtype | None = None,
                 eval_plain_loss: bool = True, **kwargs: Any) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a hf_actcomp.Plan, got {type(plan).__name__}.")
        if model is None:
            raise ValueError("ActCompTrainer needs a model (model_init is not supported: every rank splits the "
                             "model it is given).")
        args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        self.eval_plain_loss = eval_plain_loss
        count_every_process(args)  # torchrun / accelerate launch on a CPU-only machine
        check_arguments(args, plan, kwargs)
        check_overrides(type(self), pipelined=backend_for(args.world_size, plan) is not OneProcess)
        autocast_dtype = torch.bfloat16 if args.bf16 else None
        # Before Trainer.__init__: with several processes a checkpoint given by name is loaded
        # stage by stage, and Trainer must not move the model.
        self._backend = backend_for(args.world_size, plan)(self, super(), plan, timeout=timeout,
                                                     autocast_dtype=autocast_dtype)
        model = self._backend.load(model, torch_dtype)
        # The parent prepares the data (TRL's SFTTrainer tokenizes, packs and wraps the model with
        # PEFT here); everything that reads the training rows comes after it.
        super().__init__(model=model, args=args, **kwargs)
        self.plan = self._backend.plan = self._plan_for_training_rows(plan)
        self._parameters_per_rank: int | None = None  # floating_point_ops' count, taken once
        self.eval_extras = EvalExtras()  # what evaluation_loop adds to Trainer's metrics
        # What create_model_card was given, kept for every card a later save renders.
        self._card_fields: dict[str, Any] = {}
        self._card_base_model: str | None = None
        self._card_datasets: str | list[str] | None = None
        self._backend.start()
        self._train_collator = self.data_collator
        # AQ-SGD's memory keeps one row per sample at one length: token rows are padded to it (an
        # image model's rows all have its patches already).
        text = getattr(unwrap_peft(self.model), "main_input_name", "input_ids") == "input_ids"
        if self.plan.uses_aqsgd and self.train_dataset is not None:
            length = (pad_to_length or self._longest_training_row()) if text else None
            pad_id = getattr(self.processing_class, "pad_token_id", None)
            self._train_collator = PadToLength(self.data_collator, length, pad_id if pad_id is not None else 0,
                                               self._rows_per_example)

    _rows_per_example = 1  # rows the collator makes of each training example (a preference pair: 2)

    def _longest_training_row(self) -> int:
        """The length AQ-SGD pads every training batch to: the longest row of the training set."""
        return longest_row(self.train_dataset)

    def _plan_for_training_rows(self, plan: Plan) -> Plan:
        """AQ-SGD keys its memory by sample: a `sample_id` column on the (prepared) training set,
        and `memory.num_samples` covering its ids (one per row the collator makes of an example)."""
        if not plan.uses_aqsgd or self.train_dataset is None:
            return plan
        self.train_dataset = with_sample_ids(self.train_dataset)
        examples = max(len(self.train_dataset), max(self.train_dataset[SAMPLE_ID]) + 1)
        plan = with_num_samples(plan, examples * self._rows_per_example)
        if plan.data_parallel > 1:
            check_ids_are_rows(self.train_dataset, plan)
        return plan

    @property
    def sim(self):
        """The in-process stages (`SimulatedPipeline`) in one process, else None."""
        return self._backend.sim

    @property
    def pipe(self):
        """This rank's `Pipeline` with several processes, else None."""
        return self._backend.pipe

    def _move_model_to_device(self, model, device) -> None:
        self._backend.move_model_to_device(model, device)

    # ------------------------------------------------------------------------- data
    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        if SAMPLE_ID not in self._signature_columns:  # AQ-SGD's memory key must survive remove_unused_columns
            self._signature_columns.append(SAMPLE_ID)

    def _get_dataloader(self, dataset, description: str, batch_size: int, sampler_fn=None, is_training: bool = False,
                        dataloader_key: str | None = None) -> DataLoader:
        """Trainer's dataloader (every `dataloader_*` setting, the persistent-worker evaluation
        loader kept for the next evaluation), sharded over the data-parallel group (training) or
        not at all (evaluation: every replica evaluates the whole set), never over the whole
        world: every stage of a pipeline must read the same batches."""
        collator = self._train_collator if is_training else self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        dataset, shards, index = self._backend.training_shard(dataset) if is_training else (dataset, 1, 0)
        args = self.args
        params: dict[str, Any] = {
            "batch_size": batch_size, "collate_fn": collator, "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory, "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "prefetch_factor": args.dataloader_prefetch_factor, "in_order": args.dataloader_in_order,
        }
        if not isinstance(dataset, IterableDataset):
            params["sampler"] = sampler_fn(dataset) if sampler_fn is not None else None
            params["drop_last"] = args.dataloader_drop_last
            if is_training:  # seeded by replica, not rank: the stages of a pipeline must collate alike
                params["worker_init_fn"] = partial(seed_worker, num_workers=args.dataloader_num_workers, rank=index)
        acc = self.accelerator
        config = acc.dataloader_config
        dataloader = prepare_data_loader(
            DataLoader(dataset, **params), acc.device, num_processes=shards, process_index=index if shards > 1 else 0,
            split_batches=acc.split_batches, put_on_device=acc.device_placement, rng_types=acc.rng_types.copy(),
            even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler, data_seed=config.data_seed,
            non_blocking=acc.non_blocking, use_stateful_dataloader=config.use_stateful_dataloader,
        )
        if dataloader_key is not None and args.dataloader_persistent_workers:  # as Trainer keeps it
            self._eval_dataloaders = {**getattr(self, "_eval_dataloaders", {}), dataloader_key: dataloader}
        return dataloader

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        """Trainer's count of input tokens seen (`include_num_input_tokens_seen`, and so
        `train_tokens_per_second`), over the replicas: Trainer adds every process's batch, and the
        stages of one pipeline read the same one. (Trainer's private method: its only count.)"""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        added = self.state.num_input_tokens_seen - before
        self.state.num_input_tokens_seen = before + added // self._backend.ranks_per_batch

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self._backend.num_replicas

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """Label tokens of the optimizer step, as Trainer counts them, over the replicas (not the
        ranks: the stages of one pipeline read the same batch)."""
        return self._backend.num_items_in_batch(batch_samples, device)

    # ------------------------------------------------------------------------- training
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # Not `self.model`: Trainer then skips accelerator.prepare(model), whose DDP would span
        # every rank although ranks hold different stages.
        return self._backend.runner

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(self._backend.optimized_module(model))
        self._backend.attach_optimizer(optimizer)  # DiLoCo's outer step hooks to the inner optimizer
        return optimizer

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        return self._backend.autocast(cache_enabled)

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        return self._backend.training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        return self._backend.clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        return super()._get_grad_norm(model, self._backend.grad_norm(grad_norm))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's logs, with the compression statistics at every training logging step."""
        if "loss" in logs:
            logs = {**logs, **self.communication_logs()}
        super().log(logs, start_time)

    def communication_logs(self) -> dict[str, float]:
        """`comm/*` entries: bytes sent (all traffic between ranks, this pipeline), compression
        ratio, bytes sent and compression ratio per category (`activations`,
        `activation_gradients`, the tie's rows, ...: a plan's forward and backward ratios apart),
        bytes sent and relative error per boundary direction (cumulative) and, distributed, each
        stage's seconds computing vs waiting. Collective over the pipeline when distributed."""
        stats = self._backend.stats()
        logs = {"comm/bytes_sent": stats["bytes_sent"], "comm/bytes_uncompressed": stats["bytes_uncompressed"],
                "comm/compression_ratio": stats["compression_ratio"]}
        for name, category in stats["categories"].items():
            logs[f"comm/{name}/bytes_sent"] = category["bytes_sent"]
            logs[f"comm/{name}/compression_ratio"] = category["compression_ratio"]
        for name, channel in stats["channels"].items():
            logs[f"comm/{name}/bytes_sent"] = channel["bytes_sent"]
            logs[f"comm/{name}/relative_error"] = channel["relative_error"]
        for stage, timing in stats.get("stages", {}).items():
            logs[f"comm/stage{stage}/seconds_computing"] = timing["seconds_computing"]
            logs[f"comm/stage{stage}/seconds_waiting"] = timing["seconds_waiting"]
        return logs

    def floating_point_ops(self, inputs: dict[str, Any]) -> float:
        """Trainer's estimate, 6 x tokens x non-embedding parameters, with the parameters counted
        once (Trainer counts them at every micro-step), and, with several processes, this rank's
        share: the stages of a pipeline read one batch, and Trainer sums `total_flos` over ranks."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self._parameters_per_rank is None:
            self._parameters_per_rank = self._backend.non_embedding_parameters(self.model)
        return 6 * inputs[main_input].numel() * self._parameters_per_rank

    # ------------------------------------------------------------------------- evaluation
    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        """Trainer's own loop (so `compute_metrics`, `preprocess_logits_for_metrics`, `predict()`
        and the rest keep their contract), fed by the stages; the metrics also get
        `{prefix}_plain_loss` (without the boundary codecs, unless `eval_plain_loss=False`),
        `{prefix}_token_loss` / `_plain_token_loss` (mean per predicted token) and
        `{prefix}_perplexity` / `_plain_perplexity` (a causal LM's only: a classifier's loss is
        not per token). See `hf_actcomp.trainer.evaluation`."""
        self.eval_extras = EvalExtras(per_token=task_of(unwrap_peft(self.model)) == CAUSAL_LM)
        with self._backend.evaluation():
            output = super().evaluation_loop(dataloader, description, prediction_loss_only=prediction_loss_only,
                                             ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        self._backend.after_evaluation()
        output.metrics.update(self.eval_extras.metrics(metric_key_prefix))
        return output

    def eval_item_count(self, inputs: dict[str, Any]) -> int | None:
        """What an evaluation batch's token-loss sum is divided by, as the parent trainer does it
        (None: the batch's own mean). Trainer: its `num_items_in_batch` count of the batch; a
        classifier's evaluation loss is its own mean (it ignores the count Trainer's
        `prediction_step` passes; under DDP see `evaluation.replicas_loss_scale`)."""
        if task_of(unwrap_peft(self.model)) != CAUSAL_LM:
            return None
        return trainer_item_count(self, inputs)

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """(loss, logits, labels) of one batch as Trainer's `prediction_step` returns them, on
        every rank; with several processes the logits come from the last stage."""
        return self._backend.prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def generate_samples(self, prompts: list[str], **generate_kwargs: Any) -> list[str]:
        """The completions of `prompts` by the model as it is now, with the plan's inference codec
        at the boundaries: with several processes the model still split (`Pipeline.generate`;
        collective, call on every rank), in one process under `compressed_inference`. Needs
        `processing_class` (the tokenizer). See `hf_actcomp.samples.LogSamplesCallback`."""
        return complete(self._backend.generate, self.processing_class, prompts, device=self.args.device,
                        **generate_kwargs)

    # ------------------------------------------------------------------------- saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The trained model (or, for PEFT, the adapter) as one `from_pretrained` checkpoint,
        with the plan (`actcomp_config.json`). Collective when distributed: call on every rank."""
        self._backend.save_model(output_dir if output_dir is not None else self.args.output_dir, _internal_call)

    def run_results(self) -> dict:
        """What the card shows besides the traffic: the latest eval metrics, the log history, and
        what `create_model_card` was given (with the trainer's and the model's tags)."""
        evaluations = [h for h in self.state.log_history if "eval_loss" in h]
        samples = [s for cb in self.callback_handler.callbacks if isinstance(cb, LogSamplesCallback)
                   for s in cb.samples]
        tags = list(dict.fromkeys([*(self._card_fields.get("tags") or []),
                                   *(getattr(self.model, "model_tags", None) or []), *getattr(self, "_tag_names", [])]))
        card = {**self._card_fields, **({"tags": tags} if tags else {})}
        extra = {"base_model": self._card_base_model} if self._card_base_model else {}
        if self._card_datasets:
            extra["datasets"] = self._card_datasets
        return {"metrics": evaluations[-1] if evaluations else {}, "log_history": self.state.log_history,
                "steps": self.state.global_step, "card": card, **extra,
                **({SAMPLES_KEY: samples} if samples else {})}

    def create_model_card(self, language: str | None = None, license: str | None = None,
                          tags: str | list[str] | None = None, model_name: str | None = None,
                          finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                          dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
                          dataset_args: str | list[str] | None = None, dataset_name: str | None = None) -> None:
        """The hf-actcomp card (plan, measured traffic, eval with and without the codec, how to
        load it) instead of Trainer's, with every argument Trainer's and TRL's take (TRL's
        `dataset_name` is `dataset`). `push_to_hub` calls it after saving; TRL's trainers call it
        at every checkpoint, before the model is saved: the arguments are kept and the card is
        rendered where the plan is (now if `output_dir` holds a saved model, else by its next
        save)."""
        fields = {"language": language, "license": license, "tags": [tags] if isinstance(tags, str) else tags,
                  "model_name": model_name, "tasks": tasks, "dataset_args": dataset_args}
        self._card_fields.update({k: v for k, v in fields.items() if v is not None})
        self._card_base_model = finetuned_from or self._card_base_model
        self._card_datasets = dataset_tags or dataset or dataset_name or self._card_datasets
        if not self.is_world_process_zero() or not os.path.isfile(os.path.join(self.args.output_dir, CONFIG_NAME)):
            return
        results = self.run_results()
        hub.update_results(self.args.output_dir, card=results["card"],
                           **{k: results[k] for k in ("base_model", "datasets") if k in results})
        hub.write_model_card(self.args.output_dir, repo_id=getattr(self, "hub_model_id", None))

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs):
        """`Trainer.train`, where `resume_from_checkpoint="auto"` (or True) means the newest
        *complete* checkpoint in `output_dir` (torn ones are skipped with a warning), or a fresh
        start when there is none; `None` means `"auto"` when torchrun / `accelerate launch
        --max_restarts` restarted this job. See docs/reliability.md."""
        resume = resolve_resume_from_checkpoint(resume_from_checkpoint, self.args.output_dir)
        return super().train(resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval,
                             **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint plus every rank's compression state, marked complete (the
        `actcomp_complete.json` of `hf_actcomp.state.resume`) only once every rank has written its part."""
        output_dir = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with writing_checkpoint(output_dir, is_main=self.is_world_process_zero()):
            super()._save_checkpoint(model, trial)
            if not self.args.save_only_model:
                self._backend.save_compression_state(os.path.join(output_dir, COMPRESSION_STATE_DIR))

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Trainer's push at a checkpoint uploads `output_dir` after copying the checkpoint's model
        files into it, by its own list of names: the plan, results, curves and card go beside them,
        so that every revision on the Hub loads and describes itself."""
        if self.is_world_process_zero() and self.args.hub_strategy != "end":
            for name in (CONFIG_NAME, hub.RESULTS_NAME, hub.CURVES_NAME, hub.CARD_NAME):
                if os.path.isfile(os.path.join(checkpoint_folder, name)):
                    shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(self.args.output_dir, name))
        super()._push_from_checkpoint(checkpoint_folder)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._backend.save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._backend.load_optimizer_and_scheduler(checkpoint)
        self._backend.load_compression_state(os.path.join(checkpoint, COMPRESSION_STATE_DIR))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self._backend.load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        self._backend.load_best_model()
