"""`ActCompTrainer`'s two back-ends: the plan's stages in this process, or one stage per rank.

`ActCompTrainer` calls the same methods on either, without asking which it holds; each class
holds only what its mode does differently:

- `OneProcess`: the stages run in-process (`simulate`); everything else is Trainer's own (its
  training step, clipping, saving and loading), reached through `base`, the trainer's `super()`.
- `Pipelined`: this rank's stage of a `Pipeline` (`prepare`); Trainer's loop drives
  `Pipeline.train_step`, the global clip norm, per-rank optimizer files and per-stage weights.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils.memory import clear_device_cache
from transformers import AutoModelForCausalLM

from .. import hub
from ..batching import count_items, count_label_tokens
from ..inference import compressed_inference
from ..models import unwrap_peft
from ..models.heads import CAUSAL_LM
from ..pipeline import prepare
from ..pipeline.loading import load_stage_model
from ..pipeline.mesh import check_world_size
from ..plan import Plan, launched_per_replica
from ..simulate import simulate
from ..state.resume import init_distributed
from .evaluation import (
    in_process_prediction_step,
    pipelined_prediction_step,
    replicas_loss_scale,
    trainer_item_count,
    without_gathering,
)

OPTIMIZER_FILE = "optimizer-rank{rank}.pt"
SCHEDULER_FILE = "scheduler.pt"


class Backend:
    """What both modes share: the plan, the trainer (and its `super()`, `base`), the model given by
    object or by name, and the runner (`sim` or `pipe`) the Trainer loop wraps.

    Built before `Trainer.__init__` (which already moves the model), started after it. `base` is
    `super()` of the trainer: Trainer's own methods, several of them private (`_save_checkpoint`,
    `_clip_grad_norm`, ...) because Trainer has no public hook for them (see actcomp_trainer.py's
    docstring); the one-process backend calls them as Trainer would."""

    sim = None  # the in-process stages (OneProcess)
    pipe = None  # this rank's Pipeline (Pipelined)
    runner = None  # whichever of the two this mode has: what Trainer's loop wraps, what holds the state

    def __init__(self, trainer, base, plan: Plan, *, timeout: float, autocast_dtype: torch.dtype | None) -> None:
        self.trainer = trainer
        self.base = base
        self.plan = plan
        self.timeout = timeout
        self.autocast_dtype = autocast_dtype

    def compiling(self) -> dict[str, Any]:
        """`TrainingArguments(torch_compile=True, torch_compile_backend=..., torch_compile_mode=...)`
        as `simulate` / `prepare` take it: each stage's decoder blocks compiled in place."""
        args = self.trainer.args
        if not args.torch_compile:
            return {}
        options = {k: v for k, v in (("backend", args.torch_compile_backend), ("mode", args.torch_compile_mode)) if v}
        return {"compile": True, "compile_kwargs": options or None}

    def load(self, model, torch_dtype: torch.dtype | None):
        """The model Trainer gets: `model` itself, or the checkpoint it names."""
        if isinstance(model, (str, os.PathLike)):
            return self._load_named(model, torch_dtype)
        if torch_dtype is not None:
            raise ValueError("torch_dtype applies when ActCompTrainer loads a checkpoint given by name or path; "
                             "convert an in-memory model with model.to(dtype) instead.")
        return model

    def load_compression_state(self, state_dir: str) -> None:
        if os.path.isdir(state_dir):
            self.runner.load_compression_state(state_dir)

    def attach_optimizer(self, optimizer) -> None:
        """Hook what runs on the optimizer's steps (DiLoCo's outer step); nothing in one process."""


class OneProcess(Backend):
    """The plan's stages in this process (`simulate`), under Trainer's own loop."""

    num_replicas = 1
    ranks_per_batch = 1  # processes that read each batch

    def non_embedding_parameters(self, model) -> int:
        """What Trainer's flop estimate counts: the model's parameters without its embeddings."""
        return model.num_parameters(exclude_embeddings=True)

    def _load_named(self, name, torch_dtype):
        return AutoModelForCausalLM.from_pretrained(name, **({"dtype": torch_dtype} if torch_dtype else {}))

    @property
    def sim(self):
        return self.runner

    def start(self) -> None:
        self.runner = simulate(self.trainer.model, self.plan, **self.compiling())

    def move_model_to_device(self, model, device) -> None:
        self.base._move_model_to_device(model, device)

    # -- data and loss
    def training_shard(self, dataset):
        """(data set, number of shards, this shard): every batch, in this process."""
        return dataset, 1, 0

    def num_items_in_batch(self, batch_samples: list, device: torch.device):
        return self.base._get_num_items_in_batch(batch_samples, device)

    # -- training
    def optimized_module(self, model):
        return model

    def autocast(self, cache_enabled: bool | None):
        # Accelerate autocasts only a model it prepared; the simulation is not prepared.
        if self.trainer.args.bf16:
            return torch.autocast(self.trainer.args.device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)
        return self.base.autocast_smart_context_manager(cache_enabled)

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        return self.base.training_step(model, inputs, num_items_in_batch)

    def clip_grad_norm(self, model):
        return self.base._clip_grad_norm(model)

    def grad_norm(self, grad_norm):
        return grad_norm

    def stats(self) -> dict:
        return self.sim.stats()

    # -- evaluation
    def evaluation(self):
        """What Trainer's evaluation loop runs within: nothing to change in one process."""
        return contextlib.nullcontext()

    def after_evaluation(self) -> None:
        """Trainer's loop already left the model in evaluation mode."""

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys):
        return in_process_prediction_step(self.trainer, self.base, model, inputs, prediction_loss_only, ignore_keys)

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """`model.generate` with the plan's inference codec at the boundaries."""
        model = self.trainer.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), compressed_inference(unwrap_peft(model), self.plan) as inference:
                return inference.generate(input_ids, **kwargs)
        finally:
            model.train(was_training)

    # -- saving and loading
    def save_model(self, output_dir: str, _internal_call: bool) -> None:
        trainer = self.trainer
        self.base.save_model(output_dir, _internal_call)
        if trainer.args.should_save:
            self.plan.save_pretrained(output_dir)
            run = {"base_model": getattr(unwrap_peft(trainer.model), "name_or_path", None), **trainer.run_results()}
            hub.save_run(output_dir, stats=self.sim.stats(), blocks=[[r.start, r.stop] for r in self.sim.ranges], **run)

    def save_compression_state(self, state_dir: str) -> None:
        if self.trainer.args.should_save:
            self.sim.save_compression_state(state_dir)

    def save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.base._save_optimizer_and_scheduler(output_dir)

    def load_optimizer_and_scheduler(self, checkpoint: str) -> None:
        self.base._load_optimizer_and_scheduler(checkpoint)

    def load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self.base._load_from_checkpoint(resume_from_checkpoint, model)

    def load_best_model(self) -> None:
        self.base._load_best_model()


class Pipelined(Backend):
    """This rank's stage of the plan's pipeline (`prepare`), driven by Trainer's loop."""

    @property
    def pipe(self):
        return self.runner

    @property
    def num_replicas(self) -> int:
        return self.plan.data_parallel

    @property
    def ranks_per_batch(self) -> int:
        """Processes that read each batch: every stage of its pipeline."""
        return self.plan.num_stages

    def non_embedding_parameters(self, model) -> int:
        """This rank's share of Trainer's flop count: its stage's parameters without embeddings
        (a tied weight counted once, as transformers counts it). Trainer sums the ranks' estimates,
        so the stages of one batch add up to the whole model's count."""
        base = unwrap_peft(model)
        embeddings = {f"{name}.weight" for name, module in base.named_modules() if isinstance(module, torch.nn.Embedding)}
        own = {id(p) for p in self.runner.stage.parameters()}
        return sum(p.numel() for name, p in base.named_parameters() if name not in embeddings and id(p) in own)

    def _load_named(self, name, torch_dtype):
        # This rank's stage only; the rest of the model stays on the meta device. The pipeline is
        # built in `start`, once the parent trainer has prepared the data (and the plan knows it).
        init_distributed(self.timeout)
        check_world_size(self.plan)  # before reading any weights
        return load_stage_model(name, self.plan, torch_dtype=torch_dtype)

    def start(self) -> None:
        init_distributed(self.timeout)  # a DiLoCo replica of one process: Accelerate leaves it down
        self.runner = prepare(self.trainer.model, self.plan, timeout=self.timeout, autocast_dtype=self.autocast_dtype,
                              **self.compiling())

    def move_model_to_device(self, model, device) -> None:
        """The pipeline places only this rank's stage on its device (the other stages may not even
        be loaded)."""

    # -- data and loss
    def training_shard(self, dataset):
        """(data set, number of shards, this replica): batches dealt over the replicas, or, with
        AQ-SGD and several replicas, a fixed contiguous shard per replica, whose sample ids its
        memory holds (Trainer's shuffle then runs within the shard)."""
        pipe = self.pipe
        if pipe.num_replicas > 1 and pipe.sample_range is not None:
            return pipe.shard_dataset(dataset), 1, pipe.replica
        return dataset, pipe.num_replicas, pipe.replica

    def num_items_in_batch(self, batch_samples: list, device: torch.device):
        """Label tokens of the optimizer step over every replica (not over every rank: the
        stages of one pipeline read the same batch). Only the last stage computes a loss, so only
        it sums over the replicas (a collective); the others keep their own count, unused."""
        counts = [trainer_item_count(self.trainer, batch) for batch in batch_samples]
        if not counts or counts[0] is None:  # the model takes each batch's own mean (see training_step)
            return None
        if not self.trainer.args.average_tokens_across_devices:
            # Each replica normalises by its own tokens (the pipeline shares the count out over the
            # replicas), and their gradients are averaged: DDP's mean of per-device means.
            return sum(counts) * self.num_replicas
        return self._over_replicas(sum(counts))

    def _over_replicas(self, count: int) -> int:
        return self.pipe.count_over_replicas(count) if self.pipe.is_last else count

    # -- training
    def optimized_module(self, model):
        return self.pipe.stage

    def attach_optimizer(self, optimizer) -> None:
        self.pipe.attach_optimizer(optimizer)  # a no-op unless the plan is DiLoCo

    def autocast(self, cache_enabled: bool | None):
        return self.base.autocast_smart_context_manager(cache_enabled)

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        trainer = self.trainer
        optimizer = trainer.optimizer
        if hasattr(optimizer, "train") and callable(optimizer.train):
            optimizer.train()
        trainer.model.train()  # as Trainer's training_step (the model's flag; only this rank's stage runs)
        self.pipe.train()  # Trainer's evaluation loop leaves the runner in eval mode
        every = trainer.args.torch_empty_cache_steps
        if every is not None and trainer.state.global_step % every == 0:
            clear_device_cache()  # as Trainer's training_step does
        steps = trainer.current_gradient_accumulation_steps
        scaled = num_items_in_batch is not None
        labels = inputs.get("labels")
        if labels is not None and not self.pipe.stage.adapter.takes_item_count(labels):
            # A classifier's own forward takes its call's mean and ignores the count Trainer passes,
            # so Trainer divides by the accumulation steps only where it passes none: the same here.
            # Under DDP it may also multiply that mean by the replicas (`replicas_loss_scale`); the
            # pipeline shares a given count out over the replicas, so dividing the count by that
            # factor multiplies each replica's mean by it.
            count = count_items(self.pipe.task, self.pipe.config, inputs["labels"])
            times = replicas_loss_scale(trainer, self.pipe, inputs)
            num_items_in_batch = count * (1 if scaled else steps) * self.num_replicas // times
            scaled = True
        elif not scaled and steps > 1 and labels is not None:
            # Where Trainer lets the model take each batch's own mean (no loss kwargs), it divides
            # that mean by the accumulation steps before the backward: the same, as a normaliser.
            count = (count_label_tokens(labels) if self.pipe.task == CAUSAL_LM
                     else count_items(self.pipe.task, self.pipe.config, labels))
            num_items_in_batch = self._over_replicas(count) * steps
            scaled = True
        out = self.pipe.train_step(inputs, num_items_in_batch=num_items_in_batch,
                                   sync=trainer.accelerator.sync_gradients)
        loss = out.loss.detach()
        if not scaled:
            loss = loss / steps
        return loss.to(trainer.args.device)

    def clip_grad_norm(self, model):
        return self.pipe.clip_grad_norm_(self.trainer.args.max_grad_norm)

    def grad_norm(self, grad_norm):
        return self.pipe.clip_grad_norm_(float("inf")) if grad_norm is None else grad_norm

    def stats(self) -> dict:
        return self.pipe.stats(gather=True)

    # -- evaluation
    @contextlib.contextmanager
    def evaluation(self):
        """Trainer's loop without its gathers across processes (every rank evaluates the whole
        set, and gets the last stage's predictions from it); the stage's mode is kept."""
        was_training = self.pipe.training
        try:
            with without_gathering(self.trainer) as preprocess:
                self._preprocess = preprocess
                yield
        finally:
            self._preprocess = None
            self.pipe.train(was_training)

    def after_evaluation(self) -> None:
        """The model in evaluation mode until the next training step, as Trainer's loop leaves it
        (TRL's trainers read `model.training` to file their metrics under train or eval)."""
        self.trainer.model.eval()

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys):
        """`ignore_keys` has nothing to drop: the last stage returns the logits only."""
        preprocess = getattr(self, "_preprocess", None) or self.trainer.preprocess_logits_for_metrics
        return pipelined_prediction_step(self.trainer, self.pipe, inputs, prediction_loss_only, preprocess)

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """`Pipeline.generate`: the model still split (collective over the pipeline)."""
        return self.pipe.generate(input_ids, **kwargs)

    # -- saving and loading
    def save_model(self, output_dir: str, _internal_call: bool) -> None:
        trainer = self.trainer
        # One collective save: every stage's shard, and the card with this run's results.
        self.pipe.save_pretrained(output_dir, model=trainer.model, results=trainer.run_results())
        if trainer.args.should_save:
            if trainer.processing_class is not None:
                trainer.processing_class.save_pretrained(output_dir)
            torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))
        if trainer.args.push_to_hub and not _internal_call:
            trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)

    def save_compression_state(self, state_dir: str) -> None:
        self.pipe.save_compression_state(state_dir)

    def save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Each rank optimises its own stage: one optimizer file per rank.
        trainer = self.trainer
        os.makedirs(output_dir, exist_ok=True)
        torch.save(trainer.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_FILE.format(rank=dist.get_rank())))
        if trainer.args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def load_optimizer_and_scheduler(self, checkpoint: str) -> None:
        trainer = self.trainer
        path = os.path.join(checkpoint, OPTIMIZER_FILE.format(rank=dist.get_rank()))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: was {checkpoint} saved by a run with "
                                    f"{self.plan.world_size} processes?")
        trainer.optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))

    def load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self.pipe.load_stage_weights(resume_from_checkpoint)

    def load_best_model(self) -> None:
        self.pipe.load_stage_weights(self.trainer.state.best_model_checkpoint)


def backend_for(world_size: int, plan: Plan) -> type[Backend]:
    """One process: `OneProcess`; otherwise (`plan.world_size` processes, checked before), or a
    DiLoCo replica launched on its own, `Pipelined`."""
    return OneProcess if world_size == 1 and not launched_per_replica(plan) else Pipelined

