"""Compressed rows of a tied embedding (`Plan.tie_compression`): the state each end keeps.

GPT-2 and OPT tie the LM head to the input embedding. Split across stages, the last stage owns the
weight and the first holds a copy, refreshed every step with the rows of the batch's distinct
tokens; the first stage's gradient rows go back to the owner (`pipeline/gradsync.py`). Without
`tie_compression` both directions are exact. With it:

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
the receiver beforehand. The same object serves both ends of the pipeline and, with `role="both"`,
the in-process simulation.
"""

from __future__ import annotations

import torch

from .boundary import prefixed, unprefixed
from .feedback import Receiver, Sender, build_codec
from .plan import Compression

ROLES = ("owner", "first", "both")


def exact_rows_nbytes(num_rows: int, weight: torch.Tensor) -> int:
    """Bytes of `num_rows` rows of `weight` sent exactly (its dtype): the uncompressed size of a
    tie payload, either direction."""
    return num_rows * weight.shape[1] * weight.element_size()


class TieCompressor:
    """One end (`owner`: the last stage, `first`: the first stage) or, in one process, both ends
    (`both`) of the compressed tied-embedding exchange.

    Args:
        compression: `Plan.tie_compression` (any stateless codec; its `feedback` is not used:
            gradient rows always use error feedback, rows never do).
        role: `owner`, `first` or `both`.
    """

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
