"""One pipeline stage per process: compressed forward/backward of all micro-batches in a step.

`prepare(model, plan)` is called in every process (e.g. of `accelerate launch`). Each rank keeps
only its stage's parameters, and `train_step(batch)` runs the plan's schedule: activations go to
the next stage through the forward sender (`feedback.py`), activation gradients come back through
the backward sender, exactly as the in-process simulation does with the same objects. Every rank
reads the same batch; only the first stage uses `input_ids` and only the last `labels`, and
`sample_id` is available to every boundary for AQ-SGD.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..batching import check_batch, count_items, micro_batch_count, split_batch, with_main_input
from ..boundary import Boundary
from ..models import unwrap_peft
from ..plan import Plan
from ..state.weight_shards import StageWeights
from . import construction as build
from .auto_tuner import AutoTuner
from .compression_state import CompressionStateMixin
from .evaluation import Evaluation
from .executor import run_actions
from .gradsync import GradientSync
from .link import naming_the_step
from .loading import load_stage_model
from .mesh import build_mesh
from .predictions import share_from_last
from .replicas import ReplicasMixin, StepCollectives, outer_sync
from .runner import StageRunner
from .split_generator import SplitGenerationMixin, SplitGenerator
from .stats import StageStats, TelemetryMixin
from .tie import stage_tie
from .transport import Transport
from .weights import WeightsMixin

DEFAULT_TIMEOUT = 300.0


@dataclass
class StepOutput:
    """What `train_step` / `eval_step` return on every rank.

    `loss` is the token-weighted mean over the whole batch (all micro-batches), as the unsplit
    model's `model(**batch).loss` (or, given `num_items_in_batch`, the token sum divided by it);
    `num_tokens` is the number of label tokens in this rank's batch.
    """

    loss: torch.Tensor | None
    num_tokens: int
    logits: torch.Tensor | None = None  # `eval_step(keep_logits=True)`, on the last stage only


class Pipeline(ReplicasMixin, TelemetryMixin, SplitGenerationMixin, CompressionStateMixin, WeightsMixin,
               nn.Module):
    """This rank's stage of a model split by `plan`, with compressed boundaries to its neighbours.

    Use `parameters()` with any optimizer; call `train_step(batch)` with the SAME batch on every
    rank of a pipeline, then `clip_grad_norm_`, `optimizer.step()` and `zero_grad()` as usual.
    For gradient accumulation, run the micro-steps under `no_sync()` (or `sync=False`) and the
    last one without; pass `num_items_in_batch` to normalise by the tokens of all of them.
    """

    def __init__(self, model: nn.Module, plan: Plan, *, device: torch.device | str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, autocast_dtype: torch.dtype | None = None,
                 track_error: bool = True, compile: bool = False, compile_kwargs: dict | None = None) -> None:
        super().__init__()
        compiling = build.check_arguments(plan, timeout=timeout, autocast_dtype=autocast_dtype, compile=compile,
                                          compile_kwargs=compile_kwargs)
        self.timeout = float(timeout)
        self.autocast_dtype = autocast_dtype
        # A PEFT model is split like its inner transformers model; saving writes the adapter only.
        self.peft_model = model if unwrap_peft(model) is not model else None
        # The model given (its other stages freed): `save_pretrained` refills and writes it. Not a
        # submodule: its parameters are not this stage's.
        object.__setattr__(self, "model", model)
        model = unwrap_peft(model)
        adapter, self.ranges, self.tied_pairs = build.split_model(model, plan)  # fails before any collective
        self.mesh, groups = build_mesh(plan, self.timeout)
        self.group, self.dp_group = groups.pipeline, groups.data_parallel
        self.config = model.config
        self.loss_function = model.loss_function
        self.task = adapter.task  # what the last stage's head computes (models/heads.py)
        self.check_model_batch = adapter.check_batch  # what this model cannot take, refused before any work
        self.device = build.stage_device(device)
        blocks = self.ranges[self.mesh.stage]
        self.stage = build.build_stage(model, adapter, blocks, self.mesh, self.device, compiling)
        self.boundary_dtype = build.boundary_dtype(model, autocast_dtype)
        self.hidden_size = getattr(self.config, "hidden_size", None)  # split generation's (causal LMs only)
        self.transport = Transport(self.group, self.mesh.rank, self.timeout, self.device)
        self.sample_range = build.replica_samples(plan, self.mesh)
        self._optimizer_steps = 0
        self._at_optimizer_step = True
        self._sync = True
        router = build.stage_router(model, self.stage)
        self.traffic = build.traffic_counters(plan, router)
        self.runner = StageRunner(self.stage, self.mesh, self.transport, self.device, plan, config=self.config,
                                  loss_function=self.loss_function, boundary_dtype=self.boundary_dtype,
                                  autocast_dtype=autocast_dtype, router=router, sample_range=self.sample_range,
                                  track_error=track_error, side_counter=self.traffic.get("router"),
                                  compiling=compiling)
        self.dp_compressor = build.data_parallel_hook(plan, self.dp_group, self.stage)
        self.tie = stage_tie(self.stage, self.mesh, self.transport, self.traffic["tie"], self.tied_pairs,
                             plan.tie_compression)  # this stage's end of the tied embedding, if any
        self.grads = GradientSync(self.stage, self.mesh, self.group, self.dp_compressor, self.tie,
                                  self.traffic["collectives"], shared=adapter.shared_parameters())
        self.outer = None
        if plan.diloco is not None:  # the lighthouse servers this rank started are kept alive here
            self.outer, self._lighthouses = outer_sync(plan, self.grads.trainable(), self.mesh, self.timeout)
        self.data_parallel = self.dp_compressor or self.outer  # what talks between replicas, if anything
        self.compression = self._compression_state()
        self.weights = StageWeights(self.stage, self.mesh, self.group, self.tied_pairs, self.peft_model)
        self.counters = StageStats(self.mesh, self.group, self.traffic, self.transport, self.grads,
                                   self.data_parallel, self.outer)
        self.collectives = StepCollectives(self.mesh, self.group, self.dp_group, self.device,
                                           self.traffic["collectives"], self.counters)
        self.evaluation = Evaluation(self.runner, self.tie, self.traffic["evaluation"])
        self.generator = SplitGenerator(self.mesh, self.transport, self.device, blocks, self.hidden_size, self.tie,
                                        self.traffic["inference"], self.runner.autocast)
        # Plan.auto: measured and chosen at the first step (and every `adapt_every` optimizer steps).
        self.autotuner = AutoTuner(self.runner, self.tie, self.traffic["probe"]) if plan.autotune is not None else None

    # ------------------------------------------------------------------------- properties
    @property
    def stage_index(self) -> int:
        return self.mesh.stage

    @property
    def is_first(self) -> bool:
        return self.mesh.is_first

    @property
    def is_last(self) -> bool:
        return self.mesh.is_last

    @property
    def plan(self) -> Plan:
        """The plan in force (Plan.auto's decision included, once made)."""
        return self.runner.plan

    @property
    def boundaries(self) -> dict[str, Boundary]:
        """The boundary ends this rank holds, by name (`boundary0.forward`, ...)."""
        return self.runner.boundaries

    # The runner's pieces, under the names they have always had here.
    forward_in = property(lambda self: self.runner.ends.get("forward_in"))
    backward_out = property(lambda self: self.runner.ends.get("backward_out"))
    forward_out = property(lambda self: self.runner.ends.get("forward_out"))
    backward_in = property(lambda self: self.runner.ends.get("backward_in"))
    links = property(lambda self: self.runner.links)
    router = property(lambda self: self.runner.router)

    # ------------------------------------------------------------------------- steps
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without averaging over replicas (as DDP's `no_sync`): run all
        accumulation micro-steps but the last inside it."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def train_step(self, batch: dict[str, torch.Tensor], *, num_items_in_batch: int | torch.Tensor | None = None,
                   sync: bool | None = None) -> StepOutput:
        """Forward and backward of all micro-batches of `batch` (the same batch on every rank of
        this pipeline). Gradients accumulate into this stage's parameters.

        Args:
            num_items_in_batch: label tokens of the whole optimizer step (all accumulation
                micro-steps, all replicas); the loss is the token sum divided by it, as
                `model(**batch, num_items_in_batch=...)`. Default: this step's tokens.
            sync: average over replicas after this step (default: True outside `no_sync()`).
        """
        batch = with_main_input(batch)
        check_batch(batch, self.plan, training=True, sample_range=self.sample_range)
        self.check_model_batch(batch)
        if self.outer is not None and not self.outer.attached:
            raise RuntimeError("Plan.dp_compression='diloco' steps the replicas together after every sync_every steps "
                               "of the inner optimizer: call pipe.attach_optimizer(optimizer) once before training.")
        self.stage.train()
        micro = split_batch(batch, self.plan.micro_batches, self.device)
        if self.autotuner is not None and self.autotuner.due(self._optimizer_steps, self._at_optimizer_step):
            self.autotuner.select(micro, batch["input_ids"], self._optimizer_steps)
            self.compression = self._compression_state()  # the state of the ends now in force
        start = time.perf_counter()
        num_tokens = count_items(self.task, self.config, batch["labels"])
        normaliser = self.collectives.loss_normaliser(num_tokens, num_items_in_batch, self.plan.micro_batches)
        self.runner.post_receives(micro, training=True)
        if self.tie is not None:
            self.tie.share_rows(batch["input_ids"])
        self.grads.hold_shared()
        with naming_the_step("training", self.counters.steps + 1, self.stage_index):
            total = run_actions(self.runner, self.runner.actions, micro, normaliser)
        if self.tie is not None:
            self.tie.gather_gradient(batch["input_ids"])
        self.grads.sum_shared_over_stages()
        self.transport.flush()
        self._at_optimizer_step = self._sync if sync is None else sync
        if self._at_optimizer_step:
            self.grads.average_over_replicas()
            self._optimizer_steps += 1
        loss = self.collectives.broadcast_loss(self.collectives.mean_over_replicas(total))
        self.counters.seconds_step += time.perf_counter() - start
        self.counters.steps += 1
        return StepOutput(loss=loss, num_tokens=num_tokens)

    @torch.no_grad()
    def eval_step(self, batch: dict[str, torch.Tensor], *, compress: bool = True,
                  num_items_in_batch: int | torch.Tensor | None = None, keep_logits: bool = False,
                  micro_batches: int | None = None) -> StepOutput:
        """Loss of `batch` without gradients, through the stateless inference codec (AQ-SGD falls
        back as `Compression.inference` says); training state and the module's mode are kept.
        With `compress=False` activations cross uncompressed: the model's loss without the codec.
        `num_items_in_batch`: divide the token-loss sum by it (as `train_step`; default: the mean).
        `keep_logits`: the last stage also returns the whole batch's logits. `micro_batches`: how
        many to cut the batch into (default: the plan's, or one per row of a shorter batch; no
        state depends on it here). Without labels there is no loss (`loss` None)."""
        batch = with_main_input(batch)
        has_labels = batch.get("labels") is not None
        check_batch(batch, self.plan, training=False, needs_labels=has_labels)
        self.check_model_batch(batch)
        was_training = self.stage.training
        self.stage.eval()
        try:
            count = micro_batches or micro_batch_count(batch, self.plan, training=False)
            micro = split_batch(batch, count, self.device)
            num_tokens = count_items(self.task, self.config, batch["labels"]) if has_labels else 0
            normaliser = (self.collectives.eval_normaliser(num_tokens, num_items_in_batch, self.plan.micro_batches)
                          if has_labels else None)
            total, logits = self.evaluation.run(micro, batch["input_ids"], normaliser, compress=compress,
                                                labelled=has_labels, keep_logits=keep_logits,
                                                step=self.counters.steps + 1)
            self.transport.flush()
        finally:
            self.stage.train(was_training)
        loss = self.collectives.broadcast_loss(self.collectives.mean_over_replicas(total)) if has_labels else None
        return StepOutput(loss=loss, num_tokens=num_tokens, logits=torch.cat(logits) if logits else None)

    def set_objective(self, objective: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
                      | None) -> None:
        """Have the last stage compute `objective(logits, labels, normaliser)` for each micro-batch
        instead of the model's loss (None restores the model's), in training and evaluation: a
        trainer's own loss, such as a reward model's pairwise one. `normaliser` is what the model's
        loss would divide its sum by (the step's `batching.count_items`, or None for a mean); the
        micro-batches' results are summed. Set it on every rank alike; only the last stage calls it."""
        self.runner.objective = objective

    def share_predictions(self, value):
        """The last stage's `value` (a tensor, a tuple or list of tensors, or None: e.g. its
        preprocessed logits) on every rank of this pipeline, counted under `predictions`.
        Collective over the pipeline."""
        return share_from_last(value, ranks=self.mesh.ranks, rank=self.mesh.rank, group=self.group,
                               device=self.device, counter=self.traffic["predictions"])

    # ------------------------------------------------------------------------- optimisation helpers
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm over all stages (tied weights counted once), like
        `torch.nn.utils.clip_grad_norm_` on the unsplit model. Collective over the pipeline.
        Returns the total norm before clipping."""
        start = time.perf_counter()
        norm = self.grads.clip_grad_norm_(max_norm, norm_type)
        self.counters.seconds_step += time.perf_counter() - start
        return norm


def prepare(model: nn.Module | str | os.PathLike, plan: Plan | str, *, device: torch.device | str | None = None,
            timeout: float = DEFAULT_TIMEOUT, autocast_dtype: torch.dtype | None = None,
            track_error: bool = True, torch_dtype: torch.dtype | None = None,
            activation_checkpointing: bool = False, compile: bool = False,
            compile_kwargs: dict | None = None) -> Pipeline:
    """Split `model` into the plan's stages across the processes of this job; keep this rank's.

    Call in every process with the same model (same initialisation) and plan. The plan must have
    one stage per process. `model` may also be a checkpoint: a local directory or a Hub id (in
    the local cache, or downloaded), in safetensors; then each rank builds the model on the meta
    device and reads only its own stage's tensors, in `torch_dtype` if given. Args:
        device: where this stage runs (default: `cuda:LOCAL_RANK` when CUDA is available, else CPU).
        timeout: seconds any wait on a peer may take before the step fails with `PeerTimeoutError`.
        autocast_dtype: e.g. `torch.bfloat16` to run the stage under autocast.
        track_error: also decode each payload on the sender to report relative errors.
        torch_dtype: the dtype a checkpoint's floating-point weights are loaded in.
        activation_checkpointing: recompute each block's activations in the backward instead of
            keeping them (transformers' own per-layer checkpointing, inside the stage); same numbers.
        compile: compile each of this stage's decoder blocks in place with `torch.compile`, at its
            first call, and fuse the boundaries' deterministic quantizers (`quantize`, `hadamard`:
            hf_actcomp/codecs/fused.py); send/recv, the codecs' state, embeddings, head and loss
            stay eager (hf_actcomp/models/compile.py). `compile_kwargs`: torch.compile's backend, mode, ...

    `plan="auto"` is `Plan.auto(num_stages=world size)`: the codecs chosen from measured links.
    """
    plan = build.resolve_plan(plan)
    if isinstance(model, (str, os.PathLike)):
        build.check_loadable(plan)  # before reading any weights
        model = load_stage_model(model, plan, torch_dtype=torch_dtype)
    elif torch_dtype is not None:
        raise ValueError("torch_dtype applies when prepare() loads a checkpoint by name or path; convert an "
                         "in-memory model with model.to(dtype) instead.")
    if activation_checkpointing:
        unwrap_peft(model).activation_checkpointing_enable()
    return Pipeline(model, plan, device=device, timeout=timeout, autocast_dtype=autocast_dtype,
                    track_error=track_error, compile=compile, compile_kwargs=compile_kwargs)
