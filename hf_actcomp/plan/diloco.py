"""`DiLoCoConfig`: the settings of `Plan(dp_compression={"method": "diloco", ...})`, and the
check of `Plan.dp_compression` that expands them.

Apart from the plan because it is the one data-parallel method with settings of its own (replicas
that talk every `sync_every` steps, through torchft); its code is `hf_actcomp.dp.diloco`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .compression import _stateless_compression
from .config import _check_choice

DILOCO = "diloco"
REPLICA_ENV = "REPLICA_GROUP_ID"  # torchft's name: this launch's replica, when each replica is launched alone


@dataclass(frozen=True)
class DiLoCoConfig:
    """`Plan(dp_compression={"method": "diloco", ...})`.

    Args:
        sync_every: inner steps (optimizer steps) between outer steps (H).
        outer_lr: learning rate of the outer SGD step.
        outer_momentum: momentum of the outer step (0: none).
        nesterov: Nesterov momentum (needs outer_momentum > 0).
        compression: codec of the pseudo-gradient, with error feedback: a stateless
            `Compression` or its dict, e.g. `{"method": "quantize", "bits": 8}` or
            `{"method": "hadamard", "bits": 4}`, or SparseLoCo's top 2% of each chunk at 2 bits,
            `{"method": "topk_quantize", "ratio": 0.02, "bits": 2}`. None: fp32, exact.
        stagger: offset stage s's syncs by s * sync_every / num_stages steps, so that the stages'
            bursts do not share the link at the same moment.
        min_replicas: replicas an outer step needs; with fewer than `data_parallel`, the others
            go on when one is lost. None: all of them.
    """

    sync_every: int = 32
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compression: Any = None
    stagger: bool = False
    min_replicas: int | None = None

    @classmethod
    def from_params(cls, params: dict[str, Any], data_parallel: int) -> DiLoCoConfig:
        """Checked settings from `dp_compression` without its `method` key; errors name the key."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"Plan.dp_compression (diloco) does not take {unknown}. "
                             f"Its settings: {', '.join(sorted(known))}.")
        config = cls(**params)
        owner = "Plan.dp_compression (diloco)"
        if not isinstance(config.sync_every, int) or isinstance(config.sync_every, bool) or config.sync_every < 1:
            raise ValueError(f"{owner} sync_every={config.sync_every!r} must be an integer >= 1.")
        if not isinstance(config.outer_lr, int | float) or not config.outer_lr > 0:
            raise ValueError(f"{owner} outer_lr={config.outer_lr!r} must be a number > 0.")
        if not isinstance(config.outer_momentum, int | float) or not 0 <= config.outer_momentum < 1:
            raise ValueError(f"{owner} outer_momentum={config.outer_momentum!r} must be in [0, 1).")
        if not isinstance(config.nesterov, bool):
            raise ValueError(f"{owner} nesterov={config.nesterov!r} must be True or False.")
        if config.nesterov and config.outer_momentum == 0:
            raise ValueError(f"{owner} nesterov=True needs outer_momentum > 0; set nesterov=False for plain SGD.")
        if not isinstance(config.stagger, bool):
            raise ValueError(f"{owner} stagger={config.stagger!r} must be True or False.")
        minimum = config.min_replicas
        if minimum is not None and (not isinstance(minimum, int) or not 1 <= minimum <= data_parallel):
            raise ValueError(f"{owner} min_replicas={minimum!r} must be an integer in 1..data_parallel "
                             f"({data_parallel}), or None for all of them.")
        compression = config.compression
        if compression is not None:
            compression = _stateless_compression(compression, f"{owner} compression")
        return cls(**{**asdict(config), "compression": compression})

    def to_params(self) -> dict[str, Any]:
        """The JSON-ready dict `Plan.dp_compression` holds (with `method`)."""
        params = asdict(self)
        if self.compression is not None:
            params["compression"] = asdict(self.compression)
        return {"method": DILOCO, **params}

    def offset(self, stage: int, num_stages: int) -> int:
        """Inner steps stage `stage` waits before its first sync (0 without `stagger`)."""
        return stage * self.sync_every // num_stages if self.stagger else 0

    def label(self) -> str:
        """Short label for cards and logs, e.g. `diloco-H32-quantize8`."""
        codec = self.compression.describe() if self.compression is not None else "fp32"
        return f"diloco-H{self.sync_every}-{codec}"


def _check_dp_compression(value: str | dict[str, Any], data_parallel: int) -> str | dict[str, Any]:
    """`Plan.dp_compression`, checked: a registered data-parallel hook (its name, or a dict with
    `method`), or `diloco` with every setting filled in (`DiLoCoConfig.to_params`)."""
    method = value.get("method") if isinstance(value, dict) else value
    if method == DILOCO:
        if data_parallel < 2:
            raise ValueError(f"Plan.dp_compression='diloco' needs data_parallel >= 2 replicas, got "
                             f"data_parallel={data_parallel}.")
        params = {k: v for k, v in value.items() if k != "method"} if isinstance(value, dict) else {}
        value = DiLoCoConfig.from_params(params, data_parallel).to_params()
    # The hook registry (hf_actcomp.dp.base imports nothing of the package), imported here: at the
    # top, importing it would first run hf_actcomp.dp, which imports this package via checkpoint.
    from ..dp.base import available_hooks

    _check_choice("Plan", "dp_compression", method, [*available_hooks(), DILOCO])
    return value
