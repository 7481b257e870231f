"""Pipeline stage boundaries inside one process: train with compression without a cluster.

`simulate(model, plan)` returns a module that behaves like the original model
(`sim(**batch).loss.backward()`, any optimizer, Accelerate) but runs the model as the plan's
stages and micro-batches, and passes every activation crossing a stage boundary through the
plan's forward compression and every activation gradient through the backward compression,
with the same sender/receiver objects (error feedback, AQ-SGD memory) as the distributed
pipeline. With the identity codec it is exact.

A tied embedding is the model's own shared tensor here, so an exact tie costs nothing to emulate.
With `Plan.tie_compression` the first stage reads its own copy, kept by the same `TieCompressor`
as the pipeline's (rows as deltas, once per call on the whole batch's distinct tokens), and its
gradient rows reach the weight through the error-feedback codec, once per backward, as the
pipeline's `train_step` exchanges them.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    ImageClassifierOutput,
    MaskedLMOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)

from .batching import (
    MicroBatch,
    check_batch,
    count_items,
    micro_batch_count,
    split_batch,
    with_main_input,
)
from .boundary import Boundary
from .models import get_adapter
from .models.compile import compile_blocks, compile_options
from .models.heads import (
    CAUSAL_LM,
    IMAGE_CLASSIFICATION,
    MASKED_LM,
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
)
from .models.router import RouterLoss, router_spec
from .models.split import stage_ranges
from .pipeline.tie import TieCompressor, exact_rows_nbytes
from .plan import Plan
from .state.compression import CompressionState, model_fingerprint
from .telemetry import CounterState, TrafficCounter, summarize

# Keyword arguments that HF training loops pass and that do not change the computation here.
_IGNORED_KWARGS = frozenset({"return_dict", "use_cache", "output_attentions", "output_hidden_states"})


class _CompressedBoundary(torch.autograd.Function):
    """Forward: activation through the forward boundary. Backward: gradient through the backward
    boundary. The receiver's output stands in for the sender's activation (straight-through)."""

    @staticmethod
    def forward(ctx, h, forward: Boundary, backward: Boundary, sample_ids, slot: int):
        ctx.backward_boundary, ctx.slot = backward, slot
        return forward.transfer(h.detach(), sample_ids=sample_ids, slot=slot)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_boundary.transfer(grad.contiguous(), slot=ctx.slot), None, None, None, None


class _TiedRows(torch.autograd.Function):
    """Forward: the first stage's copy of a tied embedding once this step's compressed rows are in.
    Backward: its gradient rows (summed over the micro-batches) through the error-feedback codec,
    as the gradient of the owner's weight."""

    @staticmethod
    def forward(ctx, weight, rows, tie: TieCompressor, counter: TrafficCounter | None):
        payload, _ = tie.encode_rows(weight, rows)
        raw = exact_rows_nbytes(rows.numel(), weight)
        if counter is not None:
            counter.add(payload.numel(), raw)
        ctx.tie, ctx.rows, ctx.counter, ctx.raw = tie, rows, counter, raw
        return tie.table.clone()

    @staticmethod
    def backward(ctx, grad):
        rows = ctx.rows
        payload, decoded = ctx.tie.encode_gradient(grad.index_select(0, rows), rows, grad)
        if ctx.counter is not None:
            ctx.counter.add(payload.numel(), ctx.raw)
        return torch.zeros_like(grad).index_copy_(0, rows, decoded.to(grad.dtype)), None, None, None


class _InferenceBoundary(torch.autograd.Function):
    """The stateless inference codec (evaluation), its payload counted in `counter` (the pipeline's
    `evaluation` category: what `eval_step` sends)."""

    @staticmethod
    def forward(ctx, h, forward: Boundary, counter: TrafficCounter):
        counter.add(forward.inference_payload_nbytes(h.shape, h.dtype), h.numel() * h.element_size())
        return forward.inference_transfer(h)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


# What the model's own forward returns, by task (models/heads.py).
OUTPUTS = {CAUSAL_LM: CausalLMOutputWithPast, SEQUENCE_CLASSIFICATION: SequenceClassifierOutputWithPast,
           TOKEN_CLASSIFICATION: TokenClassifierOutput, MASKED_LM: MaskedLMOutput,
           IMAGE_CLASSIFICATION: ImageClassifierOutput}


class SimulatedPipeline(nn.Module):
    """The model run as pipeline stages in one process, with compressed boundaries.

    Use it like the model: `out = sim(input_ids=..., attention_mask=..., labels=..., sample_id=...)`.
    In `train()` mode boundaries update their error-feedback / AQ-SGD state; in `eval()` mode they
    apply the stateless inference codec (see `Compression.inference`).
    """

    def __init__(self, model: nn.Module, plan: Plan, *, compile: bool = False,
                 compile_kwargs: dict | None = None) -> None:
        super().__init__()
        options = compile_options(compile, compile_kwargs)
        if plan.autotune is not None and plan.autotune.decision is None:
            raise ValueError(
                "Plan.auto measures the links between the processes of a pipeline at its first step; in one "
                "process there is no link to measure. Run with one process per stage (prepare()), see what it "
                "would choose with `hf-actcomp estimate --auto`, or give a fixed Plan(...).")
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
        if options is not None:  # the blocks (and below, the quantizers); the glue stays eager
            compile_blocks(self.stages, **options)
        # MoE with output_router_logits: transformers' load-balancing loss over every layer.
        self.router = RouterLoss(model, model) if router_spec(model) is not None else None
        # Both ends of every boundary direction live here: `boundary{b}.forward` / `.backward`.
        self.boundaries: dict[str, Boundary] = {}
        for b in range(last):
            for name, compression, memory in (("forward", plan.forward_at(b), plan.memory),
                                              ("backward", plan.backward_at(b), None)):
                self.boundaries[f"boundary{b}.{name}"] = Boundary(f"boundary{b}.{name}", compression, memory,
                                                                  track_error=False, compiling=options)
        # The compressed tie (Plan.tie_compression): the first stage's input embedding module.
        self.tie: TieCompressor | None = None
        # Bytes outside the training boundaries, by category, as a pipeline counts them: `evaluation`
        # (what eval-mode forwards send: evaluation, a DPO reference pass) and, with a compressed tie, `tie`.
        self.traffic: dict[str, TrafficCounter] = {"evaluation": TrafficCounter()}
        self._tie_module: nn.Module | None = None
        self._in_tie = False
        pairs = self.adapter.tied_weights()
        if plan.tie_compression is not None and last > 0 and pairs:
            first = pairs[0][1]
            module = self.adapter.model.get_submodule(first.rsplit(".", 1)[0])
            if not isinstance(module, nn.Embedding):
                raise ValueError(f"Plan.tie_compression: {pairs[0][0]!r} is tied to {first!r}, which is not an "
                                 "nn.Embedding; only a head tied to the input token embedding can be compressed.")
            self._tie_module = module
            self.tie = TieCompressor(plan.tie_compression, "both")
            self.traffic["tie"] = TrafficCounter()
        # All of it, as a pipeline's rank 0 would save it for the whole model.
        counters = CounterState.of(self.boundaries, self.traffic)
        self.compression = CompressionState({**self.boundaries, "tie": self.tie, "counters": counters},
                                            rank=0, metadata={
            "plan": plan.to_dict(), "world_size": 1, "stage": "all", "blocks": [[r.start, r.stop] for r in self.ranges],
            "model": model_fingerprint(model.config)})

    @property
    def config(self):
        return self.model.config

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        sample_id: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        token_type_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Run the stages micro-batch by micro-batch. The loss is the HF model's: the mean over
        label tokens, or their sum divided by `num_items_in_batch` when given (as
        `transformers.Trainer` passes it under gradient accumulation). A sequence or token
        classifier's loss is the call's mean, as its own forward's (which ignores
        `num_items_in_batch`). An image model (ViT) takes `pixel_values` in place of `input_ids`."""
        unknown = set(kwargs) - _IGNORED_KWARGS
        if unknown:
            raise TypeError(
                f"SimulatedPipeline.forward got unsupported arguments {sorted(unknown)}; it takes "
                "input_ids (or an image model's pixel_values), attention_mask, labels, sample_id, "
                "num_items_in_batch and (an encoder's) token_type_ids."
            )
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "sample_id": sample_id,
                 "token_type_ids": token_type_ids}
        if pixel_values is not None:
            batch = with_main_input({**batch, "pixel_values": pixel_values})
        input_ids = batch["input_ids"]
        compress = self.training
        check_batch(batch, self.plan, training=compress, needs_labels=False)
        self.adapter.check_batch(batch)
        micro = split_batch(batch, micro_batch_count(batch, self.plan, compress))
        # A classifier's own forward takes no `num_items_in_batch` (its loss is the call's mean), so
        # the stages do not either: Trainer then treats both alike.
        num_items = num_items_in_batch if self.adapter.takes_item_count(labels) else None
        if num_items is None and labels is not None and len(micro) > 1:
            num_items = count_items(self.adapter.task, self.config, labels)  # per-micro-batch means would weight rows unevenly
        logits_parts, loss = [], None
        with self._compressed_tie(input_ids, compress):
            for slot, mb in enumerate(micro):
                part, h = self._micro_batch(mb, slot, compress, num_items)
                logits_parts.append(h)
                if part is not None:
                    loss = part if loss is None else loss + part
        logits = torch.cat(logits_parts) if len(logits_parts) > 1 else logits_parts[0]
        return OUTPUTS[self.adapter.task](loss=loss, logits=logits)

    def _micro_batch(self, mb: MicroBatch, slot: int, compress: bool, num_items):
        """(loss or None, logits) of one micro-batch through every stage and boundary."""
        h, mask = mb.input_ids, mb.attention_mask
        with self.router.collecting() if self.router else contextlib.nullcontext():
            for s, stage in enumerate(self.stages):
                h = stage(h, mask, mb.input_ids, mb.token_type_ids)
                if s < len(self.stages) - 1:
                    forward = self.boundaries[f"boundary{s}.forward"]
                    if compress:
                        h = _CompressedBoundary.apply(h, forward, self.boundaries[f"boundary{s}.backward"],
                                                      mb.sample_id, slot)
                    else:
                        h = _InferenceBoundary.apply(h, forward, self.traffic["evaluation"])
        part = None
        if mb.labels is not None:
            part = self.adapter.loss(h, mb.labels, num_items)
            if self.router is not None:  # per micro-batch, as transformers per forward call
                part = part + self.router.whole_loss(*self.router.partial(mask, h.device))
        return part, h

    @contextlib.contextmanager
    def _compressed_tie(self, input_ids: torch.Tensor, training: bool):
        """With `Plan.tie_compression`: while the micro-batches run, the first stage's embedding
        reads the copy the pipeline's first stage would hold (refreshed with this call's rows, as
        `Pipeline.train_step` and `eval_step` refresh it), not the owner's weight. A frozen tie is
        never exchanged."""
        module = self._tie_module
        if module is None or not module.weight.requires_grad:
            yield
            return
        rows = torch.unique(input_ids.reshape(-1)).to(module.weight.device)
        table = _TiedRows.apply(module.weight, rows, self.tie, self.traffic["tie"] if training else None)

        def hook(m, args, kwargs, out):  # the module's own forward (a scaled embedding's too), on the copy
            if self._in_tie:
                return None
            self._in_tie = True
            try:
                return torch.func.functional_call(m, {"weight": table}, args, kwargs)
            finally:
                self._in_tie = False

        handle = module.register_forward_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def stats(self) -> dict:
        """Bytes sent vs uncompressed, compression ratio and relative error per boundary direction;
        what eval-mode forwards sent under `categories["evaluation"]` and, with
        `Plan.tie_compression`, the tie rows' bytes under `categories["tie"]`."""
        return summarize({name: b.stats for name, b in self.boundaries.items()}, self.traffic)

    def reset_stats(self) -> None:
        for b in self.boundaries.values():
            b.stats.reset()
        for counter in self.traffic.values():
            counter.reset()

    def compression_state_dict(self) -> dict[str, torch.Tensor]:
        """Error-feedback buffers, AQ-SGD memories and codec counters of every boundary (and the
        compressed tie's copy, error table and counters under `tie.`)."""
        return self.compression.state_dict()

    def load_compression_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.compression.load_state_dict(state)

    def save_compression_state(self, directory: str) -> None:
        """Write every boundary's state to `directory` (safetensors, as rank 0 of a pipeline)."""
        self.compression.save(directory)

    def load_compression_state(self, directory: str) -> None:
        """Read state written by `save_compression_state` under the same plan."""
        self.compression.load(directory)


def simulate(model: nn.Module, plan: Plan, *, compile: bool = False,
             compile_kwargs: dict | None = None) -> SimulatedPipeline:
    """Wrap `model` so that training and evaluation go through the plan's compressed boundaries.

    The model's parameters are shared, not copied: optimise `sim.parameters()` (or the model's).
    `compile=True` compiles each decoder block in place with `torch.compile` (`compile_kwargs`:
    its backend, mode, dynamic, ...) and fuses the deterministic quantizers of the boundaries
    (`quantize`, `hadamard`: hf_actcomp/codecs/fused.py); the codecs' state, embeddings, head and
    loss stay eager (hf_actcomp/models/compile.py).
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a hf_actcomp.Plan, got {type(plan).__name__}.")
    plan.check_memory()
    return SimulatedPipeline(model, plan, compile=compile, compile_kwargs=compile_kwargs)
