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
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import checkpoint
from ..dp import make_compressor
from ..feedback import build_inference_codec, build_receiver, build_sender
from ..memory import check_sample_ids
from ..models import get_adapter
from ..plan import Plan
from ..simulate import stage_ranges
from ..telemetry import ChannelStats, summarize
from .mesh import build_mesh
from .schedule import stage_actions
from .transport import Transport

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 300.0
COMPRESSION_STATE_DIR = "actcomp_state"


@dataclass
class StepOutput:
    """What `train_step` / `eval_step` return on every rank.

    `loss` is the token-weighted mean over the whole batch (all micro-batches), as the unsplit
    model's `model(**batch).loss`; `num_tokens` is the number of tokens it averages over.
    """

    loss: torch.Tensor
    num_tokens: int


class Pipeline(nn.Module):
    """This rank's stage of a model split by `plan`, with compressed boundaries to its neighbours.

    Use `parameters()` with any optimizer; call `train_step(batch)` with the SAME batch on every
    rank, then `clip_grad_norm_`, `optimizer.step()` and `zero_grad()` as usual.
    """

    def __init__(self, model: nn.Module, plan: Plan, *, device: torch.device | str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, autocast_dtype: torch.dtype | None = None,
                 track_error: bool = True) -> None:
        super().__init__()
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a hf_actcomp.Plan, got {type(plan).__name__}.")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "hf_actcomp.prepare() needs torch.distributed to be initialised: run under `accelerate launch` "
                "(create the Accelerator first) or `torchrun`, or call torch.distributed.init_process_group()."
            )
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
        self.plan = plan
        self.timeout = float(timeout)
        self.autocast_dtype = autocast_dtype
        adapter = get_adapter(model)  # unsupported families fail here, before any collective
        ranges = stage_ranges(adapter, plan)
        if plan.data_parallel > 1 and plan.dp_hook()[0] == "powersgd":
            raise ValueError("Plan.dp_compression='powersgd' is torch's DDP hook; inside prepare() use one of "
                             "allreduce, dgc, ef_sign, marsit, qsgd, randk, topk.")
        self.mesh, groups = build_mesh(plan, self.timeout)
        self.group, self.tie_group, self.dp_group = groups.pipeline, groups.tie, groups.data_parallel
        s, last = self.mesh.stage, self.mesh.num_stages - 1
        self.ranges = ranges
        self.config = model.config
        self.loss_function = model.loss_function
        self.device = torch.device(device) if device is not None else _default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL collectives and *_object calls use the current device
        stage = adapter.build_stage(ranges[s].start, ranges[s].stop, first=s == 0, last=s == last)
        _free_other_parameters(model, stage)
        self.stage = stage.to(self.device)
        self.boundary_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.hidden_size = int(self.config.hidden_size)
        self.tied = self._tied_parameters(adapter)
        self.transport = Transport(self.group, self.mesh.rank, self.timeout)

        # The ends of the two boundaries this stage touches (boundary b joins stage b and b+1).
        self.forward_receiver = self.backward_sender = self.forward_sender = self.backward_receiver = None
        self.channels: dict[str, ChannelStats] = {}
        if s > 0:
            name = f"boundary{s - 1}"
            self.forward_receiver = build_receiver(plan.forward, plan.memory, f"{name}.forward")
            self.backward_sender = build_sender(plan.backward, None, f"{name}.backward", track_error=track_error)
            self.inference_decoder = build_inference_codec(plan.forward)
            self.channels[f"{name}.backward"] = ChannelStats()
        if s < last:
            name = f"boundary{s}"
            self.forward_sender = build_sender(plan.forward, plan.memory, f"{name}.forward", track_error=track_error)
            self.backward_receiver = build_receiver(plan.backward, None, f"{name}.backward")
            self.inference_encoder = build_inference_codec(plan.forward)
            self.channels[f"{name}.forward"] = ChannelStats()
        self.dp_compressor = None
        if self.dp_group is not None:
            hook, params = plan.dp_hook()
            self.dp_compressor = make_compressor(hook, self.dp_group, **params)
            self.dp_compressor.param_names = {id(p): n for n, p in self.stage.named_parameters()}
        self.seconds_step = 0.0
        self.steps = 0

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

    def _tied_parameters(self, adapter) -> list[nn.Parameter]:
        """This stage's copies of parameters tied between the first and the last stage."""
        if self.mesh.num_stages == 1:
            return []
        own = dict(self.stage.named_parameters())
        names = [first if self.is_first else later for later, first in adapter.tied_weights()]
        found = [own[n] for n in names if n in own]
        return found if (self.is_first or self.is_last) else []

    # ------------------------------------------------------------------------- steps
    def train_step(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        """Forward and backward of all micro-batches of `batch` (the same batch on every rank).

        Gradients accumulate into this stage's parameters; the loss is returned on every rank.
        """
        self.stage.train()
        start = time.perf_counter()
        micro, num_items, num_tokens = self._split_batch(batch, training=True)
        saved: dict[int, tuple] = {}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        actions = stage_actions(self.plan.schedule, self.stage_index, self.mesh.num_stages, len(micro))
        for kind, i in actions:
            if kind == "F":
                saved[i] = self._forward(i, micro[i], num_items)
                if self.is_last:
                    total += saved[i][1].detach().float()
            else:
                self._backward(i, *saved.pop(i))
        self.transport.flush()
        self._sync_tied_gradients()
        self._average_over_replicas()
        loss = self._broadcast_loss(self._mean_over_replicas(total))
        self.seconds_step += time.perf_counter() - start
        self.steps += 1
        return StepOutput(loss=loss, num_tokens=num_tokens)

    @torch.no_grad()
    def eval_step(self, batch: dict[str, torch.Tensor]) -> StepOutput:
        """Loss of `batch` without gradients, through the stateless inference codec (AQ-SGD falls
        back as `Compression.inference` says); training state is not touched."""
        self.stage.eval()
        micro, num_items, num_tokens = self._split_batch(batch, training=False)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for ids, mask, labels, _ in micro:
            shape = (ids.shape[0], ids.shape[1], self.hidden_size)
            x = ids
            if not self.is_first:
                nbytes = self.inference_decoder.payload_nbytes(shape, self.boundary_dtype)
                payload = self.transport.recv(nbytes, self.mesh.prev_rank, self.device, "eval activations")
                x = self.inference_decoder.decode(payload, shape, self.boundary_dtype)
            with self._autocast():
                out = self.stage(x, mask)
            if self.is_last:
                total += self._loss(out, labels, num_items).float()
            else:
                self.transport.send(self.inference_encoder.encode(out.to(self.boundary_dtype)), self.mesh.next_rank)
        self.transport.flush()
        self.stage.train()
        return StepOutput(loss=self._broadcast_loss(self._mean_over_replicas(total)), num_tokens=num_tokens)

    def _split_batch(self, batch: dict[str, torch.Tensor], training: bool):
        """Validate the batch (identically on every rank, before any message) and cut it into
        micro-batches of (input_ids, attention_mask, labels, sample_id)."""
        unknown = set(batch) - {"input_ids", "attention_mask", "labels", "sample_id"}
        if "input_ids" not in batch or unknown:
            raise ValueError(
                f"A pipeline batch has input_ids (required), attention_mask, labels and sample_id; got keys "
                f"{sorted(batch)}."
            )
        ids = batch["input_ids"]
        rows, num_micro = ids.shape[0], self.plan.micro_batches
        if rows < num_micro:
            raise ValueError(
                f"A batch of {rows} rows cannot be split into plan.micro_batches={num_micro}; "
                f"use a batch size >= {num_micro}."
            )
        labels = batch.get("labels")
        if labels is None:
            raise ValueError("The batch needs 'labels' to compute the loss on the last stage.")
        sample_id = batch.get("sample_id")
        if training and self.plan.forward.method == "aqsgd":
            if sample_id is None:
                raise ValueError(
                    "AQ-SGD needs a 'sample_id' entry in every training batch. "
                    "Add it with hf_actcomp.add_sample_ids(dataset)."
                )
            check_sample_ids(sample_id, self.plan.memory.num_samples, rows)
        num_tokens = int((labels[..., 1:] != -100).sum())
        num_items = torch.tensor(num_tokens, device=self.device) if num_micro > 1 else None
        if self.dp_group is not None and self.is_last:
            # Replicas hold different shards (and token counts): normalise by the tokens of the
            # whole global batch, times D because the replicas' gradients are then averaged.
            total = torch.tensor(float(num_tokens), device=self.device)
            dist.all_reduce(total, group=self.dp_group)
            num_items = total / self.num_replicas

        def split(t: torch.Tensor | None) -> list:
            return [None] * num_micro if t is None else list(torch.tensor_split(t.to(self.device), num_micro))

        micro = list(zip(split(ids), split(batch.get("attention_mask")), split(labels),
                         split(sample_id), strict=True))
        return micro, num_items, num_tokens

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, num_items) -> torch.Tensor:
        return self.loss_function(logits, labels, vocab_size=self.config.vocab_size, num_items_in_batch=num_items)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _forward(self, i: int, micro, num_items) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask, labels, sample_id = micro
        x = ids
        if not self.is_first:
            shape = (ids.shape[0], ids.shape[1], self.hidden_size)
            nbytes = self.forward_receiver.payload_nbytes(shape, self.boundary_dtype, sample_id)
            payload = self.transport.recv(nbytes, self.mesh.prev_rank, self.device, f"activations of micro-batch {i}")
            x = self.forward_receiver.decode(payload, shape, self.boundary_dtype, sample_ids=sample_id, slot=i)
            x = x.detach().requires_grad_(True)
        with self._autocast():
            out = self.stage(x, mask)
            if self.is_last:
                return x, self._loss(out, labels, num_items)
        h = out.detach().to(self.boundary_dtype)
        stats = self.channels[f"boundary{self.stage_index}.forward"]
        with stats.timing("encode"):
            payload = self.forward_sender.encode(h, sample_ids=sample_id, slot=i)
        stats.record(h, payload.numel(), self.forward_sender.last_reconstruction)
        self.transport.send(payload, self.mesh.next_rank)
        return x, out

    def _backward(self, i: int, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.is_last:
            out.backward()  # `out` is this micro-batch's loss
        else:
            nbytes = self.backward_receiver.payload_nbytes(out.shape, self.boundary_dtype)
            payload = self.transport.recv(nbytes, self.mesh.next_rank, self.device, f"gradients of micro-batch {i}")
            grad = self.backward_receiver.decode(payload, out.shape, self.boundary_dtype, slot=i)
            out.backward(grad.to(out.dtype))
        if self.is_first:
            return
        g = x.grad.contiguous()
        stats = self.channels[f"boundary{self.stage_index - 1}.backward"]
        with stats.timing("encode"):
            payload = self.backward_sender.encode(g, slot=i)
        stats.record(g, payload.numel(), self.backward_sender.last_reconstruction)
        self.transport.send(payload, self.mesh.prev_rank)

    def _broadcast_loss(self, total: torch.Tensor) -> torch.Tensor:
        if self.mesh.num_stages > 1:
            start = time.perf_counter()
            dist.broadcast(total, src=self.mesh.ranks[-1], group=self.group)
            self.transport.seconds_waiting += time.perf_counter() - start
        return total

    def _mean_over_replicas(self, total: torch.Tensor) -> torch.Tensor:
        """The global batch's loss from each replica's share (last stages only)."""
        if self.dp_group is not None and self.is_last:
            dist.all_reduce(total, group=self.dp_group)
            total /= self.num_replicas
        return total

    def _average_over_replicas(self) -> None:
        """Average this stage's gradients over its copies in the other replicas, through the
        plan's data-parallel hook (one flat buffer per step, parameters in name order)."""
        if self.dp_compressor is None:
            return
        start = time.perf_counter()
        params = [p for _, p in sorted(self.stage.named_parameters())]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        averaged = self.dp_compressor.reduce(flat, params)
        self.dp_compressor.end_step()
        for p, g in zip(params, averaged.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))
        self.transport.seconds_waiting += time.perf_counter() - start

    def _sync_tied_gradients(self) -> None:
        """First and last stage hold copies of tied embeddings: give both the summed gradient, as
        the unsplit model's single tensor would get, so identical optimizer steps keep them equal."""
        if self.tie_group is None or not self.tied:
            return
        for p in self.tied:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=self.tie_group)
            p.grad = grad

    # ------------------------------------------------------------------------- optimisation helpers
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm over all stages (tied copies counted once), like
        `torch.nn.utils.clip_grad_norm_` on the unsplit model. Returns the total norm."""
        if norm_type != 2.0:
            raise ValueError(f"norm_type={norm_type!r} is not supported; only 2.0.")
        skip = {id(p) for p in self.tied} if self.is_last and not self.is_first else set()
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        counted = [p.grad for p in self.stage.parameters() if p.grad is not None and id(p) not in skip]
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in counted:
            local += g.detach().float().pow(2).sum()
        if self.mesh.num_stages > 1:
            dist.all_reduce(local, group=self.group)
        total = local.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    # ------------------------------------------------------------------------- telemetry
    def stats(self, gather: bool = False) -> dict:
        """Bytes sent and uncompressed per boundary direction that THIS rank sends, the ratio,
        relative errors, and this stage's seconds computing vs waiting on communication.

        With `gather=True` (collective: call on every rank) the channels of all ranks are merged.
        """
        summary = summarize(self.channels)
        timing = {
            "steps": self.steps,
            "seconds_step": self.seconds_step,
            "seconds_waiting": self.transport.seconds_waiting,
            "seconds_computing": max(self.seconds_step - self.transport.seconds_waiting, 0.0),
        }
        summary["stages"] = {self.stage_index: timing}
        if self.dp_compressor is not None:
            summary["data_parallel"] = self.dp_compressor.stats()
        if not gather or self.mesh.num_stages == 1:
            return summary
        parts: list = [None] * self.mesh.num_stages
        dist.all_gather_object(parts, (self.channels, timing), group=self.group)
        merged = summarize({name: c for channels, _ in parts for name, c in channels.items()})
        merged["stages"] = {s: t for s, (_, t) in enumerate(parts)}
        if self.dp_compressor is not None:
            merged["data_parallel"] = self.dp_compressor.stats()
        return merged

    def reset_stats(self) -> None:
        self.channels = {name: ChannelStats() for name in self.channels}
        self.seconds_step = 0.0
        self.transport.seconds_waiting = 0.0
        self.steps = 0

    # ------------------------------------------------------------------------- state
    def _ends(self) -> dict:
        return {
            "forward_receiver": self.forward_receiver,
            "backward_sender": self.backward_sender,
            "forward_sender": self.forward_sender,
            "backward_receiver": self.backward_receiver,
        }

    def compression_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's EF buffers, AQ-SGD memories, codec counters and data-parallel hook state."""
        state = {f"{part}.{k}": v for part, end in self._ends().items() if end is not None
                 for k, v in end.state_dict().items()}
        if self.dp_compressor is not None:
            state.update({f"data_parallel.{k}": v for k, v in self.dp_compressor.state_dict().items()})
        return state

    def load_compression_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.dp_compressor is not None:
            self.dp_compressor.load_state_dict(
                {k[len("data_parallel."):]: v for k, v in state.items() if k.startswith("data_parallel.")})
        for part, end in self._ends().items():
            if end is not None:
                prefix = f"{part}."
                end.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    def _state_metadata(self) -> dict:
        r = self.ranges[self.stage_index]
        return {"plan": self.plan.to_dict(), "world_size": self.plan.world_size, "stage": self.stage_index,
                "blocks": [r.start, r.stop]}

    def save_compression_state(self, directory: str | os.PathLike,
                               max_shard_size: int | str = checkpoint.DEFAULT_MAX_SHARD_SIZE) -> None:
        """Write this rank's compression state to `directory` (safetensors, sharded when large).
        Call on every rank."""
        checkpoint.save_state(directory, self.mesh.rank, self.compression_state_dict(), self._state_metadata(),
                              max_shard_size=max_shard_size)

    def load_compression_state(self, directory: str | os.PathLike) -> None:
        """Read this rank's state saved by `save_compression_state` under the same plan."""
        self.load_compression_state_dict(checkpoint.load_state(directory, self.mesh.rank, self._state_metadata()))

    def register_for_checkpointing(self, accelerator) -> None:
        """Make `accelerator.save_state(dir)` / `load_state(dir)` also save / load every rank's
        compression state under `dir/actcomp_state` (Accelerate alone saves custom state on the
        main process only)."""

        def save_hook(models, weights, output_dir):
            self.save_compression_state(os.path.join(output_dir, COMPRESSION_STATE_DIR))

        def load_hook(models, input_dir):
            self.load_compression_state(os.path.join(input_dir, COMPRESSION_STATE_DIR))

        accelerator.register_save_state_pre_hook(save_hook)
        accelerator.register_load_state_pre_hook(load_hook)

    def save_pretrained(self, save_directory: str | os.PathLike, model: nn.Module | None = None,
                        **kwargs) -> None:
        """Gather every stage's parameters on rank 0 and write ONE Transformers checkpoint
        (safetensors) plus `actcomp_config.json`. Collective: call on every rank.

        `model` is the model passed to `prepare` (its config and class are used on rank 0).
        """
        own = {name: p.detach().cpu() for name, p in self.stage.named_parameters()}
        parts: list = [None] * self.mesh.num_stages
        dist.all_gather_object(parts, own, group=self.group)
        if self.mesh.rank == 0:  # stage 0 of replica 0: the replicas hold the same weights
            if model is None:
                raise ValueError("save_pretrained needs the model passed to prepare(), for its class and config.")
            full = {}
            for part in parts:
                full.update(part)
            _restore_parameters(model, full)
            model.save_pretrained(save_directory, **kwargs)
            self.plan.save_pretrained(save_directory)
            _free_other_parameters(model, self.stage)
        dist.barrier(group=self.group)


def prepare(model: nn.Module, plan: Plan, *, device: torch.device | str | None = None,
            timeout: float = DEFAULT_TIMEOUT, autocast_dtype: torch.dtype | None = None,
            track_error: bool = True) -> Pipeline:
    """Split `model` into the plan's stages across the processes of this job; keep this rank's.

    Call in every process with the same model (same initialisation) and plan. The plan must have
    one stage per process. Args:
        device: where this stage runs (default: `cuda:LOCAL_RANK` when CUDA is available, else CPU).
        timeout: seconds any wait on a peer may take before the step fails with `PeerTimeoutError`.
        autocast_dtype: e.g. `torch.bfloat16` to run the stage under autocast.
        track_error: also decode each payload on the sender to report relative errors.
    """
    return Pipeline(model, plan, device=device, timeout=timeout, autocast_dtype=autocast_dtype,
                    track_error=track_error)


def _default_device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _free_other_parameters(model: nn.Module, stage: nn.Module) -> None:
    """Release the storage of every parameter this rank's stage does not use (the module tree
    stays intact so `save_pretrained` can fill it again)."""
    keep = {id(p) for p in stage.parameters()}
    for p in model.parameters():
        if id(p) not in keep:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _restore_parameters(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        if p.numel() == 0 and name in tensors:  # freed here, held by another stage
            p.data = tensors[name].to(p.dtype)
    missing = [n for n, p in model.named_parameters() if p.numel() == 0]
    if missing:
        raise RuntimeError(f"Parameters missing from every stage: {missing[:5]}")

