"""The gradient path of one pipeline stage, in one place: tied embeddings, replica averaging, clipping.

After the micro-batches' backwards have accumulated into `.grad`:

1. Tied embedding (first and last stage share the input embedding and the LM head). The LAST
   stage owns the weight and its optimizer state. Before the forward it sends the current rows
   of the batch's distinct tokens to the first stage, which writes them into its copy; after the
   backward the first stage sends back the gradient rows of those tokens, which the owner adds
   to its own gradient. Every rank reads the same batch, so both ends know the token ids and no
   indices are sent. That is 2 x tokens x hidden per step instead of an all-reduce of
   vocab x hidden, lossless, and the first stage never reads a row it has not just received: the
   copies cannot diverge. The first stage's copy gets no gradient (`grad` stays None), so the
   optimizer, clipping and the data-parallel hook skip it. With `Plan.tie_compression` the rows
   go as compressed deltas against a mirror of the first stage's copy and the gradient rows with
   error feedback (`hf_actcomp.tie`): both ends still agree bit for bit on what the first stage
   holds.
2. Replica averaging over the stage's data-parallel group, once per optimizer step
   (`sync=True`), through the plan's hook, over trainable parameters only. It runs after the tie,
   so that a lossy hook compresses the owner's complete gradient, once.
3. The global clip norm over all stages (`clip_grad_norm_`), with torch's `get_total_norm` and
   `clip_grads_with_norm_`.

Frozen parameters (`requires_grad=False`, as PEFT leaves the base model) are never given a
gradient, communicated or counted.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ..dp.base import ring_allreduce_bytes
from ..plan import Compression
from ..telemetry import TrafficCounter
from ..tie import TieCompressor, exact_rows_nbytes
from .mesh import PipelineMesh
from .transport import Transport


class TiedEmbedding:
    """This rank's end of the embedding tied between the first stage (input) and the last (head).

    Args:
        param: this stage's copy (`transformer.wte.weight` on the first stage, `lm_head.weight`
            on the last).
        mesh: ranks of this pipeline.
        transport: the pipeline's point-to-point transport.
        counter: where the bytes this rank sends are counted.
        compression: `Plan.tie_compression`: None sends rows and gradient rows exactly; a
            `Compression` sends rows as deltas and gradient rows with error feedback
            (`hf_actcomp.tie`).
    """

    def __init__(self, param: nn.Parameter, mesh: PipelineMesh, transport: Transport,
                 counter: TrafficCounter, compression: Compression | None = None) -> None:
        self.param = param
        self.mesh = mesh
        self.transport = transport
        self.counter = counter
        self.is_owner = mesh.is_last
        self.peer = mesh.ranks[0] if mesh.is_last else mesh.ranks[-1]
        self.compressor = (TieCompressor(compression, "owner" if self.is_owner else "first")
                           if compression is not None else None)

    def set_compression(self, compression: Compression | None) -> None:
        """Plan.auto's choice of the tie's codec, before the first exchange (a compressed tie's
        tables start empty at both ends, as they do here)."""
        self.compressor = (TieCompressor(compression, "owner" if self.is_owner else "first")
                           if compression is not None else None)

    @property
    def active(self) -> bool:
        """A frozen tie never changes, so both copies stay equal without any exchange."""
        return self.param.requires_grad

    @staticmethod
    def rows_of(input_ids: torch.Tensor) -> torch.Tensor:
        """The distinct token ids of a batch, sorted: the rows both ends exchange."""
        return torch.unique(input_ids.reshape(-1))

    def _send(self, payload: torch.Tensor, count: int, counter: TrafficCounter | None = None) -> None:
        payload = payload.contiguous().view(-1).view(torch.uint8)
        (counter or self.counter).add(payload.numel(), exact_rows_nbytes(count, self.param))
        self.transport.send(payload, self.peer)

    def _recv(self, count: int, what: str) -> torch.Tensor:
        """The next payload of `count` rows from the peer (uint8; exact rows, or the codec's)."""
        if self.compressor is None:
            nbytes = exact_rows_nbytes(count, self.param)
        else:
            nbytes = self.compressor.payload_nbytes(count, self.param.shape[1], self.param.dtype)
            what = f"compressed {what}"
        return self.transport.recv(nbytes, self.peer, self.param.device, what)

    def _rows(self, payload: torch.Tensor, count: int) -> torch.Tensor:
        return payload.view(self.param.dtype).view(count, self.param.shape[1])

    @torch.no_grad()
    def share_rows(self, input_ids: torch.Tensor, counter: TrafficCounter | None = None) -> None:
        """Before the forward: the owner sends the batch's rows, the first stage writes them in.
        `counter` overrides where the bytes are counted (evaluation)."""
        if not self.active:
            return
        rows = self.rows_of(input_ids).to(self.param.device)
        if self.is_owner:
            if self.compressor is None:
                self._send(self.param.index_select(0, rows), rows.numel(), counter)
            else:
                payload, _ = self.compressor.encode_rows(self.param, rows)
                self._send(payload, rows.numel(), counter)
        else:
            payload = self._recv(rows.numel(), "tied embedding rows")
            values = (self._rows(payload, rows.numel()) if self.compressor is None
                      else self.compressor.decode_rows(self.param, rows, payload))
            self.param.index_copy_(0, rows, values)

    @torch.no_grad()
    def gather_gradient(self, input_ids: torch.Tensor) -> None:
        """After the backward: the first stage sends its gradient rows to the owner, which adds
        them; the first stage's gradient is then dropped (None)."""
        if not self.active:
            return
        rows = self.rows_of(input_ids).to(self.param.device)
        if self.is_owner:
            payload = self._recv(rows.numel(), "tied embedding gradient rows")
            values = (self._rows(payload, rows.numel()) if self.compressor is None
                      else self.compressor.decode_gradient(payload, rows, self.param))
            if self.param.grad is None:
                self.param.grad = torch.zeros_like(self.param)
            self.param.grad.index_add_(0, rows, values.to(self.param.grad.dtype))
        else:
            grad = self.param.grad
            values = (grad.index_select(0, rows) if grad is not None
                      else torch.zeros(rows.numel(), self.param.shape[1], dtype=self.param.dtype,
                                       device=self.param.device))
            if self.compressor is not None:
                values, _ = self.compressor.encode_gradient(values, rows, self.param)
            self._send(values, rows.numel())
            self.param.grad = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The compressed tie's tables and codec counters ({} for an exact tie)."""
        return self.compressor.state_dict() if self.compressor is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.compressor is not None:
            self.compressor.load_state_dict(state)


def check_tied_embeddings(model: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """The tie exchange sends embedding rows: the first name of each tied pair must be a token
    embedding (`nn.Embedding`). Checked on the full model, identically on every rank."""
    for later, first in pairs:
        module = model.get_submodule(first.rsplit(".", 1)[0]) if "." in first else model
        if not isinstance(module, nn.Embedding):
            raise ValueError(
                f"{later!r} is tied to {first!r}, which is not an nn.Embedding: only a head tied to the input "
                "token embedding is supported across pipeline stages. Untie it (tie_word_embeddings=False)."
            )


def stage_tie(stage: nn.Module, mesh: PipelineMesh, transport: Transport, counter: TrafficCounter,
              tied_pairs: list[tuple[str, str]], compression: Compression | None) -> TiedEmbedding | None:
    """This stage's end of the embedding tied between the first and the last stage, if any."""
    if mesh.num_stages == 1 or not (mesh.is_first or mesh.is_last):
        return None
    own = dict(stage.named_parameters())
    for later, first in tied_pairs:
        name = first if mesh.is_first else later
        if name in own:
            return TiedEmbedding(own[name], mesh, transport, counter, compression)
    return None


class GradientSync:
    """Replica averaging and global clipping for one stage (see the module docstring).

    Args:
        stage: this rank's stage module.
        mesh: ranks of this pipeline and of the stage's data-parallel group.
        pipeline_group: the pipeline's process group (for the clip norm).
        dp_compressor: the plan's data-parallel hook, or None without replicas.
        tie: this stage's end of the tied embedding, or None.
        collectives: where bytes of the clip-norm all-reduce are counted.
    """

    def __init__(self, stage: nn.Module, mesh: PipelineMesh, pipeline_group: dist.ProcessGroup,
                 dp_compressor, tie: TiedEmbedding | None, collectives: TrafficCounter) -> None:
        self.stage = stage
        self.mesh = mesh
        self.pipeline_group = pipeline_group
        self.dp_compressor = dp_compressor
        self.tie = tie
        self.collectives = collectives
        self.seconds = 0.0

    def reset_stats(self) -> None:
        self.seconds = 0.0

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """Parameters whose gradient this stage owns, in name order (the same on every replica):
        trainable, and not the first stage's copy of a tied embedding."""
        skip = id(self.tie.param) if self.tie is not None and not self.tie.is_owner else None
        return [(n, p) for n, p in sorted(self.stage.named_parameters())
                if p.requires_grad and id(p) != skip]

    def average_over_replicas(self) -> None:
        """Average the accumulated gradients over this stage's replicas, through the hook."""
        if self.dp_compressor is None:
            return
        start = time.perf_counter()
        params = [p for _, p in self.trainable()]
        for p in params:
            if p.grad is None:  # unused in this step: every replica must still send the same layout
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        averaged = self.dp_compressor.reduce(flat, params)
        self.dp_compressor.end_step()
        for p, g in zip(params, averaged.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))
        self.seconds += time.perf_counter() - start

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every stage's gradients so that their global norm is at most `max_norm`.

        Each gradient is counted once (tied copies and replicas included). Returns the norm
        before clipping, on every rank.
        """
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"norm_type={norm_type!r} is not supported; use 2.0 or float('inf').")
        params = [p for _, p in self.trainable() if p.grad is not None]
        device = params[0].grad.device if params else torch.device("cpu")
        local = (torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
                 if params else torch.zeros((), device=device)).float()
        if self.mesh.num_stages > 1:
            start = time.perf_counter()
            if norm_type == 2.0:
                local = local.square()
                dist.all_reduce(local, group=self.pipeline_group)
                local = local.sqrt()
            else:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.pipeline_group)
            self.collectives.add(ring_allreduce_bytes(local.element_size(), self.mesh.num_stages))
            self.seconds += time.perf_counter() - start
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, local)
        return local
