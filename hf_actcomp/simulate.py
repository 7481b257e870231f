"""Pipeline stage boundaries inside one process: train with compression without a cluster.

`simulate(model, plan)` returns a module that behaves like the original model
(`sim(**batch).loss.backward()`, any optimizer, Accelerate) but runs the model as the plan's
stages and micro-batches, and passes every activation crossing a stage boundary through the
plan's forward compression and every activation gradient through the backward compression,
with the same sender/receiver objects (error feedback, AQ-SGD memory) as the distributed
pipeline. With the identity codec it is exact.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .feedback import Receiver, Sender, build_inference_codec, build_receiver, build_sender
from .models import ModelAdapter, get_adapter
from .plan import Plan
from .telemetry import ChannelStats, summarize

# Keyword arguments that HF training loops pass and that do not change the computation here.
_IGNORED_KWARGS = frozenset({"return_dict", "use_cache", "output_attentions", "output_hidden_states"})


def stage_ranges(adapter: ModelAdapter, plan: Plan) -> list[range]:
    """The plan's block ranges for this model, balanced by parameter count unless explicit."""

    def count(modules: list[nn.Module]) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    blocks = adapter.blocks()
    return plan.stage_ranges(
        adapter.num_blocks,
        [count([b]) for b in blocks],
        count(adapter.embedding_modules()),
        count(adapter.head_modules()),
    )


class BoundaryLink:
    """Both directions of one stage boundary, sender and receiver side by side."""

    def __init__(self, index: int, plan: Plan) -> None:
        name = f"boundary{index}"
        self.name = name
        self.forward_sender: Sender = build_sender(plan.forward, plan.memory, f"{name}.forward")
        self.forward_receiver: Receiver = build_receiver(plan.forward, plan.memory, f"{name}.forward")
        self.backward_sender: Sender = build_sender(plan.backward, None, f"{name}.backward")
        self.backward_receiver: Receiver = build_receiver(plan.backward, None, f"{name}.backward")
        self.inference_encoder = build_inference_codec(plan.forward)
        self.inference_decoder = build_inference_codec(plan.forward)
        self.stats = {"forward": ChannelStats(), "backward": ChannelStats()}

    def send_forward(self, h: torch.Tensor, sample_ids: torch.Tensor | None, slot: int) -> torch.Tensor:
        stats = self.stats["forward"]
        with stats.timing("encode"):
            payload = self.forward_sender.encode(h, sample_ids=sample_ids, slot=slot)
        with stats.timing("decode"):
            out = self.forward_receiver.decode(payload, h.shape, h.dtype, sample_ids=sample_ids, slot=slot)
        stats.record(h, payload.numel(), out)
        return out

    def send_backward(self, g: torch.Tensor, slot: int) -> torch.Tensor:
        stats = self.stats["backward"]
        with stats.timing("encode"):
            payload = self.backward_sender.encode(g, slot=slot)
        with stats.timing("decode"):
            out = self.backward_receiver.decode(payload, g.shape, g.dtype, slot=slot)
        stats.record(g, payload.numel(), out)
        return out

    def infer(self, h: torch.Tensor) -> torch.Tensor:
        """Stateless forward compression for evaluation (no memory or feedback updates)."""
        payload = self.inference_encoder.encode(h.detach())
        return self.inference_decoder.decode(payload, h.shape, h.dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        parts = {
            "forward_sender": self.forward_sender,
            "forward_receiver": self.forward_receiver,
            "backward_sender": self.backward_sender,
            "backward_receiver": self.backward_receiver,
        }
        return {f"{p}.{k}": v for p, obj in parts.items() for k, v in obj.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for part in ("forward_sender", "forward_receiver", "backward_sender", "backward_receiver"):
            prefix = f"{part}."
            getattr(self, part).load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})


class _CompressedBoundary(torch.autograd.Function):
    """Forward: activation through the forward channel. Backward: gradient through the backward
    channel. The receiver's output stands in for the sender's activation (straight-through)."""

    @staticmethod
    def forward(ctx, h, link: BoundaryLink, sample_ids, slot: int):
        ctx.link, ctx.slot = link, slot
        return link.send_forward(h.detach(), sample_ids, slot)

    @staticmethod
    def backward(ctx, grad):
        return ctx.link.send_backward(grad.contiguous(), ctx.slot), None, None, None


class _InferenceBoundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, link: BoundaryLink):
        return link.infer(h)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SimulatedPipeline(nn.Module):
    """The model run as pipeline stages in one process, with compressed boundaries.

    Use it like the model: `out = sim(input_ids=..., attention_mask=..., labels=..., sample_id=...)`.
    In `train()` mode boundaries update their error-feedback / AQ-SGD state; in `eval()` mode they
    apply the stateless inference codec (see `Compression.inference`).
    """

    def __init__(self, model: nn.Module, plan: Plan) -> None:
        super().__init__()
        self.model = model
        self.plan = plan
        self.adapter = get_adapter(model)
        self.ranges = stage_ranges(self.adapter, plan)
        last = len(self.ranges) - 1
        # A plain list: stages share the model's parameters, which `self.model` already registers.
        self.stages = [
            self.adapter.build_stage(r.start, r.stop, first=i == 0, last=i == last)
            for i, r in enumerate(self.ranges)
        ]
        self.links = [BoundaryLink(i, plan) for i in range(last)]

    @property
    def config(self):
        return self.model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        sample_id: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        unknown = set(kwargs) - _IGNORED_KWARGS
        if unknown:
            raise TypeError(
                f"SimulatedPipeline.forward got unsupported arguments {sorted(unknown)}; it takes "
                "input_ids, attention_mask, labels and sample_id."
            )
        batch = input_ids.shape[0]
        num_micro = self.plan.micro_batches
        if batch < num_micro:
            raise ValueError(
                f"A batch of {batch} rows cannot be split into plan.micro_batches={num_micro}; "
                f"use a batch size >= {num_micro}."
            )
        compress = self.training
        if compress and self.plan.forward.method == "aqsgd" and sample_id is None:
            raise ValueError(
                "AQ-SGD needs a 'sample_id' entry in every training batch. "
                "Add it with hf_actcomp.add_sample_ids(dataset)."
            )

        def split(t: torch.Tensor | None) -> list:
            return [None] * num_micro if t is None else list(torch.tensor_split(t, num_micro))

        num_items = None
        if labels is not None and num_micro > 1:
            num_items = (labels[..., 1:] != -100).sum()
        logits_parts, loss = [], None
        for slot, (ids, mask, lab, sid) in enumerate(
            zip(split(input_ids), split(attention_mask), split(labels), split(sample_id), strict=False)
        ):
            h = ids
            for s, stage in enumerate(self.stages):
                h = stage(h, mask)
                if s < len(self.links):
                    link = self.links[s]
                    if compress:
                        h = _CompressedBoundary.apply(h, link, sid, slot)
                    else:
                        h = _InferenceBoundary.apply(h, link)
            logits_parts.append(h)
            if lab is not None:
                part = self.model.loss_function(
                    h, lab, vocab_size=self.model.config.vocab_size, num_items_in_batch=num_items
                )
                loss = part if loss is None else loss + part
        logits = torch.cat(logits_parts) if len(logits_parts) > 1 else logits_parts[0]
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def stats(self) -> dict:
        """Bytes sent vs uncompressed, compression ratio and relative error per boundary direction."""
        return summarize(
            {f"{link.name}.{d}": link.stats[d] for link in self.links for d in ("forward", "backward")}
        )

    def reset_stats(self) -> None:
        for link in self.links:
            link.stats = {"forward": ChannelStats(), "backward": ChannelStats()}

    def compression_state_dict(self) -> dict[str, torch.Tensor]:
        """Error-feedback buffers, AQ-SGD memories and codec counters of every boundary."""
        return {f"{link.name}.{k}": v for link in self.links for k, v in link.state_dict().items()}

    def load_compression_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for link in self.links:
            prefix = f"{link.name}."
            link.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})


def simulate(model: nn.Module, plan: Plan) -> SimulatedPipeline:
    """Wrap `model` so that training and evaluation go through the plan's compressed boundaries.

    The model's parameters are shared, not copied: optimise `sim.parameters()` (or the model's).
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a hf_actcomp.Plan, got {type(plan).__name__}.")
    return SimulatedPipeline(model, plan)
