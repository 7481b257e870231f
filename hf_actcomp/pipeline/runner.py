"""One rank's stage at work: its module, the ends of its boundaries and their links, and what
it does with one micro-batch (forward `F`, input gradient `B`, weight gradient `W`).

The pipeline decides what to run and when (schedule.py, executor.py); the runner only knows
how. Its boundary ends follow its plan: `use(plan)` swaps codecs (Plan.auto) and keeps the state
of an end whose codec did not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..batching import MicroBatch
from ..boundary import Boundary
from ..models.router import RouterLoss
from ..plan import Plan
from ..telemetry import ChannelStats, TrafficCounter
from .link import StageLink
from .mesh import PipelineMesh
from .schedule import fused, stage_actions
from .split_backward import WeightGradients, defer_weight_gradients, keep_weight_gradients
from .transport import Transport

ENDS = ("forward_in", "backward_out", "forward_out", "backward_in")


class StageRunner:
    """This rank's stage module joined to its neighbours.

    Args:
        stage: the stage module (its blocks, and the embeddings / head on the first / last stage).
        mesh, transport, device: where it sits, its wire, its device.
        plan: the codecs of its boundaries (and `memory` for AQ-SGD).
        config, loss_function: the model's config and its loss (the last stage computes it).
        boundary_dtype: the dtype of what crosses a boundary.
        autocast_dtype: the dtype the stage computes in under autocast, or None.
        router: the MoE load-balancing loss's side channel, or None.
        sample_range: this replica's sample ids (AQ-SGD memory of its shard only), or None.
        track_error: the sending ends also decode, to report relative errors.
        side_counter: where the router side channel's bytes are counted.
        compiling: torch.compile's options when the stage is compiled: its boundary quantizers
            are fused too (hf_actcomp/codecs/fused.py); None: eager.
    """

    def __init__(self, stage: nn.Module, mesh: PipelineMesh, transport: Transport, device: torch.device,
                 plan: Plan, *, config, loss_function, boundary_dtype: torch.dtype,
                 autocast_dtype: torch.dtype | None = None, router: RouterLoss | None = None,
                 sample_range: range | None = None, track_error: bool = True,
                 side_counter: TrafficCounter | None = None, compiling: dict | None = None) -> None:
        self.stage = stage
        self.mesh = mesh
        self.transport = transport
        self.device = device
        self.config = config
        self.loss_function = loss_function
        # A trainer's own loss of a micro-batch (`Pipeline.set_objective`), in place of the model's.
        self.objective: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
        self.boundary_dtype = boundary_dtype
        self.autocast_dtype = autocast_dtype
        self.router = router
        self.sample_range = sample_range
        self.track_error = track_error
        self.side_counter = side_counter
        self.compiling = compiling
        self.ends: dict[str, Boundary] = {}
        self.links: dict[str, StageLink] = {}
        self.weight_gradients = WeightGradients()  # zbh1: what each micro-batch's `W` needs, from its `B`
        self.use(plan)  # sets `plan`, `ends`, `links` and `actions`

    @property
    def is_first(self) -> bool:
        return self.mesh.is_first

    @property
    def is_last(self) -> bool:
        return self.mesh.is_last

    # ------------------------------------------------------------------------- boundaries
    def use(self, plan: Plan) -> None:
        """The ends of the two boundaries this stage touches (boundary b joins stage b and b+1),
        with `plan`'s codecs, and their links. An end whose codec did not change is kept as it
        is; a new one keeps its counters, and AQ-SGD memory moves over when both codecs are
        AQ-SGD (only its bit width changed); entering AQ-SGD starts a fresh one."""
        s, last = self.mesh.stage, self.mesh.num_stages - 1
        wanted = {}
        if s > 0:
            wanted["forward_in"] = (s - 1, "forward", dict(sender=False, sample_range=self.sample_range))
            wanted["backward_out"] = (s - 1, "backward", dict(receiver=False, track_error=self.track_error))
        if s < last:
            wanted["forward_out"] = (s, "forward", dict(receiver=False, track_error=self.track_error,
                                                        sample_range=self.sample_range))
            wanted["backward_in"] = (s, "backward", dict(sender=False))
        previous = {b.name: b for b in self.ends.values()}
        ends = {}
        for key, (b, direction, kwargs) in wanted.items():
            name = f"boundary{b}.{direction}"
            compression = plan.forward_at(b) if direction == "forward" else plan.backward_at(b)
            old = previous.get(name)
            if old is not None and old.compression == compression:
                ends[key] = old
                continue
            end = Boundary(name, compression, plan.memory if direction == "forward" else None,
                           compiling=self.compiling, **kwargs)
            if old is not None:
                end.stats = old.stats
                if old.compression.method == compression.method == "aqsgd":
                    end.adopt_memory(old)
            ends[key] = end
        self.ends = {key: ends[key] for key in ENDS if key in ends}
        keep_weight_gradients(self.stage)
        # This stage's part of a training step, as the executor runs it (`fused`).
        self.actions = fused(stage_actions(plan.schedule, self.mesh.stage, self.mesh.num_stages, plan.micro_batches))
        if any(kind == "B" for kind, _ in self.actions):  # a backward split apart from its `W`
            defer_weight_gradients(self.stage, self.weight_gradients)
        self.plan = plan
        self.links = self._links()

    def _links(self) -> dict[str, StageLink]:
        """The wire format of each boundary direction this rank touches: `forward_in`,
        `backward_out` (to the previous stage), `forward_out`, `backward_in` (the next stage)."""
        router = self.router
        sides = {"forward": router.stats_numel if router else 0, "backward": router.num_experts if router else 0}
        peers = {"forward_in": self.mesh.prev_rank, "backward_out": self.mesh.prev_rank,
                 "forward_out": self.mesh.next_rank, "backward_in": self.mesh.next_rank}
        return {key: StageLink(b, self.transport, peers[key], self.boundary_dtype,
                               side_numel=sides[key.split("_")[0]], side_counter=self.side_counter)
                for key, b in self.ends.items()}

    @property
    def boundaries(self) -> dict[str, Boundary]:
        """The boundary ends this rank holds, by name (`boundary0.forward`, ...)."""
        return {b.name: b for b in self.ends.values()}

    def sending_channels(self) -> dict[str, ChannelStats]:
        """The counters of this rank's sending ends (bytes are counted where sent)."""
        return {self.ends[key].name: self.ends[key].stats for key in ("forward_out", "backward_out") if key in self.ends}

    # ------------------------------------------------------------------------- one micro-batch
    def shape(self, mb: MicroBatch, side: str = "in") -> tuple[int, ...]:
        """The shape of what crosses this stage's incoming (`side="in"`: activations received,
        their gradients sent back) or outgoing boundary (`"out"`) for micro-batch `mb`."""
        block = self.stage.start if side == "in" else self.stage.stop
        return self.stage.adapter.boundary_shape(mb.input_ids, block)

    def post_receives(self, micro: list[MicroBatch], *, training: bool, codec=None) -> None:
        """Post every receive of the step at its start (sizes are known without data), so that a
        payload can travel while this stage computes; see `Transport` for when they hit the wire.
        Evaluation receives activations only, through the stateless `codec`."""
        for i, mb in enumerate(micro):
            if not self.is_first:
                self.links["forward_in"].post(i, self.shape(mb), self.device,
                                              f"{'' if training else 'eval '}activations of micro-batch {i}",
                                              sample_ids=mb.sample_id if training else None, codec=codec)
            if training and not self.is_last:
                self.links["backward_in"].post(i, self.shape(mb, "out"), self.device, f"gradients of micro-batch {i}")

    def receives(self, kind: str) -> bool:
        """Whether an action of this kind starts by receiving (so a send can be paired with it)."""
        return {"F": not self.is_first, "B": not self.is_last, "BW": not self.is_last}.get(kind, False)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, normaliser) -> torch.Tensor:
        if self.objective is not None:
            return self.objective(logits, labels, normaliser)
        return self.stage.adapter.loss(logits, labels, normaliser, loss_function=self.loss_function)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def collecting_routers(self):
        """The router side channel (MoE load-balancing loss), empty for every other model."""
        return self.router.collecting() if self.router is not None else contextlib.nullcontext()

    def forward(self, i: int, mb: MicroBatch, normaliser, pair: bool, split: bool = False) -> tuple:
        """(input, output or loss, router probabilities or None) of micro-batch `i`, kept for its
        backward. `split`: its backward will be split (`B` now, `W` later), so its linear layers
        go through the weight-gradient store."""
        routed = self.weight_gradients.routed() if split and not self.is_first else contextlib.nullcontext()
        with routed:
            return self._forward(i, mb, normaliser, pair)

    def _forward(self, i: int, mb: MicroBatch, normaliser, pair: bool) -> tuple:
        x, side = mb.input_ids, None
        if not self.is_first:
            x, side = self.links["forward_in"].receive(i, self.shape(mb), sample_ids=mb.sample_id)
            x = x.detach().requires_grad_(True)
        with self.autocast(), self.collecting_routers():
            out = self.stage(x, mb.attention_mask, mb.input_ids, mb.token_type_ids)
            if self.is_last:
                loss = self.loss(out, mb.labels, normaliser)
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

    def infer(self, i: int, mb: MicroBatch, receiver, sender, counter: TrafficCounter) -> tuple:
        """(output, router statistics, router probabilities) of micro-batch `i` for evaluation:
        through the stateless codecs `receiver` / `sender`, sent on unless this is the last stage."""
        x, side = mb.input_ids, None
        if not self.is_first:
            x, side = self.links["forward_in"].receive(i, self.shape(mb), codec=receiver)
        with self.autocast(), self.collecting_routers():
            out = self.stage(x, mb.attention_mask, mb.input_ids, mb.token_type_ids)
        stats, probs = self.router.partial(mb.attention_mask, self.device, side) if self.router else (None, None)
        if not self.is_last:
            self.links["forward_out"].send(i, out, stats, codec=sender, counter=counter)
        return out, stats, probs

    def backward(self, i: int, x: torch.Tensor, out: torch.Tensor, probs: torch.Tensor | None, pair: bool,
                 split: bool = False) -> None:
        """Micro-batch `i`'s backward, sending the input's gradient upstream. `split` (a `B`
        whose `W` comes later): the linear layers' weight gradients wait for its `W`."""
        received = None if self.is_last else self.links["backward_in"].receive(i, out.shape)
        deferring = self.weight_gradients.deferring(i) if split else contextlib.nullcontext()
        with deferring:
            router_grad = self._backward(out, probs, received)
        if not self.is_first:
            self.links["backward_out"].send(i, x.grad, router_grad, with_next_recv=pair)

    @staticmethod
    def _backward(out: torch.Tensor, probs: torch.Tensor | None, received: tuple | None) -> torch.Tensor | None:
        """Backward from `out` (the loss on the last stage, else with the received gradient);
        returns the router probabilities' gradient to send on, if any."""
        if received is None:  # `out` is this micro-batch's loss
            out.backward()
            return None if probs is None else probs.grad
        grad, router_grad = received
        if probs is not None and probs.requires_grad:
            torch.autograd.backward([out, probs], [grad.to(out.dtype), router_grad])
        else:
            out.backward(grad.to(out.dtype))
        return router_grad

    def weight(self, i: int) -> None:
        """Micro-batch `i`'s held-back weight gradients (`W`)."""
        self.weight_gradients.compute(i)
