"""The checkpoint state of DiLoCo's outer sync: what `OuterSync.state_dict()` writes and
`load_state_dict()` restores, including a fragment's sync that was in flight at the checkpoint
(Streaming DiLoCo with `fragment_sync_delay`). `OuterStateMixin` gives `hf_actcomp.dp.outer.OuterSync`
these methods.

torchft's private API used here (pinned in pyproject.toml; tests/test_diloco.py fails loudly when
a release changes it): `DiLoCo._fragments` and `DiLoCo._local_step`, the fragment's `_grads`,
`original_parameters` and `_allreduce_work`, and `torchft.work._DummyWork`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .diloco import PseudoGradientCodec


class OuterStateMixin:
    """`OuterSync`'s checkpoint state (it sets these attributes)."""

    named: list[tuple[str, nn.Parameter]]
    fragments: list[list[tuple[str, nn.Parameter]]]
    outer_optimizers: list[torch.optim.Optimizer]
    codecs: list[PseudoGradientCodec | None]
    manager: Any  # torchft.manager.Manager
    diloco: Any  # torchft.local_sgd.DiLoCo once the inner optimizer is attached, else None
    _pending: dict[str, torch.Tensor] | None
    _resumed_in_flight: int | None
    _in_flight_failed: bool

    def _codec_prefix(self, index: int) -> str:
        return "pseudo_gradient." if len(self.fragments) == 1 else f"pseudo_gradient.{index}."

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The outer state, safetensors-ready: anchor weights (`anchor.*`), outer momentum
        (`momentum.*`), this replica's own weights (`weights.*`: between syncs they differ from
        the other replicas', which a checkpoint of one replica's weights would lose), each
        fragment's pseudo-gradient error feedback (`pseudo_gradient.*`, `pseudo_gradient.<i>.*`
        with fragments), and the step counters. With `fragment_sync_delay`, a sync in flight is
        finished and its averaged pseudo-gradient kept (`in_flight.*`): its outer step comes
        after the checkpoint."""
        if self.diloco is None:
            if self._pending is not None:
                return self._pending
            raise RuntimeError("DiLoCo's state exists once the inner optimizer is attached "
                               "(Pipeline.attach_optimizer).")
        out = {}
        for index, (named, fragment) in enumerate(zip(self.fragments, self.diloco._fragments, strict=True)):
            out.update({f"anchor.{name}": fragment.original_parameters[name] for name, _ in named})
            out.update({f"weights.{name}": p.detach() for name, p in named})
            for name, p in named:
                buffer = self.outer_optimizers[index].state.get(p, {}).get("momentum_buffer")
                if buffer is not None:
                    out[f"momentum.{name}"] = buffer
            if self.codecs[index] is not None:
                prefix = self._codec_prefix(index)
                out.update({f"{prefix}{k}": v for k, v in self.codecs[index].state_dict().items()})
            if fragment._allreduce_work:  # between the start of its sync and its outer step
                for work in fragment._allreduce_work:
                    work.wait()
                out.update({f"in_flight.{name}": fragment._grads[name] for name, _ in named})
                out["in_flight_fragment"] = torch.tensor(index)
                out["in_flight_failed"] = torch.tensor(self.manager.errored() is not None)
        manager = self.manager.state_dict()
        out["inner_step"] = torch.tensor(self.diloco._local_step)
        out["outer_step"] = torch.tensor(manager["step"])
        out["batches_committed"] = torch.tensor(manager["batches_committed"])
        if len(self.fragments) > 1:
            out["fragments"] = torch.tensor(len(self.fragments))
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state_dict()`'s output (kept until the inner optimizer is attached)."""
        missing = [f"{kind}.{name}" for name, _ in self.named for kind in ("anchor", "weights")
                   if f"{kind}.{name}" not in state]
        if missing or "inner_step" not in state:
            raise ValueError(f"The saved DiLoCo state lacks {missing[:3] or ['inner_step']}: it was written by "
                             "another plan or model split.")
        saved = int(state["fragments"]) if "fragments" in state else 1
        if saved != len(self.fragments):
            raise ValueError(f"The saved DiLoCo state has {saved} fragment(s); this plan syncs {len(self.fragments)} "
                             "(Plan.dp_compression fragments): resume with the plan it was saved under.")
        if self.diloco is None:
            self._pending = dict(state)
            return
        with torch.no_grad():
            for index, (named, fragment) in enumerate(zip(self.fragments, self.diloco._fragments, strict=True)):
                optimizer = self.outer_optimizers[index]
                for name, p in named:
                    fragment.original_parameters[name].copy_(state[f"anchor.{name}"])
                    p.copy_(state[f"weights.{name}"])
                    if f"momentum.{name}" in state:
                        optimizer.state[p]["momentum_buffer"] = state[f"momentum.{name}"].clone().to(p.device)
                if self.codecs[index] is not None:
                    prefix = self._codec_prefix(index)
                    self.codecs[index].load_state_dict({k[len(prefix):]: v for k, v in state.items()
                                                        if k.startswith(prefix)})
        self.diloco._local_step = int(state["inner_step"])
        self.manager.load_state_dict({"step": int(state["outer_step"]),
                                      "batches_committed": int(state["batches_committed"])})
        if "in_flight_fragment" in state:
            self._load_in_flight(state)

    def _load_in_flight(self, state: dict[str, torch.Tensor]) -> None:
        """A checkpoint taken between a fragment's sync start and its outer step: the averaged
        pseudo-gradient waits as a finished exchange, and the outer step (at its usual step)
        first forms a quorum, which the run that saved had formed at the start."""
        from torchft.work import _DummyWork

        index = int(state["in_flight_fragment"])
        fragment = self.diloco._fragments[index]
        fragment._grads = {name: state[f"in_flight.{name}"].clone().to(p.device) for name, p in self.fragments[index]}
        fragment._allreduce_work = [_DummyWork(None)]
        self._resumed_in_flight = index
        self._in_flight_failed = bool(state["in_flight_failed"])

    def _resume_in_flight(self) -> None:
        """The first sync after loading a checkpoint with fragment `_resumed_in_flight` in flight:
        form the quorum its start had formed, and report the error its exchange had met."""
        self._resumed_in_flight = None
        self.manager.start_quorum()
        if self._in_flight_failed:
            self.manager.report_error(RuntimeError("this sync's exchange had failed before the checkpoint"))
