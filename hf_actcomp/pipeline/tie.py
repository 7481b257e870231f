"""The embedding tied between the first stage (input) and the last (head), in one place.

GPT-2, OPT and small Qwen2 tie `lm_head.weight` to the input token embedding. Split across
stages, the LAST stage owns the weight and its optimizer state and the first holds a copy. Before
the forward the owner sends the rows of the batch's distinct tokens, which the first stage writes
into its copy; after the backward the first stage sends back the gradient rows of those tokens,
which the owner adds to its gradient. Every rank reads the same batch, so both ends know the
token ids and no indices are sent: 2 x tokens x hidden per step instead of an all-reduce of
vocab x hidden. The first stage never reads a row it has not just received, so the copies cannot
diverge, and its copy gets no gradient (`grad` stays None): the optimizer, clipping and the
data-parallel hook skip it (`gradsync.py`). A frozen tie never changes and is not exchanged.

How rows cross is one interface with two codecs: `ExactRows` (the default: lossless) and
`TieCompressor` (`Plan.tie_compression`):

- Rows (owner -> first stage) go as deltas, as AQ-SGD sends activations. Both ends keep `table`,
  what the first stage holds (on the owner it is a *mirror*). The owner sends
  C(W[rows] - table[rows]); both ends decode the payload and set
  table[rows] = table[rows] + decoded with the same operations in the same order, so the two
  tables stay equal bit for bit, and a codec error is corrected by the next delta instead of
  accumulating.
- Gradient rows (first stage -> owner) go with error feedback: the first stage sends
  C(g[rows] + e[rows]) and keeps e[rows] = g[rows] + e[rows] - decoded (e: vocab x hidden, fp32);
  the owner adds the decoded rows to its gradient.

The first stage's table is kept apart from its embedding parameter, into which the rows are
written before each forward: loading weights into the stage (a checkpoint, the best model at the
end of training) can then never put the two ends out of step. Both tables are allocated at first
use, from the weight at that moment (the model starts tied, or both ends load the same saved
weight), and saved with the compression state (`copy` and `error` on the first stage, `mirror` on
the owner), so a resumed run continues exactly.

Payloads are in the weight's dtype; their size depends only on the number of rows and is known to
the receiver beforehand. A `TieCompressor` serves both ends of the pipeline and, with
`role="both"`, the in-process simulation (`simulate.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..boundary import prefixed, unprefixed
from ..feedback import Receiver, Sender, build_codec
from ..plan import Compression
from ..telemetry import TrafficCounter
from .mesh import PipelineMesh
from .transport import Transport

ROLES = ("owner", "first", "both")


def exact_rows_nbytes(num_rows: int, weight: torch.Tensor) -> int:
    """Bytes of `num_rows` rows of `weight` sent exactly (its dtype): the uncompressed size of a
    tie payload, either direction."""
    return num_rows * weight.shape[1] * weight.element_size()


class ExactRows:
    """Rows and gradient rows as they are: `TieCompressor`'s interface without a codec or state,
    so that `TiedEmbedding` runs one path for both."""

    prefix = ""  # names the payload in a timeout error

    def payload_nbytes(self, num_rows: int, hidden: int, dtype: torch.dtype) -> int:
        return num_rows * hidden * dtype.itemsize

    @staticmethod
    def _view(payload: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return payload.view(weight.dtype).view(rows.numel(), weight.shape[1])

    def encode_rows(self, weight: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = weight.detach().index_select(0, rows)
        return values, values

    def decode_rows(self, weight: torch.Tensor, rows: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        return self._view(payload, rows, weight)

    def encode_gradient(self, grad_rows: torch.Tensor, rows: torch.Tensor,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_rows, grad_rows

    def decode_gradient(self, payload: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._view(payload, rows, weight)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to load: exact rows keep no state."""


EXACT_ROWS = ExactRows()


class TieCompressor:
    """One end (`owner`: the last stage, `first`: the first stage) or, in one process, both ends
    (`both`) of the compressed tied-embedding exchange.

    Args:
        compression: `Plan.tie_compression` (any stateless codec; its `feedback` is not used:
            gradient rows always use error feedback, rows never do).
        role: `owner`, `first` or `both`.
    """

    prefix = "compressed "  # names the payload in a timeout error

    def __init__(self, compression: Compression, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role={role!r} is not valid. Allowed values: {', '.join(ROLES)}.")
        self.compression = compression
        self.role = role
        self.codec = build_codec(compression)  # for payload sizes only

        c = compression  # separate codec objects on every end: a random stream advances per object

        def sender() -> Sender:  # with a mirror of the receiver: `last_reconstruction` is what it decodes
            return Sender(build_codec(c), Receiver(build_codec(c)))

        def receiver() -> Receiver:
            return Receiver(build_codec(c))

        # Rows: the owner encodes. Gradient rows: the first stage encodes.
        self.rows = sender() if role in ("owner", "both") else receiver()
        self.gradient = sender() if role in ("first", "both") else receiver()
        self.table: torch.Tensor | None = None  # what the first stage holds: vocab x hidden, the weight's dtype
        self.error: torch.Tensor | None = None  # gradient error feedback (first stage): vocab x hidden, fp32

    @property
    def table_name(self) -> str:
        return "mirror" if self.role == "owner" else "copy"

    def payload_nbytes(self, num_rows: int, hidden: int, dtype: torch.dtype) -> int:
        """Exact bytes of one payload (either direction) for `num_rows` rows."""
        return self.codec.payload_nbytes((num_rows, hidden), dtype)

    # ------------------------------------------------------------------------- rows
    def _table(self, weight: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = weight.detach().clone()
        elif self.table.device != weight.device or self.table.dtype != weight.dtype:
            self.table = self.table.to(weight.device, weight.dtype)
        return self.table

    def _update(self, rows: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        """table[rows] += decoded, with the same operations on both ends; returns the new rows."""
        new = (self.table.index_select(0, rows).float() + decoded.float()).to(self.table.dtype)
        self.table.index_copy_(0, rows, new)
        return new

    @torch.no_grad()
    def encode_rows(self, weight: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Owner: the payload of C(W[rows] - table[rows]), and the rows the first stage will hold."""
        table = self._table(weight)
        delta = weight.detach().index_select(0, rows).float() - table.index_select(0, rows).float()
        payload = self.rows.encode(delta.to(weight.dtype).contiguous())
        return payload, self._update(rows, self.rows.last_reconstruction)

    @torch.no_grad()
    def decode_rows(self, weight: torch.Tensor, rows: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """First stage: the rows it holds from now on (also written into its table)."""
        table = self._table(weight)
        decoded = self.rows.decode(payload, (rows.numel(), table.shape[1]), table.dtype)
        return self._update(rows, decoded)

    # ------------------------------------------------------------------------- gradient rows
    @torch.no_grad()
    def encode_gradient(self, grad_rows: torch.Tensor, rows: torch.Tensor,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """First stage: the payload of C(g[rows] + e[rows]) and its decoded rows (what the owner
        adds); e[rows] keeps what the payload missed."""
        if self.error is None:
            self.error = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        elif self.error.device != weight.device:
            self.error = self.error.to(weight.device)
        corrected = grad_rows.float() + self.error.index_select(0, rows)
        payload = self.gradient.encode(corrected.to(weight.dtype).contiguous())
        decoded = self.gradient.last_reconstruction
        self.error.index_copy_(0, rows, corrected - decoded.float())
        return payload, decoded

    @torch.no_grad()
    def decode_gradient(self, payload: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Owner: the gradient rows the first stage sent, in the weight's dtype."""
        return self.gradient.decode(payload, (rows.numel(), weight.shape[1]), weight.dtype)

    # ------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The table (`copy` or `mirror`), the error-feedback table (`error`) and codec counters."""
        state = {**prefixed(self.rows.state_dict(), "rows"), **prefixed(self.gradient.state_dict(), "gradient")}
        if self.table is not None:
            state[self.table_name] = self.table
        if self.error is not None:
            state["error"] = self.error
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.rows.load_state_dict(unprefixed(state, "rows"))
        self.gradient.load_state_dict(unprefixed(state, "gradient"))
        # Copies: a loaded tensor may be backed by a read-only memory map of the file.
        table = state.get(self.table_name)
        self.table = table.clone() if table is not None else None
        error = state.get("error")
        self.error = error.float().clone() if error is not None else None


class TiedEmbedding:
    """This rank's end of the embedding tied between the first stage (input) and the last (head).

    Args:
        param: this stage's copy (`transformer.wte.weight` on the first stage, `lm_head.weight`
            on the last).
        mesh: ranks of this pipeline.
        transport: the pipeline's point-to-point transport.
        counter: where the bytes this rank sends are counted.
        compression: `Plan.tie_compression`: None sends rows and gradient rows exactly; a
            `Compression` sends rows as deltas and gradient rows with error feedback.
    """

    def __init__(self, param: nn.Parameter, mesh: PipelineMesh, transport: Transport,
                 counter: TrafficCounter, compression: Compression | None = None) -> None:
        self.param = param
        self.mesh = mesh
        self.transport = transport
        self.counter = counter
        self.is_owner = mesh.is_last
        self.peer = mesh.ranks[0] if mesh.is_last else mesh.ranks[-1]
        self.compressor: TieCompressor | None = None
        self.set_compression(compression)

    def set_compression(self, compression: Compression | None) -> None:
        """Plan.auto's choice of the tie's codec, before the first exchange (a compressed tie's
        tables start empty at both ends, as they do here)."""
        self.compressor = (TieCompressor(compression, "owner" if self.is_owner else "first")
                           if compression is not None else None)

    @property
    def codec(self) -> ExactRows | TieCompressor:
        """How rows cross: the compressed tie's codec, else exact rows (one interface for both)."""
        return self.compressor if self.compressor is not None else EXACT_ROWS

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
        codec = self.codec
        nbytes = codec.payload_nbytes(count, self.param.shape[1], self.param.dtype)
        return self.transport.recv(nbytes, self.peer, self.param.device, codec.prefix + what)

    @torch.no_grad()
    def share_rows(self, input_ids: torch.Tensor, counter: TrafficCounter | None = None) -> None:
        """Before the forward: the owner sends the batch's rows, the first stage writes them in.
        `counter` overrides where the bytes are counted (evaluation)."""
        if not self.active:
            return
        rows = self.rows_of(input_ids).to(self.param.device)
        if self.is_owner:
            payload, _ = self.codec.encode_rows(self.param, rows)
            self._send(payload, rows.numel(), counter)
        else:
            payload = self._recv(rows.numel(), "tied embedding rows")
            self.param.index_copy_(0, rows, self.codec.decode_rows(self.param, rows, payload))

    @torch.no_grad()
    def gather_gradient(self, input_ids: torch.Tensor) -> None:
        """After the backward: the first stage sends its gradient rows to the owner, which adds
        them; the first stage's gradient is then dropped (None)."""
        if not self.active:
            return
        rows = self.rows_of(input_ids).to(self.param.device)
        if self.is_owner:
            payload = self._recv(rows.numel(), "tied embedding gradient rows")
            values = self.codec.decode_gradient(payload, rows, self.param)
            if self.param.grad is None:
                self.param.grad = torch.zeros_like(self.param)
            self.param.grad.index_add_(0, rows, values.to(self.param.grad.dtype))
        else:
            grad = self.param.grad
            values = (grad.index_select(0, rows) if grad is not None
                      else torch.zeros(rows.numel(), self.param.shape[1], dtype=self.param.dtype,
                                       device=self.param.device))
            payload, _ = self.codec.encode_gradient(values, rows, self.param)
            self._send(payload, rows.numel())
            self.param.grad = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The compressed tie's tables and codec counters ({} for an exact tie)."""
        return self.codec.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.codec.load_state_dict(state)


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
