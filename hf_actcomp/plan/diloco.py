"""`DiLoCoConfig`: the settings of `Plan(dp_compression={"method": "diloco", ...})`, and the
check of `Plan.dp_compression` that expands them.

Apart from the plan because it is the one data-parallel method with settings of its own (replicas
that talk every `sync_every` steps, through torchft); its code is `hf_actcomp.dp.diloco`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .compression import stateless_compression
from .config import check_choice

DILOCO = "diloco"
REPLICA_ENV = "REPLICA_GROUP_ID"  # torchft's name: this launch's replica, when each replica is launched alone


@dataclass(frozen=True)
class DiLoCoConfig:
    """`Plan(dp_compression={"method": "diloco", ...})`.

    Args:
        sync_every: inner steps (optimizer steps) between two outer steps of a parameter (H).
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
        fragments: Streaming DiLoCo (Douillard et al. 2025): each stage's trainable parameters
            are split into this many fragments (whole tensors, contiguous in name order, balanced
            by element count) and one fragment syncs every `sync_every / fragments` steps, in
            turn, so each still syncs every `sync_every` steps while a sync sends about
            1/fragments of the bytes. Must divide `sync_every`; every stage needs at least this
            many trainable tensors (checked by `prepare`). 1: DiLoCo.
        fragment_sync_delay: inner steps between the start of a fragment's sync (its
            pseudo-gradient taken and sent) and its outer step, during which training goes on
            while the exchange runs (torchft's tau). Below `sync_every / fragments`.
        fragment_update_alpha: at a fragment's outer step, its weights become
            `(1 - alpha) * synced + alpha * local` (the local weights keep the delayed steps'
            progress; 0: the synced weights, replicas equal bit for bit).
        error_decay: the pseudo-gradient codec's error feedback, decayed (SparseLoCo's error
            buffer): what a payload missed is multiplied by this before it joins the next
            sync's pseudo-gradient, so that stale residues fade. 1: plain error feedback,
            nothing ever dropped. In (0, 1]; used with `compression` only.
    """

    sync_every: int = 32
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compression: Any = None
    stagger: bool = False
    min_replicas: int | None = None
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    error_decay: float = 1.0

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
        _check_fragments(config, owner)
        decay = config.error_decay
        if not isinstance(decay, int | float) or isinstance(decay, bool) or not 0 < decay <= 1:
            raise ValueError(f"{owner} error_decay={decay!r} must be a number in (0, 1] (1: plain error feedback).")
        compression = config.compression
        if compression is not None:
            compression = stateless_compression(compression, f"{owner} compression")
        return cls(**{**asdict(config), "compression": compression})

    def to_params(self) -> dict[str, Any]:
        """The JSON-ready dict `Plan.dp_compression` holds (with `method`)."""
        params = asdict(self)
        if self.compression is not None:
            params["compression"] = asdict(self.compression)
        return {"method": DILOCO, **params}

    @property
    def fragment_every(self) -> int:
        """Inner steps between two syncs of a stage (of successive fragments): H / fragments."""
        return self.sync_every // self.fragments

    def offset(self, stage: int, num_stages: int) -> int:
        """Inner steps stage `stage` waits before its first sync (0 without `stagger`): the
        stages' syncs spread evenly over the `fragment_every` steps between two of them."""
        return stage * self.fragment_every // num_stages if self.stagger else 0

    def label(self) -> str:
        """Short label for cards and logs, e.g. `diloco-H32-quantize8` (`diloco-H32-F4-...`
        with fragments, `-d1` with a sync delay, `-ed0.9` with a decayed error feedback)."""
        codec = self.compression.describe() if self.compression is not None else "fp32"
        streaming = f"-F{self.fragments}" if self.fragments > 1 else ""
        delay = f"-d{self.fragment_sync_delay}" if self.fragment_sync_delay else ""
        decay = f"-ed{self.error_decay:g}" if self.error_decay != 1 else ""
        return f"diloco-H{self.sync_every}{streaming}{delay}-{codec}{decay}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fragments(config: DiLoCoConfig, owner: str) -> None:
    """Streaming DiLoCo's settings, as torchft's `DiLoCo` needs them: one fragment syncs every
    H / fragments steps (so fragments divides H), and a delayed sync ends before the next starts."""
    fragments, delay, alpha = config.fragments, config.fragment_sync_delay, config.fragment_update_alpha
    if not _is_int(fragments) or fragments < 1:
        raise ValueError(f"{owner} fragments={fragments!r} must be an integer >= 1 (1: plain DiLoCo).")
    if config.sync_every % fragments:
        divisors = [f for f in range(1, config.sync_every + 1) if config.sync_every % f == 0]
        raise ValueError(f"{owner} fragments={fragments} must divide sync_every={config.sync_every} (one fragment "
                         f"syncs every sync_every / fragments steps): one of {divisors}.")
    every = config.sync_every // fragments
    if not _is_int(delay) or not 0 <= delay < every:
        raise ValueError(f"{owner} fragment_sync_delay={delay!r} must be an integer in 0..{every - 1} (below "
                         f"sync_every / fragments = {every}: a fragment's sync ends before the next one starts).")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0 <= alpha <= 1:
        raise ValueError(f"{owner} fragment_update_alpha={alpha!r} must be a number in [0, 1].")


def check_dp_compression(value: str | dict[str, Any], data_parallel: int) -> str | dict[str, Any]:
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

    check_choice("Plan", "dp_compression", method, [*available_hooks(), DILOCO])
    return value
