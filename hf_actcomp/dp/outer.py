"""The replicas' outer step (DiLoCo) through torchft: one replica group per pipeline stage.

Stage s of every replica forms stage s's replica group, with its own torchft lighthouse: each
stage syncs on its own (its quorum never waits for another stage, so `stagger` cannot deadlock the
pipeline), and a restarted replica heals each stage from that stage's peer. Each process runs a
torchft `Manager` of a group of one (this stage of this replica) and torchft's `DiLoCo` over the
stage's trainable parameters, hooked to the user's inner optimizer: one fragment (DiLoCo), or
`fragments` of them that sync in turn (Streaming DiLoCo, `hf_actcomp.dp.fragments`). torchft
restores a fragment's weights when its sync fails (a lost peer) and heals a replica that comes
back.

torchft's private API (pinned in pyproject.toml; tests/test_diloco.py fails loudly when a release
changes it) is used here and in the two modules this one builds on:
- each fragment's `_average_grads`, replaced so that the pseudo-gradient goes through our codec
  (`hf_actcomp.dp.diloco.PseudoGradientCodec`, one per fragment) and its bytes are counted;
- `Manager._pg`, `DiLoCo._fragments`, `DiLoCo._local_step`, `DiLoCo._local_optimizer`, the
  fragment's `_grads`, `restore_parameters` and `_allreduce_work`;
- `hf_actcomp.dp.torchft_servers`: the lighthouses, and the Manager's server and gloo group bound
  to the host the user names (`torchft.manager.ManagerServer`,
  `ProcessGroupGloo.get_reconfigure_handle`);
- `hf_actcomp.dp.outer_state`: `OuterSync`'s checkpoint state (`original_parameters`, a sync in
  flight at the checkpoint).
"""

from __future__ import annotations

import datetime
import functools
import logging
import time

import torch
from torch import nn

from ..state.resume import maybe_pause_for_fault_test
from .diloco import PseudoGradientCodec
from .exchange import PseudoGradientExchange
from .fragments import split_fragments
from .outer_state import OuterStateMixin
from .torchft_servers import (
    DEFAULT_HOST,
    HOST_ENV,
    LIGHTHOUSE_ENV,
    bind_host,
    bound_process_group,
    lighthouse_addresses,
    lighthouses,
    manager_server_bound_to,
    require_torchft,
    start_lighthouse,
)

__all__ = ["DEFAULT_HOST", "HEAL_KEY", "HOST_ENV", "LIGHTHOUSE_ENV", "OuterSync", "bind_host", "lighthouse_addresses",
           "lighthouses", "require_torchft", "start_lighthouse"]

logger = logging.getLogger(__name__)


class _Parameters(nn.Module):
    """A fragment for torchft: exactly these named parameters (a run of the stage's trainable ones)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self._named = list(named)

    def named_parameters(self, *args, **kwargs):  # noqa: ARG002 (torchft passes none)
        return iter(self._named)


HEAL_KEY = "hf_actcomp_fragments"  # our entry in the heal message (Streaming DiLoCo only)


class OuterSync(OuterStateMixin):
    """This stage's replica group: a torchft Manager, and DiLoCo once the inner optimizer is known.

    Args:
        config: the plan's `DiLoCoConfig`.
        named_parameters: this stage's trainable parameters, in name order (the same on every replica).
        stage, num_stages: this stage, for the stagger offset and the replica id.
        replica, num_replicas: this replica and the plan's `data_parallel`.
        lighthouse: the address of this stage's lighthouse.
        host: where this process's torchft servers bind.
        timeout: seconds a collective, a heal or a quorum may take.
    """

    def __init__(self, config, named_parameters: list[tuple[str, nn.Parameter]], *, stage: int, num_stages: int,
                 replica: int, num_replicas: int, lighthouse: str, host: str, timeout: float) -> None:
        require_torchft()
        from torch.distributed import TCPStore
        from torchft.manager import Manager

        from .heal_transport import SafetensorsTransport

        self.config = config
        self.rank = replica * num_stages + stage  # in a launch of every replica
        self.named = list(named_parameters)
        self.fragments = split_fragments(self.named, config.fragments, stage)  # checked before any server starts
        self.offset = config.offset(stage, num_stages)
        delta = datetime.timedelta(seconds=timeout)
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this group's store (of one)
        with manager_server_bound_to(host):
            self.manager = Manager(
                pg=bound_process_group(host, delta), load_state_dict=None, state_dict=None,
                min_replica_size=config.min_replicas or num_replicas, use_async_quorum=False, timeout=delta,
                quorum_timeout=delta, connect_timeout=delta, rank=0, world_size=1, store_addr=host,
                store_port=self._store.port, lighthouse_addr=lighthouse, replica_id=f"stage{stage}_replica{replica}",
                hostname=host, checkpoint_transport=SafetensorsTransport(host, delta), init_sync=False,
            )
        # One outer optimizer per fragment: its momentum travels with the fragment's heal.
        self.outer_optimizers = [
            torch.optim.SGD([p for _, p in fragment], lr=config.outer_lr, momentum=config.outer_momentum,
                            nesterov=config.nesterov) for fragment in self.fragments]
        device = self.named[0][1].device if self.named else torch.device("cpu")
        self.codecs = [PseudoGradientCodec(config.compression, sum(p.numel() for _, p in fragment), device,
                                           error_decay=config.error_decay)
                       if config.compression else None for fragment in self.fragments]
        self.diloco = None
        self._pending: dict[str, torch.Tensor] | None = None
        self._resumed_in_flight: int | None = None  # a fragment whose sync was in flight at the checkpoint
        self._in_flight_failed = False
        self.bytes_sent = self.bytes_uncompressed = 0
        self.syncs = self.failed_syncs = 0
        self.fragment_syncs = [0] * len(self.fragments)  # syncs (committed or not) per fragment
        self.seconds = 0.0

    @property
    def codec(self) -> PseudoGradientCodec | None:
        """The pseudo-gradient codec of plain DiLoCo (one fragment); `codecs` has one per fragment."""
        if len(self.codecs) != 1:
            raise RuntimeError(f"This stage syncs {len(self.codecs)} fragments, each with its own codec: use .codecs.")
        return self.codecs[0]

    # ------------------------------------------------------------------ the inner optimizer
    @property
    def attached(self) -> bool:
        return self.diloco is not None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook DiLoCo to the inner optimizer: every `sync_every / fragments` of its steps, the
        outer step of the next fragment."""
        from torchft.local_sgd import DiLoCo

        if self.diloco is not None:
            if self.diloco._local_optimizer is optimizer:
                return
            raise RuntimeError("This pipeline's DiLoCo is already attached to another optimizer; attach one "
                               "inner optimizer per training run.")
        config = self.config
        self.diloco = DiLoCo(self.manager, [_Parameters(fragment) for fragment in self.fragments], optimizer,
                             self.outer_optimizers, sync_every=config.sync_every, use_bucketization=True,
                             fragment_sync_delay=config.fragment_sync_delay,
                             fragment_update_alpha=config.fragment_update_alpha)
        self.diloco.__enter__()
        self.diloco._local_step = -self.offset  # `stagger`: this stage's first sync comes `offset` steps later
        for index, fragment in enumerate(self.diloco._fragments):
            fragment._average_grads = functools.partial(self._average_pseudo_gradients, index)
            fragment.perform_sync = self._timed(index, fragment.perform_sync)
        if len(self.fragments) > 1:
            self.manager.register_state_dict_fn(HEAL_KEY, self._after_heal, dict)
        if self._pending is not None:
            state, self._pending = self._pending, None
            self.load_state_dict(state)

    def _timed(self, index: int, perform_sync):
        def wrapped() -> bool:
            start = time.perf_counter()
            if self._resumed_in_flight == index:
                self._resume_in_flight()
            committed = perform_sync()
            self.seconds += time.perf_counter() - start
            self.syncs += 1
            self.fragment_syncs[index] += 1
            self.failed_syncs += not committed
            if not committed:
                logger.warning("DiLoCo sync %d (fragment %d) was not committed (a replica was lost or errored): this "
                               "fragment's weights are back at its last sync.", self.syncs, index)
            return committed

        return wrapped

    def _after_heal(self, _state: dict) -> None:
        """Streaming DiLoCo, once torchft healed every fragment's anchor and outer momentum from a
        peer: the fragments not synced now restart from their anchors, so that their own next
        syncs send a pseudo-gradient of this replica's steps since the heal (the fragment synced
        now is restored by its outer step, as with one fragment)."""
        now = self.manager.current_step() % len(self.fragments)
        for index, fragment in enumerate(self.diloco._fragments):
            if index != now:
                fragment.restore_parameters()

    # ------------------------------------------------------------------ the pseudo-gradient
    def _average_pseudo_gradients(self, index: int) -> None:
        """Start averaging fragment `index`'s pseudo-gradients over the replicas that are in the
        quorum (our codec, or exact fp32 all-reduce); torchft waits for it before the outer step.
        A lost peer is reported to the Manager, which then refuses the commit and torchft restores
        the fragment's weights."""
        from torchft.work import _DummyWork

        start = time.perf_counter()
        fragment = self.diloco._fragments[index]
        grads = [fragment._grads[name] for name, _ in self.fragments[index]]
        manager = self.manager
        manager.wait_quorum()
        maybe_pause_for_fault_test(self.syncs + 1, self.rank, "sync")  # a test may kill this replica here
        if manager.errored() is None and grads:
            work = PseudoGradientExchange(grads, manager._pg, codec=self.codecs[index],
                                          participating=manager.is_participating(),
                                          participants=manager.num_participants(), on_error=self._exchange_failed,
                                          on_done=self._count)
        else:
            work = _DummyWork(None)
        fragment._allreduce_work.append(work)
        self.seconds += time.perf_counter() - start

    def _exchange_failed(self, err: Exception) -> None:
        logger.warning("DiLoCo pseudo-gradient exchange failed: %s", err)
        self.manager.report_error(err)

    def _count(self, sent: int, uncompressed: int) -> None:
        self.bytes_sent += sent
        self.bytes_uncompressed += uncompressed

    # ------------------------------------------------------------------ telemetry (the state: OuterStateMixin)
    def stats(self) -> dict:
        return {
            "hook": "diloco",
            "syncs": self.syncs,
            "failed_syncs": self.failed_syncs,
            "bytes_sent": self.bytes_sent,
            "bytes_uncompressed": self.bytes_uncompressed,
            "compression_ratio": self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0,
            "seconds": self.seconds,
        }

    def reset_stats(self) -> None:
        self.bytes_sent = self.bytes_uncompressed = self.syncs = self.failed_syncs = 0
        self.fragment_syncs = [0] * len(self.fragments)
        self.seconds = 0.0

    def close(self) -> None:
        """Stop the Manager's threads and servers (the process can then exit cleanly)."""
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
