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
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint
from ..auto import describe as describe_decision
from ..auto import plan_boundaries, tie_compression
from ..batching import MicroBatch, check_batch, count_label_tokens, micro_batch_count, split_batch
from ..boundary import Boundary
from ..checkpoint import CompressionState, model_fingerprint
from ..codecs import make_codec
from ..dp import make_compressor
from ..dp.base import ring_allreduce_bytes
from ..dp.outer import OuterSync, bind_host, lighthouses
from ..generation import check_split_generation
from ..memory import replica_sample_range
from ..models import get_adapter, unwrap_peft
from ..models.compile import compile_blocks, compile_options
from ..models.router import RouterLoss, router_spec
from ..models.split import stage_ranges
from ..plan import Plan
from ..telemetry import TrafficCounter
from .checkpointing import StageWeights, free_other_parameters
from .generate import SplitGenerator
from .gradsync import GradientSync, TiedEmbedding
from .link import StageLink, naming_the_step
from .loading import load_stage_model
from .mesh import build_mesh, check_world_size
from .predictions import share_from_last
from .probe import agree, measure_links, timed_median
from .schedule import check_schedule_supports, fused, stage_actions
from .split_backward import input_gradient, weight_gradient, weights_of
from .stats import StageStats
from .transport import Transport
from .weights import push_to_hub, save_pretrained

logger = logging.getLogger(__name__)

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
        self.plan = plan
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
        _check_tied_embeddings(model, self.tied_pairs)
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
        self.forward_in = self.backward_out = self.forward_out = self.backward_in = None
        self._track_error = track_error
        self._build_boundaries(plan)
        # Plan.auto: measured and chosen at the first step (and every `adapt_every` optimizer steps).
        self.auto_switches: list[dict] = []
        self._optimizer_steps = 0
        self._at_optimizer_step = True
        self._decided_at = 0
        self.seconds_probing = 0.0
        if plan.autotune is not None:
            self.traffic["probe"] = TrafficCounter()
        # MoE with output_router_logits: the load-balancing loss's statistics ride along with the
        # activations (forward) and its gradient with the activation gradients (backward).
        self.router = RouterLoss(model, self.stage) if router_spec(model) is not None else None
        check_schedule_supports(plan.schedule, router_loss=self.router is not None)
        self._deferred: dict[int, list] = {}  # zbh1: what each micro-batch's `W` needs, from its `B`
        if self.router is not None:
            self.traffic["router"] = TrafficCounter()
        self.links = self._stage_links()
        self.dp_compressor = None
        if self.dp_group is not None:
            hook, params = plan.dp_hook()
            self.dp_compressor = make_compressor(hook, self.dp_group, **params)
            self.dp_compressor.param_names = {id(p): n for n, p in self.stage.named_parameters()}
        self.tie = self._tied_embedding()
        self.grads = GradientSync(self.stage, self.mesh, self.group, self.dp_compressor, self.tie,
                                  self.traffic["collectives"])
        self.outer = self._outer_sync() if plan.diloco is not None else None
        self.data_parallel = self.dp_compressor or self.outer  # what talks between replicas, if anything
        self.compression = self._compression_state()
        self.weights = StageWeights(self.stage, self.mesh, self.group, self.tied_pairs, self.peft_model)
        self._sync = True
        self.counters = StageStats(self.mesh, self.group, self.traffic, self.transport, self.grads,
                                   self.data_parallel, self.outer)
        self.generator = SplitGenerator(self.mesh, self.transport, self.device, ranges[s], self.hidden_size, self.tie,
                                        self.traffic["inference"], self._autocast)

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
    def boundaries(self) -> dict[str, Boundary]:
        """The boundary ends this rank holds, by name (`boundary0.forward`, ...)."""
        ends = (self.forward_in, self.backward_out, self.forward_out, self.backward_in)
        return {b.name: b for b in ends if b is not None}

    def _build_boundaries(self, plan: Plan, previous: dict[str, Boundary] | None = None) -> None:
        """The ends of the two boundaries this stage touches (boundary b joins stage b and b+1),
        with `plan`'s codecs. With `previous` (a switch by Plan.auto), an end whose codec did not
        change is kept as it is; a new one keeps its counters, and AQ-SGD memory moves over when
        both codecs are AQ-SGD (only its bit width changed); entering AQ-SGD starts a fresh one."""
        s, last = self.mesh.stage, self.mesh.num_stages - 1
        ends = {}
        if s > 0:
            ends["forward_in"] = (s - 1, "forward", dict(sender=False, sample_range=self.sample_range))
            ends["backward_out"] = (s - 1, "backward", dict(receiver=False, track_error=self._track_error))
        if s < last:
            ends["forward_out"] = (s, "forward", dict(receiver=False, track_error=self._track_error,
                                                     sample_range=self.sample_range))
            ends["backward_in"] = (s, "backward", dict(sender=False))
        for key, (b, direction, kwargs) in ends.items():
            name = f"boundary{b}.{direction}"
            compression = plan.forward_at(b) if direction == "forward" else plan.backward_at(b)
            old = (previous or {}).get(name)
            if old is not None and old.compression == compression:
                setattr(self, key, old)
                continue
            end = Boundary(name, compression, plan.memory if direction == "forward" else None, **kwargs)
            if old is not None:
                end.stats = old.stats
                if old.compression.method == compression.method == "aqsgd":
                    end.adopt_memory(old)
            setattr(self, key, end)

    def _compression_state(self) -> CompressionState:
        r, s = self.ranges[self.stage_index], self.stage_index
        return CompressionState(
            {**self.boundaries, "tie": self.tie, "data_parallel": self.data_parallel},
            rank=self.replica * self.mesh.num_stages + s,  # the rank in a launch of every replica
            metadata={"plan": self.plan.to_dict(), "world_size": self.plan.world_size, "stage": s,
                      "blocks": [r.start, r.stop], "model": model_fingerprint(self.config)})

    def _stage_links(self) -> dict[str, StageLink]:
        """The wire format of each boundary direction this rank touches: `forward_in`,
        `backward_out` (to the previous stage), `forward_out`, `backward_in` (the next stage)."""
        router = self.router
        sides = {"forward": router.stats_numel if router else 0, "backward": router.num_experts if router else 0}
        ends = {"forward_in": (self.forward_in, self.mesh.prev_rank), "backward_out": (self.backward_out, self.mesh.prev_rank),
                "forward_out": (self.forward_out, self.mesh.next_rank), "backward_in": (self.backward_in, self.mesh.next_rank)}
        return {key: StageLink(b, self.transport, peer, self.boundary_dtype,
                               side_numel=sides[key.split("_")[0]],
                               side_counter=self.traffic.get("router"))
                for key, (b, peer) in ends.items() if b is not None}

    def _tied_embedding(self) -> TiedEmbedding | None:
        """This stage's end of the embedding tied between the first and the last stage."""
        if self.mesh.num_stages == 1 or not (self.is_first or self.is_last):
            return None
        own = dict(self.stage.named_parameters())
        for later, first in self.tied_pairs:
            name = first if self.is_first else later
            if name in own:
                return TiedEmbedding(own[name], self.mesh, self.transport, self.traffic["tie"],
                                     self.plan.tie_compression)
        return None

    # ------------------------------------------------------------------------- replicas joined by outer steps
    def _outer_sync(self) -> OuterSync:
        """DiLoCo's replica group of this stage (torchft)."""
        host = bind_host()
        self._lighthouses, addresses = lighthouses(self.plan, host)  # servers this rank started (kept alive)
        return OuterSync(self.plan.diloco, self.grads.trainable(), stage=self.stage_index,
                         num_stages=self.mesh.num_stages, replica=self.replica, num_replicas=self.num_replicas,
                         lighthouse=addresses[self.stage_index], host=host, timeout=self.timeout)

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
        if self._auto_due():
            self._auto_select(micro, batch["input_ids"])
        start = time.perf_counter()
        num_tokens = count_label_tokens(batch["labels"])
        normaliser = self._loss_normaliser(num_tokens, num_items_in_batch)
        self._post_receives(micro, training=True)
        if self.tie is not None:
            self.tie.share_rows(batch["input_ids"])
        saved: dict[int, tuple] = {}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        actions = fused(stage_actions(self.plan.schedule, self.stage_index, self.mesh.num_stages, len(micro)))
        with self._naming_the_step("training"):
            for k, (kind, i) in enumerate(actions):
                pair = k + 1 < len(actions) and self._receives(actions[k + 1][0])
                if kind == "F":
                    saved[i] = self._forward(i, micro[i], normaliser, pair)
                    if self.is_last:
                        total += saved[i][1].detach().float()
                elif kind == "W":
                    if i in self._deferred:  # the first stage ran its whole backward at `B`
                        weight_gradient(weights_of(self.stage), self._deferred.pop(i))
                else:
                    self._backward(i, *saved.pop(i), pair, split=kind == "B")
        if self.tie is not None:
            self.tie.gather_gradient(batch["input_ids"])
        self.transport.flush()
        self._at_optimizer_step = self._sync if sync is None else sync
        if self._at_optimizer_step:
            self.grads.average_over_replicas()
            self._optimizer_steps += 1
        loss = self._broadcast_loss(self._mean_over_replicas(total))
        self.counters.seconds_step += time.perf_counter() - start
        self.counters.steps += 1
        return StepOutput(loss=loss, num_tokens=num_tokens)

    # ------------------------------------------------------------------------- Plan.auto
    def _auto_due(self) -> bool:
        """Measure and choose now: at the first step of an undecided `Plan.auto`, and every
        `adapt_every` optimizer steps after (only between optimizer steps)."""
        config = self.plan.autotune
        if config is None:
            return False
        if config.decision is None:
            return True
        return (config.adapt_every is not None and self._at_optimizer_step
                and self._optimizer_steps - self._decided_at >= config.adapt_every)

    def _auto_select(self, micro: list[MicroBatch], input_ids: torch.Tensor) -> None:
        """Measure the compute and the links, agree on the codecs (rank 0 decides), apply them.
        The tie's codec is chosen once, at the first decision, when the plan leaves it unset."""
        config = self.plan.autotune
        start = time.perf_counter()
        shape = self._shape(micro[0])  # the largest micro-batch (tensor_split puts extra rows first)
        nbytes = math.prod(shape) * torch.empty((), dtype=self.boundary_dtype).element_size()
        compute = self._measure_compute(micro[0], config.probe_repeats)
        counter = self.traffic["probe"]
        links = measure_links(self.transport, self.mesh, self.device, nbytes, config.probe_repeats, counter)
        tie_rows = None
        if config.decision is None and self.plan.tie_compression is None and self.tie is not None and self.tie.active:
            tie_rows = int(TiedEmbedding.rows_of(input_ids).numel())  # known on rank 0 (the first stage)
        decision = agree(config, self.mesh, compute, links, shape, self.boundary_dtype, self.device, counter,
                         len(micro), tie_rows)
        decision["optimizer_step"] = self._optimizer_steps
        self._apply_decision(decision)
        self.seconds_probing += time.perf_counter() - start

    def _measure_compute(self, mb: MicroBatch, repeats: int) -> float:
        """Seconds of this stage's forward and backward of one micro-batch (the median of
        `repeats` runs on stand-in inputs of its shape), leaving gradients and random state as
        they were: a run that keeps its codecs is the run it would have been."""
        params = [p for p in self.stage.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None

        def run() -> None:
            x = mb.input_ids if self.is_first else torch.randn(
                self._shape(mb), dtype=self.boundary_dtype, device=self.device, requires_grad=True)
            with self._autocast():
                out = self.stage(x, mb.attention_mask)
                loss = self._loss(out, mb.labels, None) if self.is_last else out.float().sum()
            loss.backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for p in params:
                p.grad = None

        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                return timed_median(run, repeats)
        finally:
            for p, grad in zip(params, saved, strict=True):
                p.grad = grad

    def _apply_decision(self, decision: dict, why: str = "measured") -> None:
        """Switch to the codecs `decision` chose (where they differ), log what changed."""
        previous = self.boundaries
        plan = dataclasses.replace(self.plan, boundaries=plan_boundaries(decision),
                                   autotune=dataclasses.replace(self.plan.autotune, decision=decision))
        if "tie" in decision:  # only in a first decision (or the saved one): no tie row has crossed yet
            plan = dataclasses.replace(plan, tie_compression=tie_compression(decision))
            if self.tie is not None:
                self.tie.set_compression(plan.tie_compression)
        self._build_boundaries(plan, previous)
        self.plan = plan
        self.links = self._stage_links()
        self.compression = self._compression_state()
        self._decided_at = self._optimizer_steps
        if self.mesh.rank == 0:
            logger.info("%s", describe_decision(decision))
        if self._optimizer_steps == 0:
            return  # the first choice, before any training: nothing is switched
        for name, old in previous.items():
            new = self.boundaries[name].compression
            if new == old.compression:
                continue
            memory = ("AQ-SGD memory kept" if old.compression.method == new.method == "aqsgd"
                      else "AQ-SGD memory started empty" if new.method == "aqsgd" else "")
            self.auto_switches.append({"optimizer_step": self._optimizer_steps, "channel": name,
                                       "from": old.compression.describe(), "to": new.describe(), "memory": memory,
                                       "why": why})
            logger.info("Plan.auto: %s switched from %s to %s at optimizer step %d%s", name,
                        old.compression.describe(), new.describe(), self._optimizer_steps,
                        f" ({memory})" if memory else "")

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
                normaliser = (self._loss_normaliser(num_tokens, None) if num_items_in_batch is None else
                              torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=self.device))
            counter = self.traffic["evaluation"]
            receiver = self.forward_in and (self.forward_in.inference if compress else self._uncompressed)
            sender = self.forward_out and (self.forward_out.inference if compress else self._uncompressed)
            self._post_receives(micro, training=False, codec=receiver)
            if self.tie is not None:
                self.tie.share_rows(batch["input_ids"], counter)
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            for i, mb in enumerate(micro):
                x, side = mb.input_ids, None
                if not self.is_first:
                    with self._naming_the_step("evaluation"):
                        x, side = self.links["forward_in"].receive(i, self._shape(mb), codec=receiver)
                with self._autocast(), self._collecting_routers():
                    out = self.stage(x, mb.attention_mask)
                stats, probs = self.router.partial(mb.attention_mask, self.device, side) if self.router else (None, None)
                if self.is_last:
                    if keep_logits:
                        logits.append(out)
                    if has_labels:
                        loss = self._loss(out, mb.labels, normaliser).float()
                        total += loss if stats is None else loss + self.router.whole_loss(stats, probs)
                else:
                    self.links["forward_out"].send(i, out, stats, codec=sender, counter=counter)
            self.transport.flush()
        finally:
            self.stage.train(was_training)
        loss = self._broadcast_loss(self._mean_over_replicas(total)) if has_labels else None
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

    def _shape(self, mb: MicroBatch) -> tuple[int, ...]:
        """The shape of what crosses a boundary for micro-batch `mb` (either direction)."""
        return (*mb.input_ids.shape, self.hidden_size)

    def _post_receives(self, micro: list[MicroBatch], *, training: bool, codec=None) -> None:
        """Post every receive of the step at its start (sizes are known without data), so that a
        payload can travel while this stage computes; see `Transport` for when they hit the wire.
        Evaluation receives activations only, through the stateless `codec`."""
        for i, mb in enumerate(micro):
            if not self.is_first:
                self.links["forward_in"].post(i, self._shape(mb), self.device,
                                              f"{'' if training else 'eval '}activations of micro-batch {i}",
                                              sample_ids=mb.sample_id if training else None, codec=codec)
            if training and not self.is_last:
                self.links["backward_in"].post(i, self._shape(mb), self.device, f"gradients of micro-batch {i}")

    def _receives(self, kind: str) -> bool:
        """Whether an action of this kind starts by receiving (so a send can be paired with it)."""
        return {"F": not self.is_first, "B": not self.is_last, "BW": not self.is_last}.get(kind, False)

    def _loss_normaliser(self, num_tokens: int, num_items_in_batch) -> torch.Tensor | None:
        """What this replica divides its token-loss sum by (on the last stage; None = the mean).

        Replicas hold different shards (and token counts) and their gradients are then averaged:
        each divides by the global token count over D, so the average is the global batch's loss.
        """
        if not self.is_last:
            return None
        if num_items_in_batch is not None:
            return torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=self.device) / self.num_replicas
        if self.dp_group is not None:
            total = torch.tensor(float(num_tokens), device=self.device)
            self._all_reduce(total, self.dp_group, self.num_replicas)
            return total / self.num_replicas
        if self.plan.micro_batches > 1:
            return torch.tensor(num_tokens, device=self.device)
        return None

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, normaliser) -> torch.Tensor:
        return self.loss_function(logits, labels, vocab_size=self.config.vocab_size, num_items_in_batch=normaliser)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _forward(self, i: int, mb: MicroBatch, normaliser, pair: bool) -> tuple:
        """(input, output or loss, router probabilities or None) of micro-batch `i`, kept for its backward."""
        x, side = mb.input_ids, None
        if not self.is_first:
            x, side = self.links["forward_in"].receive(i, self._shape(mb), sample_ids=mb.sample_id)
            x = x.detach().requires_grad_(True)
        with self._autocast(), self._collecting_routers():
            out = self.stage(x, mb.attention_mask)
            if self.is_last:
                loss = self._loss(out, mb.labels, normaliser)
        stats, probs = self.router.partial(mb.attention_mask, self.device, side) if self.router else (None, None)
        if self.is_last:
            if probs is not None:
                if not probs.requires_grad:  # no router on this stage: a leaf, for its gradient
                    probs.requires_grad_(True)
                probs.retain_grad()  # its gradient goes back to every earlier stage's routers
                loss = loss + self.router.whole_loss(stats, probs)
            return x, loss, probs
        self.links["forward_out"].send(i, out, stats, sample_ids=mb.sample_id, with_next_recv=pair)
        return x, out, probs

    def _backward(self, i: int, x: torch.Tensor, out: torch.Tensor, probs: torch.Tensor | None, pair: bool,
                  split: bool = False) -> None:
        """Micro-batch `i`'s backward, sending the input's gradient upstream. `split` (a `B`
        whose `W` comes later): only the input gradient now; the weights' at its `W`."""
        router_grad = None
        if split and not self.is_first:
            grad = None if self.is_last else self.links["backward_in"].receive(i, out.shape)[0].to(out.dtype)
            self._deferred[i] = input_gradient(out, grad, x, weights_of(self.stage))
        elif self.is_last:
            out.backward()  # `out` is this micro-batch's loss
            router_grad = None if probs is None else probs.grad
        else:
            grad, router_grad = self.links["backward_in"].receive(i, out.shape)
            if probs is not None and probs.requires_grad:
                torch.autograd.backward([out, probs], [grad.to(out.dtype), router_grad])
            else:
                out.backward(grad.to(out.dtype))
        if self.is_first:
            return
        self.links["backward_out"].send(i, x.grad, router_grad, with_next_recv=pair)

    # -- the router side channel (MoE load-balancing loss), empty for every other model
    def _collecting_routers(self):
        return self.router.collecting() if self.router is not None else contextlib.nullcontext()

    def count_over_replicas(self, count: int) -> int:
        """The sum of `count` over this stage's replicas (e.g. label tokens of an optimizer step,
        for `num_items_in_batch`). Collective over the data-parallel group."""
        if self.dp_group is None:
            return int(count)
        total = torch.tensor(int(count), dtype=torch.int64, device=self.device)
        self._all_reduce(total, self.dp_group, self.num_replicas)
        return int(total.item())

    def _all_reduce(self, t: torch.Tensor, group, size: int) -> None:
        """A small collective of the step (token counts, losses), timed and counted."""
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        self.traffic["collectives"].add(ring_allreduce_bytes(t.numel() * t.element_size(), size))
        self.counters.seconds_collectives += time.perf_counter() - start

    def _broadcast_loss(self, total: torch.Tensor) -> torch.Tensor:
        if self.mesh.num_stages > 1:
            start = time.perf_counter()
            dist.broadcast(total, src=self.mesh.ranks[-1], group=self.group)
            if self.is_last:
                self.traffic["collectives"].add(total.numel() * total.element_size() * (self.mesh.num_stages - 1))
            self.counters.seconds_collectives += time.perf_counter() - start
        return total

    def _mean_over_replicas(self, total: torch.Tensor) -> torch.Tensor:
        """The global batch's loss from each replica's share (last stages only)."""
        if self.dp_group is not None and self.is_last:
            self._all_reduce(total, self.dp_group, self.num_replicas)
            total /= self.num_replicas
        return total

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
        replicas = self.num_replicas
        if replicas == 1:
            return dataset
        usable = len(dataset) - len(dataset) % replicas
        if usable == 0:
            raise ValueError(f"A dataset of {len(dataset)} rows cannot give {replicas} replicas a row each.")
        if usable < len(dataset):
            logger.warning("Dropping the last %d of %d rows so that %d replicas get equal shards.",
                           len(dataset) - usable, len(dataset), replicas)
        return dataset.select(range(usable)).shard(replicas, self.replica, contiguous=True)

    # ------------------------------------------------------------------------- telemetry
    def stats(self, gather: bool = False) -> dict:
        """What THIS rank sent between ranks, by category (`categories`: activations, activation
        gradients, tied-embedding rows, loss/token-count collectives, data-parallel hook), per
        boundary direction (`channels`), the ratio over all of it, relative errors, and this
        stage's seconds computing vs waiting on communication.

        With `gather=True` (collective: call on every rank of the pipeline) the counters of all
        its ranks are merged.
        """
        auto = None
        if self.plan.autotune is not None:
            auto = {"decision": self.plan.autotune.decision, "switches": list(self.auto_switches)}
        return self.counters.summary(self._local_counters(), gather, auto)

    def _local_counters(self) -> dict:
        # Counted where sent: the sending ends of this rank's boundaries.
        channels = {b.name: b.stats for b in (self.forward_out, self.backward_out) if b is not None}
        return self.counters.local(channels, self.seconds_probing if self.plan.autotune is not None else None)

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
        if self.plan.autotune is None:
            return
        saved = Plan.from_dict(checkpoint.saved_metadata(directory, self.compression.rank)["plan"])
        if saved.autotune is not None and saved.autotune.decision is not None:
            self._apply_decision(saved.autotune.decision, why="resumed")

    def register_for_checkpointing(self, accelerator) -> None:
        """Make `accelerator.save_state(dir)` / `load_state(dir)` also save / load every rank's
        compression state under `dir/actcomp_state`."""
        self.compression.register_for_checkpointing(accelerator)

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


def _check_tied_embeddings(model: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """The tie exchange sends embedding rows: the first name of each tied pair must be a token
    embedding (`nn.Embedding`). Checked on the full model, identically on every rank."""
    for later, first in pairs:
        module = model.get_submodule(first.rsplit(".", 1)[0]) if "." in first else model
        if not isinstance(module, nn.Embedding):
            raise ValueError(
                f"{later!r} is tied to {first!r}, which is not an nn.Embedding: only a head tied to the input "
                "token embedding is supported across pipeline stages. Untie it (tie_word_embeddings=False)."
            )
