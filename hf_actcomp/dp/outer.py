"""The replicas' outer step (DiLoCo) through torchft: one replica group per pipeline stage.

Stage s of every replica forms stage s's replica group, with its own torchft lighthouse: each
stage syncs on its own (its quorum never waits for another stage, so `stagger` cannot deadlock the
pipeline), and a restarted replica heals each stage from that stage's peer. Each process runs a
torchft `Manager` of a group of one (this stage of this replica) and torchft's `DiLoCo` over the
stage's trainable parameters, hooked to the user's inner optimizer: one fragment (DiLoCo), or
`fragments` of them that sync in turn (Streaming DiLoCo, `hf_actcomp.dp.fragments`). torchft
restores a fragment's weights when its sync fails (a lost peer) and heals a replica that comes
back.

Every use of torchft's private API is in this module (pinned in pyproject.toml; tests/test_diloco.py
fails loudly when a release changes it):
- each fragment's `_average_grads`, replaced so that the pseudo-gradient goes through our codec
  (`hf_actcomp.dp.diloco.PseudoGradientCodec`, one per fragment) and its bytes are counted;
- `Manager._pg`, `DiLoCo._fragments`, `DiLoCo._local_step`, the fragment's `_grads`,
  `original_parameters`, `restore_parameters` and `_allreduce_work`;
- `torchft.manager.ManagerServer`, swapped while the Manager is built: torchft binds it to every
  interface (`[::]`); here it binds to the host the user names;
- `ProcessGroupGloo.get_reconfigure_handle`, whose rendezvous store torchft advertises under the
  machine's hostname: here under the host the user names (a hostname may not resolve inside a
  network namespace or a container).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..resume import maybe_pause_for_fault_test
from .diloco import PseudoGradientCodec
from .exchange import PseudoGradientExchange
from .fragments import split_fragments

logger = logging.getLogger(__name__)

HOST_ENV = "HF_ACTCOMP_TORCHFT_HOST"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
DEFAULT_HOST = "127.0.0.1"


def require_torchft():
    """torchft, or an error naming the extra that installs it."""
    try:
        import torchft
    except ImportError as err:
        raise ImportError(
            "Plan.dp_compression='diloco' runs on torchft, which is not installed. Install the extra: "
            "pip install 'hf-actcomp[torchft]'."
        ) from err
    return torchft


def bind_host() -> str:
    """The address this process's torchft servers bind to and advertise (`HF_ACTCOMP_TORCHFT_HOST`)."""
    return os.environ.get(HOST_ENV, DEFAULT_HOST)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def start_lighthouse(min_replicas: int, host: str):
    """A torchft lighthouse bound to `host`: (the server, its address)."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind=f"{_url_host(host)}:0", min_replicas=min_replicas)
    port = server.address().rsplit(":", 1)[1]  # it advertises the machine's hostname: use `host`
    return server, f"http://{_url_host(host)}:{port}"


def lighthouse_addresses(num_stages: int) -> list[str] | None:
    """One lighthouse address per stage from `TORCHFT_LIGHTHOUSE` (comma-separated), or None."""
    value = os.environ.get(LIGHTHOUSE_ENV)
    if not value:
        return None
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    if len(addresses) != num_stages:
        raise ValueError(
            f"{LIGHTHOUSE_ENV}={value!r} names {len(addresses)} lighthouse(s); DiLoCo over {num_stages} stages needs "
            f"one per stage, comma-separated (each stage's replicas form their own group)."
        )
    return addresses


def lighthouses(plan, host: str) -> tuple[list, list[str]]:
    """(servers started here, one lighthouse address per stage). From `TORCHFT_LIGHTHOUSE` when
    set; otherwise, in one launch of every replica, replica 0's process of each stage starts that
    stage's lighthouse on `host` and tells the others (collective). It is one of the stage's own
    syncing processes, so it cannot finish and take the lighthouse with it while the stage's last
    quorum is still forming. A replica launched on its own must be told."""
    addresses = lighthouse_addresses(plan.num_stages)
    if addresses is not None:
        return [], addresses
    if dist.get_world_size() != plan.world_size:
        raise ValueError(
            f"A DiLoCo replica launched on its own (REPLICA_GROUP_ID) needs {LIGHTHOUSE_ENV}: the address of one "
            f"torchft lighthouse per stage ({plan.num_stages}), comma-separated. Start them with "
            "`torchft_lighthouse --bind HOST:PORT --min_replicas N` (docs/data_parallel.md)."
        )
    servers, mine = [], None
    if dist.get_rank() < plan.num_stages:  # replica 0: rank = stage
        server, mine = start_lighthouse(plan.diloco.min_replicas or plan.data_parallel, host)
        servers.append(server)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return servers, gathered[: plan.num_stages]


@contextlib.contextmanager
def _manager_server_bound_to(host: str) -> Iterator[None]:
    """While a Manager is built, its server binds to `host` instead of every interface."""
    import torchft.manager as manager_module

    original = manager_module.ManagerServer

    def bound(**kwargs):
        port = kwargs["bind"].rsplit(":", 1)[1]
        return original(**{**kwargs, "bind": f"{_url_host(host)}:{port}", "hostname": host})

    manager_module.ManagerServer = bound
    try:
        yield
    finally:
        manager_module.ManagerServer = original


def _process_group(host: str, timeout: datetime.timedelta):
    """torchft's reconfigurable gloo group, advertising its rendezvous store under `host`."""
    from torchft.process_group import ProcessGroupGloo

    class BoundProcessGroupGloo(ProcessGroupGloo):
        def get_reconfigure_handle(self) -> str:
            handle = json.loads(super().get_reconfigure_handle())
            handle["store"] = f"{_url_host(host)}:{handle['store'].rsplit(':', 1)[1]}"
            return json.dumps(handle)

    return BoundProcessGroupGloo(timeout=timeout)


class _Parameters(nn.Module):
    """A fragment for torchft: exactly these named parameters (a run of the stage's trainable ones)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self._named = list(named)

    def named_parameters(self, *args, **kwargs):  # noqa: ARG002 (torchft passes none)
        return iter(self._named)


HEAL_KEY = "hf_actcomp_fragments"  # our entry in the heal message (Streaming DiLoCo only)


class OuterSync:
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
        with _manager_server_bound_to(host):
            self.manager = Manager(
                pg=_process_group(host, delta), load_state_dict=None, state_dict=None,
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
        self.codecs = [PseudoGradientCodec(config.compression, sum(p.numel() for _, p in fragment), device)
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

    # ------------------------------------------------------------------ telemetry and state
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
        self._resumed_in_flight = None
        self.manager.start_quorum()
        if self._in_flight_failed:
            self.manager.report_error(RuntimeError("this sync's exchange had failed before the checkpoint"))

    def close(self) -> None:
        """Stop the Manager's threads and servers (the process can then exit cleanly)."""
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
