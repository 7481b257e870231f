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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint
from ..batching import check_batch, count_label_tokens, micro_batch_count, split_batch
from ..boundary import Boundary
from ..checkpoint import CompressionState, model_fingerprint
from ..codecs import make_codec
from ..dp import make_compressor
from ..generation import check_split_generation
from ..memory import replica_sample_range
from ..models import get_adapter, unwrap_peft
from ..models.compile import compile_blocks, compile_options
from ..models.router import RouterLoss, router_spec
from ..models.split import stage_ranges
from ..plan import Plan
from ..telemetry import TrafficCounter
from .autotune import AutoTuner
from .checkpointing import StageWeights, free_other_parameters
from .executor import run_actions
from .generate import SplitGenerator
from .gradsync import GradientSync
from .link import naming_the_step
from .loading import load_stage_model
from .mesh import build_mesh, check_world_size
from .predictions import share_from_last
from .replicas import StepCollectives, outer_sync, shard_dataset
from .runner import StageRunner
from .schedule import fused, stage_actions
from .stats import StageStats
from .tie import check_tied_embeddings, stage_tie
from .transport import Transport
from .weights import push_to_hub, save_pretrained

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


class Pipeline(nn.Module):
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
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a hf_actcomp.Plan, got {type(plan).__name__}.")
        compiling = compile_options(compile, compile_kwargs)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "hf_actcomp.prepare() needs torch.distributed to be initialised: run under `accelerate launch` "
                "(create the Accelerator first) or `torchrun`, or call torch.distributed.init_process_group()."
            )
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
        plan.check_memory()
        if autocast_dtype == torch.float16:
            raise ValueError("autocast_dtype=torch.float16 needs loss scaling (a GradScaler), which the pipeline "
                             "does not do; use autocast_dtype=torch.bfloat16 (or None for full precision).")
        if autocast_dtype not in (None, torch.bfloat16):
            raise ValueError(f"autocast_dtype={autocast_dtype!r} is not supported; use torch.bfloat16 or None.")
        self.timeout = float(timeout)
        self.autocast_dtype = autocast_dtype
        # A PEFT model is split like its inner transformers model; saving writes the adapter only.
        self.peft_model = model if unwrap_peft(model) is not model else None
        # The model given (its other stages freed): `save_pretrained` refills and writes it. Not a
        # submodule: its parameters are not this stage's.
        object.__setattr__(self, "model", model)
        model = unwrap_peft(model)
        adapter = get_adapter(model)  # unsupported families fail here, before any collective
        ranges = stage_ranges(adapter, plan)
        self.tied_pairs = adapter.tied_weights()
        check_tied_embeddings(model, self.tied_pairs)
        if plan.data_parallel > 1 and plan.dp_hook()[0] == "powersgd":
            raise ValueError("Plan.dp_compression='powersgd' is torch's DDP hook; inside prepare() use one of "
                             "allreduce, dgc, ef_sign, marsit, qsgd, randk, topk.")
        self.mesh, groups = build_mesh(plan, self.timeout)
        self.group, self.dp_group = groups.pipeline, groups.data_parallel
        s, last = self.mesh.stage, self.mesh.num_stages - 1
        self.ranges = ranges
        self.config = model.config
        self.loss_function = model.loss_function
        self.device = torch.device(device) if device is not None else _default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL collectives and *_object calls use the current device
        stage = adapter.build_stage(ranges[s].start, ranges[s].stop, first=s == 0, last=s == last)
        free_other_parameters(model, stage)
        self.stage = stage.to(self.device)
        if compiling is not None:  # its blocks, in place; the links, codecs and glue stay eager
            compile_blocks(self.stage, **compiling)
        # What crosses a boundary: the autocast dtype when set (the stages compute in it, so
        # sending fp32 would double the bytes for nothing), else the parameters' dtype.
        self.boundary_dtype = autocast_dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.hidden_size = int(self.config.hidden_size)
        self.transport = Transport(self.group, self.mesh.rank, self.timeout, self.device)
        self._uncompressed = make_codec("none")  # `eval_step(compress=False)`
        # Bytes outside the boundary channels; `evaluation` is everything `eval_step` sends.
        self.traffic = {"tie": TrafficCounter(), "collectives": TrafficCounter(), "evaluation": TrafficCounter(),
                        "inference": TrafficCounter(),  # inference: everything `generate` sends
                        "predictions": TrafficCounter()}  # the last stage's predictions, for Trainer's metrics

        # The ends of the two boundaries this stage touches (boundary b joins stage b and b+1).
        # With data parallelism, AQ-SGD memory holds only this replica's shard of the samples.
        self.sample_range = None
        if plan.uses_aqsgd and self.mesh.num_replicas > 1:
            self.sample_range = replica_sample_range(plan.memory.num_samples, self.mesh.num_replicas,
                                                     self.mesh.replica)
        self._optimizer_steps = 0
        self._at_optimizer_step = True
        if plan.autotune is not None:
            self.traffic["probe"] = TrafficCounter()
        # MoE with output_router_logits: the load-balancing loss's statistics ride along with the
        # activations (forward) and its gradient with the activation gradients (backward).
        router = RouterLoss(model, self.stage) if router_spec(model) is not None else None
        if router is not None:
            self.traffic["router"] = TrafficCounter()
        self.runner = StageRunner(self.stage, self.mesh, self.transport, self.device, plan, config=self.config,
                                  loss_function=self.loss_function, boundary_dtype=self.boundary_dtype,
                                  autocast_dtype=autocast_dtype, router=router, sample_range=self.sample_range,
                                  track_error=track_error, side_counter=self.traffic.get("router"))
        self.dp_compressor = None
        if self.dp_group is not None:
            hook, params = plan.dp_hook()
            self.dp_compressor = make_compressor(hook, self.dp_group, **params)
            self.dp_compressor.param_names = {id(p): n for n, p in self.stage.named_parameters()}
        self.tie = stage_tie(self.stage, self.mesh, self.transport, self.traffic["tie"], self.tied_pairs,
                             plan.tie_compression)  # this stage's end of the tied embedding, if any
        self.grads = GradientSync(self.stage, self.mesh, self.group, self.dp_compressor, self.tie,
                                  self.traffic["collectives"])
        self.outer = None
        if plan.diloco is not None:  # the lighthouse servers this rank started are kept alive here
            self.outer, self._lighthouses = outer_sync(plan, self.grads.trainable(), self.mesh, self.timeout)
        self.data_parallel = self.dp_compressor or self.outer  # what talks between replicas, if anything
        self.compression = self._compression_state()
        self.weights = StageWeights(self.stage, self.mesh, self.group, self.tied_pairs, self.peft_model)
        self._sync = True
        self.counters = StageStats(self.mesh, self.group, self.traffic, self.transport, self.grads,
                                   self.data_parallel, self.outer)
        self.collectives = StepCollectives(self.mesh, self.group, self.dp_group, self.device,
                                           self.traffic["collectives"], self.counters)
        self.generator = SplitGenerator(self.mesh, self.transport, self.device, ranges[s], self.hidden_size, self.tie,
                                        self.traffic["inference"], self.runner.autocast)
        # Plan.auto: measured and chosen at the first step (and every `adapt_every` optimizer steps).
        self.autotuner = AutoTuner(self.runner, self.tie, self.traffic["probe"]) if plan.autotune is not None else None

    # ------------------------------------------------------------------------- properties
    @property
    def stage_index(self) -> int:
        return self.mesh.stage

    @property
    def replica(self) -> int:
        """This rank's pipeline replica (0..data_parallel-1): shard the data by it."""
        return self.mesh.replica

    @property
    def num_replicas(self) -> int:
        return self.mesh.num_replicas

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

    @property
    def auto_switches(self) -> list[dict]:
        """Plan.auto's codec switches so far (empty for any other plan)."""
        return self.autotuner.switches if self.autotuner is not None else []

    @property
    def seconds_probing(self) -> float:
        return self.autotuner.seconds if self.autotuner is not None else 0.0

    def _compression_state(self) -> CompressionState:
        r, s = self.ranges[self.stage_index], self.stage_index
        return CompressionState(
            {**self.boundaries, "tie": self.tie, "data_parallel": self.data_parallel},
            rank=self.replica * self.mesh.num_stages + s,  # the rank in a launch of every replica
            metadata={"plan": self.plan.to_dict(), "world_size": self.plan.world_size, "stage": s,
                      "blocks": [r.start, r.stop], "model": model_fingerprint(self.config)})

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Tell the pipeline which optimizer steps this stage (needed with DiLoCo, whose outer step
        runs after every `sync_every` of its steps; a no-op for every other plan). Call once, after
        building the optimizer and before the first `train_step`. Returns `optimizer`."""
        if self.outer is not None:
            self.outer.attach(optimizer)
        return optimizer

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
        check_batch(batch, self.plan, training=True, sample_range=self.sample_range)
        if self.outer is not None and not self.outer.attached:
            raise RuntimeError("Plan.dp_compression='diloco' steps the replicas together after every sync_every steps "
                               "of the inner optimizer: call pipe.attach_optimizer(optimizer) once before training.")
        self.stage.train()
        micro = split_batch(batch, self.plan.micro_batches, self.device)
        if self.autotuner is not None and self.autotuner.due(self._optimizer_steps, self._at_optimizer_step):
            self.autotuner.select(micro, batch["input_ids"], self._optimizer_steps)
            self.compression = self._compression_state()  # the state of the ends now in force
        start = time.perf_counter()
        num_tokens = count_label_tokens(batch["labels"])
        normaliser = self.collectives.loss_normaliser(num_tokens, num_items_in_batch, self.plan.micro_batches)
        self.runner.post_receives(micro, training=True)
        if self.tie is not None:
            self.tie.share_rows(batch["input_ids"])
        actions = fused(stage_actions(self.plan.schedule, self.stage_index, self.mesh.num_stages, len(micro)))
        with self._naming_the_step("training"):
            total = run_actions(self.runner, actions, micro, normaliser)
        if self.tie is not None:
            self.tie.gather_gradient(batch["input_ids"])
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
                  num_items_in_batch: int | torch.Tensor | None = None, keep_logits: bool = False) -> StepOutput:
        """Loss of `batch` without gradients, through the stateless inference codec (AQ-SGD falls
        back as `Compression.inference` says); training state and the module's mode are kept.
        With `compress=False` activations cross uncompressed: the model's loss without the codec.
        `num_items_in_batch`: divide the token-loss sum by it (as `train_step`; default: the mean).
        `keep_logits`: the last stage also returns the whole batch's logits. Without labels there
        is no loss (`loss` None)."""
        has_labels = batch.get("labels") is not None
        check_batch(batch, self.plan, training=False, needs_labels=has_labels)
        was_training = self.stage.training
        self.stage.eval()
        logits = []
        try:
            micro = split_batch(batch, micro_batch_count(batch, self.plan, training=False), self.device)
            num_tokens = count_label_tokens(batch["labels"]) if has_labels else 0
            normaliser = None
            if has_labels and self.is_last:  # every replica evaluates the whole batch: no share of a count
                normaliser = (self.collectives.loss_normaliser(num_tokens, None, self.plan.micro_batches)
                              if num_items_in_batch is None else
                              torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=self.device))
            counter = self.traffic["evaluation"]
            receiver = self.forward_in and (self.forward_in.inference if compress else self._uncompressed)
            sender = self.forward_out and (self.forward_out.inference if compress else self._uncompressed)
            self.runner.post_receives(micro, training=False, codec=receiver)
            if self.tie is not None:
                self.tie.share_rows(batch["input_ids"], counter)
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            for i, mb in enumerate(micro):
                with self._naming_the_step("evaluation"):
                    out, stats, probs = self.runner.infer(i, mb, receiver, sender, counter)
                if self.is_last:
                    if keep_logits:
                        logits.append(out)
                    if has_labels:
                        loss = self.runner.loss(out, mb.labels, normaliser).float()
                        total += loss if stats is None else loss + self.router.whole_loss(stats, probs)
            self.transport.flush()
        finally:
            self.stage.train(was_training)
        loss = self.collectives.broadcast_loss(self.collectives.mean_over_replicas(total)) if has_labels else None
        return StepOutput(loss=loss, num_tokens=num_tokens, logits=torch.cat(logits) if logits else None)

    def share_predictions(self, value):
        """The last stage's `value` (a tensor, a tuple or list of tensors, or None: e.g. its
        preprocessed logits) on every rank of this pipeline, counted under `predictions`.
        Collective over the pipeline."""
        return share_from_last(value, ranks=self.mesh.ranks, rank=self.mesh.rank, group=self.group,
                               device=self.device, counter=self.traffic["predictions"])

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 generation_config=None, **kwargs) -> torch.Tensor:
        """Generate text with the model still split (call on every rank of the pipeline, with the
        same prompts, as `train_step`); every rank returns the same ids (prompt + new tokens).

        Each stage keeps the KV cache of its own layers; after the prompt, one token's hidden
        state per row crosses each boundary, through the plan's inference codec, counted under
        `inference`. The last stage picks the next tokens with transformers' logits processors
        and stopping criteria (`max_new_tokens`, `eos_token_id`, `pad_token_id`, `do_sample`,
        `temperature`, `top_k`, `top_p`, ...) and sends them to the others. Left padding and
        batched prompts of different lengths work as in `model.generate`.

        Greedy decoding and multinomial sampling only, one sequence per prompt: any other mode of
        `model.generate` (`num_beams` > 1, `num_return_sequences` > 1, contrastive search,
        `assistant_model`, constraints, ...), whether from the arguments or from
        `model.generation_config`, raises a ValueError naming it before any work, on every rank
        alike (`hf_actcomp.generation.check_generation_mode`; see docs/generation.md).
        """
        model = unwrap_peft(self.model)
        check_split_generation(model, generation_config, **kwargs)  # before any work or message
        was_training = model.training
        model.eval()
        try:
            return self.generator.generate(model, self.links, self.counters.steps, input_ids, attention_mask,
                                           generation_config, **kwargs)
        finally:
            model.train(was_training)

    def _naming_the_step(self, what: str):
        return naming_the_step(what, self.counters.steps + 1, self.stage_index)

    def count_over_replicas(self, count: int) -> int:
        """The sum of `count` over this stage's replicas (e.g. label tokens of an optimizer step,
        for `num_items_in_batch`). Collective over the data-parallel group."""
        return self.collectives.count_over_replicas(count)

    # ------------------------------------------------------------------------- optimisation helpers
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm over all stages (tied weights counted once), like
        `torch.nn.utils.clip_grad_norm_` on the unsplit model. Collective over the pipeline.
        Returns the total norm before clipping."""
        start = time.perf_counter()
        norm = self.grads.clip_grad_norm_(max_norm, norm_type)
        self.counters.seconds_step += time.perf_counter() - start
        return norm

    def shard_dataset(self, dataset):
        """This replica's shard of a `datasets.Dataset`: contiguous, and of the SAME length on every
        replica (the last `len % data_parallel` rows are dropped), so that replicas run the same
        number of steps and none waits forever at a collective. With AQ-SGD, add sample ids to the
        whole data set first: the replica keeps memory for its shard's ids only (`sample_range`)."""
        return shard_dataset(dataset, self.num_replicas, self.replica)

    # ------------------------------------------------------------------------- telemetry
    def stats(self, gather: bool = False) -> dict:
        """What THIS rank sent between ranks, by category (`categories`: activations, activation
        gradients, tied-embedding rows, loss/token-count collectives, data-parallel hook), per
        boundary direction (`channels`), the ratio over all of it, relative errors, and this
        stage's seconds computing vs waiting on communication.

        With `gather=True` (collective: call on every rank of the pipeline) the counters of all
        its ranks are merged.
        """
        auto = self.autotuner.summary() if self.autotuner is not None else None
        return self.counters.summary(self._local_counters(), gather, auto)

    def _local_counters(self) -> dict:
        probing = self.autotuner.seconds if self.autotuner is not None else None
        return self.counters.local(self.runner.sending_channels(), probing)

    def reset_stats(self) -> None:
        """Every counter and timer back to zero, in place (whoever counts into one keeps it)."""
        self.counters.reset(self.boundaries.values())

    # ------------------------------------------------------------------------- state
    def compression_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's EF buffers, AQ-SGD memories, codec counters, data-parallel hook state and,
        with `Plan.tie_compression`, its end of the tie (`tie.copy` and `tie.error` on the first
        stage, `tie.mirror` on the last)."""
        return self.compression.state_dict()

    def load_compression_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.compression.load_state_dict(state)

    def save_compression_state(self, directory: str | os.PathLike,
                               max_shard_size: int | str = checkpoint.DEFAULT_MAX_SHARD_SIZE) -> None:
        """Write this rank's compression state to `directory` (safetensors, sharded when large).
        Call on every rank."""
        self.compression.save(directory, max_shard_size)

    def load_compression_state(self, directory: str | os.PathLike) -> None:
        """Read this rank's state saved by `save_compression_state` under the same plan. Under
        `Plan.auto`, the codecs chosen when it was saved are taken back first (the state is theirs)."""
        self.restore_auto_decision(directory)
        self.compression.load(directory)

    def restore_auto_decision(self, directory: str | os.PathLike) -> None:
        """Under `Plan.auto`: take back the codecs chosen when the compression state in `directory`
        was saved (its metadata holds the plan), so that the state loads into the ends it belongs
        to. A no-op for any other plan. `load_compression_state` calls it; call it yourself before
        reading the state another way (`hf_actcomp.training_state.load_training_state`)."""
        if self.autotuner is not None and self.autotuner.restore(directory, self.compression.rank,
                                                                   self._optimizer_steps):
            self.compression = self._compression_state()

    def register_for_checkpointing(self, accelerator) -> None:
        """Make `accelerator.save_state(dir)` / `load_state(dir)` also save / load every rank's
        compression state under `dir/actcomp_state` (each rank registers its own hooks: Accelerate
        saves custom objects on the main process only). The hooks read the state when they run,
        so codecs that Plan.auto chooses or switches to after this call are the ones saved, and a
        load takes the saved codecs back first."""
        def save_hook(models, weights, output_dir):
            self.save_compression_state(os.path.join(output_dir, checkpoint.COMPRESSION_STATE_DIR))

        def load_hook(models, input_dir):
            self.load_compression_state(os.path.join(input_dir, checkpoint.COMPRESSION_STATE_DIR))

        accelerator.register_save_state_pre_hook(save_hook)
        accelerator.register_load_state_pre_hook(load_hook)

    def save_pretrained(self, save_directory: str | os.PathLike, model: nn.Module | None = None,
                        results: dict | None = None, **kwargs) -> None:
        """Write ONE Transformers checkpoint: each stage's rank writes its own safetensors shard
        (no weights cross between ranks), rank 0 the index, config, `actcomp_config.json` and the
        model card. Collective: call on every rank.

        `model` defaults to the model passed to `prepare` (its config and class are used on rank 0). For a
        `peft.PeftModel` only the adapter is gathered and written (`adapter_model.safetensors`),
        which `PeftModel.from_pretrained(base, dir)` loads. `results` (eval metrics, log history,
        ...) join the measured traffic in `actcomp_results.json` and the model card.
        """
        stats = self.stats(gather=True)  # collective: every rank, before rank 0 writes
        save_pretrained(self.weights, save_directory, model if model is not None else self.model, plan=self.plan,
                        blocks=[[r.start, r.stop] for r in self.ranges], stats=stats, results=results, **kwargs)

    def push_to_hub(self, repo_id: str, model: nn.Module | None = None, *, save_directory: str | None = None,
                    private: bool | None = None, token: str | bool | None = None,
                    commit_message: str = "Upload model trained with hf-actcomp") -> None:
        """Save (`save_pretrained`, with the model card) and upload to the Hub repo `repo_id`.
        Collective: call on every rank; rank 0 uploads (`hf_actcomp.hub.push_to_hub`). Without
        `save_directory`, a temporary folder made by rank 0 (every stage writes its shard there:
        the ranks must share a filesystem, as for any per-stage save)."""
        push_to_hub(lambda directory: self.save_pretrained(directory, model=model), self.weights, repo_id,
                    save_directory=save_directory, private=private, token=token, commit_message=commit_message)

    def load_stage_weights(self, directory: str | os.PathLike) -> None:
        """Load this stage's parameters from a `save_pretrained` directory, reading only its own
        tensors (for a PEFT pipeline: its adapter weights from `adapter_model.safetensors`)."""
        self.weights.load(directory)


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
            first call; the boundary codecs, send/recv, embeddings, head and loss stay eager
            (hf_actcomp/models/compile.py). `compile_kwargs`: torch.compile's backend, mode, ...

    `plan="auto"` is `Plan.auto(num_stages=world size)`: the codecs chosen from measured links.
    """
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"plan={plan!r}: give a hf_actcomp.Plan, or 'auto' (Plan.auto with one stage per process).")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("prepare(model, 'auto') needs torch.distributed to be initialised first (one stage "
                               "per process).")
        plan = Plan.auto(num_stages=dist.get_world_size())
    if isinstance(model, (str, os.PathLike)):
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a hf_actcomp.Plan, got {type(plan).__name__}.")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("prepare(name_or_path, plan) needs torch.distributed to be initialised first: it "
                               "loads the stage of this rank.")
        check_world_size(plan)  # before reading any weights
        model = load_stage_model(model, plan, torch_dtype=torch_dtype)
    elif torch_dtype is not None:
        raise ValueError("torch_dtype applies when prepare() loads a checkpoint by name or path; convert an "
                         "in-memory model with model.to(dtype) instead.")
    if activation_checkpointing:
        unwrap_peft(model).activation_checkpointing_enable()
    return Pipeline(model, plan, device=device, timeout=timeout, autocast_dtype=autocast_dtype,
                    track_error=track_error, compile=compile, compile_kwargs=compile_kwargs)


def _default_device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
