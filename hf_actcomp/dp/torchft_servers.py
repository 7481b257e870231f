"""torchft's servers for DiLoCo's replica groups: the lighthouses, the Manager's server and the
reconfigurable gloo group, each bound to (and advertised under) the host the user names.

Stage s of every replica forms stage s's replica group, with its own lighthouse (one address per
stage in `TORCHFT_LIGHTHOUSE`, or started here in one launch of every replica). torchft binds
the Manager's server to every interface (`[::]`) and advertises the gloo group's rendezvous store
under the machine's hostname, which may not resolve inside a network namespace or a container;
`manager_server_bound_to` and `bound_process_group` use the host the user names instead
(`HF_ACTCOMP_TORCHFT_HOST`). `hf_actcomp.dp.outer.OuterSync` builds its Manager with them.

torchft's private API used here (pinned in pyproject.toml; tests/test_diloco.py fails loudly when
a release changes it): `torchft.manager.ManagerServer`, swapped while the Manager is built, and
`ProcessGroupGloo.get_reconfigure_handle`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Iterator

import torch.distributed as dist

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
def manager_server_bound_to(host: str) -> Iterator[None]:
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


def bound_process_group(host: str, timeout: datetime.timedelta):
    """torchft's reconfigurable gloo group, advertising its rendezvous store under `host`."""
    from torchft.process_group import ProcessGroupGloo

    class BoundProcessGroupGloo(ProcessGroupGloo):
        def get_reconfigure_handle(self) -> str:
            handle = json.loads(super().get_reconfigure_handle())
            handle["store"] = f"{_url_host(host)}:{handle['store'].rsplit(':', 1)[1]}"
            return json.dumps(handle)

    return BoundProcessGroupGloo(timeout=timeout)
