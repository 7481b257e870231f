"""`Plan.auto`: each boundary direction's codec, chosen from its measured link and the compute.

The rule. Under 1F1B with communication overlapped, a step of M micro-batches costs the busiest
stage's compute, M x c (c: its forward + backward of one micro-batch), plus, per boundary
direction, what its transfers add: the first forward and the last backward transfer of a step are
never hidden (the pipeline fills and drains), and in between each transfer is hidden only up to
the compute beside it. So a direction whose transfer takes t seconds per micro-batch adds about

    cost(t) = t + M x max(0, t - c)

to a step. Per boundary and direction the choice is the least compression of the ladder whose
cost is within its share of `tolerance` x M x c of the cheapest rung's (the tolerance is the
step's, shared equally by its directions: 2 per boundary, and the tie's when it is chosen). Once
a transfer hides behind compute, more compression buys no speed, only quality cost. t is half
the measured round trip plus the payload over the measured bandwidth. On a link where the round trip dominates, the bytes hardly
matter, so a weak codec is picked there.

Quality in time. A rung that needs more steps to reach a given eval loss must save more than those
steps cost: each rung's cost is compared as cost(t) + extra_steps x S, where extra_steps is the
fraction of steps it was measured to add on the way to the uncompressed run's eval loss
(`EXTRA_STEPS`, `TIE_EXTRA_STEPS`, from benchmarks/time_to_quality.py) and S the step at best
(M x c plus every direction's cheapest rung). On SmolLM2 no rung was measured to add steps
(2-bit activations, 4-bit gradients and the 4-bit tie reached every target at uncompressed's
step), so the charges are 0 today; the toy model's 24% for 2-bit activations once kept them out
of `quality="safe"`.

The ladders hold only settings whose quality cost was measured fine-tuning a real pretrained LLM
(SmolLM2-135M, 2 and 4 stages: continued training, `MEASURED`, 3 seeds; instruction tuning,
`SFT_MEASURED`, 8 seeds for "safe"; docs/real_model.md). A forward rung and a backward
rung combine into a pair no stronger in either direction than the ladder's last rungs, which form
a measured pair within the quality level; tests/test_auto.py checks that against the results
files.

Everything here is arithmetic on measurements (no process group): `choose` is what the pipeline
runs on rank 0, and what `hf-actcomp estimate --auto` runs on link speeds you give it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..feedback import build_codec
from . import AutoConfig, Compression

NONE = Compression()
# AQ-SGD's first visits (docs/quality.md, compressed warm-up). On SmolLM2 `hadamard_outliers` 4 bits:
# the plain Hadamard-4 warm-up trailed uncompressed by 0.17-0.47% through a one-epoch fine-tune
# (benchmarks/results/time_to_quality_smollm2_5mbit_1epoch.md), this one ends within 0.05% in every
# seed at 2 and 4 stages (real_model_finetune.md, "aqsgd fw4/bw8 warm-up h_o4").
WARM_UP = Compression("hadamard_outliers", bits=4)


def _quantize(bits: int) -> Compression:
    return Compression("quantize", bits=bits)


def _outliers(bits: int) -> Compression:
    return Compression("hadamard_outliers", bits=bits)


def _aqsgd(bits: int) -> Compression:
    return Compression("aqsgd", bits=bits, first_visit=WARM_UP)


def _aqsgd_outliers(bits: int) -> Compression:
    """AQ-SGD whose deltas and warm-up go through `hadamard_outliers`: at 2 bits quantize's deltas
    break on a real LLM's massive values (docs/real_model.md), these hold."""
    return Compression("aqsgd", inner="hadamard_outliers", bits=bits, first_visit=WARM_UP)


# Least to most compression. Quality levels (AutoConfig.quality): "safe" = within 0.3% of `none`
# in every seed of continued training and by the median of 8 seeds instruction tuning on 48 pairs,
# "fast" = within 1% by the median of both, at every stage count measured. The strongest pair of
# each ladder is a measured row of MEASURED (fine-tuning the real SmolLM2-135M, 3 seeds, 2 and 4
# stages) and of SFT_MEASURED (docs/real_model.md). Direct quantization, which held on the toy
# model, fails there (fw3/bw6 +1.9% / +3.4%), so the stateless ladders hold `hadamard_outliers`
# rungs. AQ-SGD fw2/bw4 with quantize's deltas ended +12% above uncompressed instruction tuning
# SmolLM2: its 2-bit rung sends hadamard_outliers deltas. On the 48-pair set AQ-SGD fw4/bw8 (quantize
# deltas) and `hadamard_outliers` fw3/bw6 end +0.50% / +0.53% at 2 stages by the median of 8 seeds,
# above "safe"'s 0.3%, where the 2-bit hadamard_outliers rung ends +0.10% / -0.44% at 2 / 4 stages:
# "safe"'s AQ-SGD ladder goes straight to it (a protocol fixed before the runs, docs/real_model.md).
# Stateless, "fast" goes to `hadamard_outliers` fw3/bw6 (6.5x); "safe" stops at fw6/bw8, the one
# stateless pair measured within 0.3% on the 48-pair set at both stage counts (fw3/bw6: +0.53% at 2).
STATELESS = {"forward": [NONE, _outliers(6), _outliers(4), _outliers(3)],
             "backward": [NONE, _quantize(8), _quantize(6)]}
SAFE_STATELESS = {"forward": [NONE, _outliers(6)], "backward": [NONE, _quantize(8)]}
LADDERS: dict[tuple[str, bool], dict[str, list[Compression]]] = {
    ("safe", False): SAFE_STATELESS,
    ("fast", False): STATELESS,
    ("safe", True): {"forward": [NONE, _aqsgd_outliers(2)],
                     "backward": [NONE, _quantize(8), _quantize(6), _quantize(4)]},
    ("fast", True): {"forward": [NONE, _aqsgd(4), _aqsgd_outliers(2)],
                     "backward": [NONE, _quantize(8), _quantize(6), _quantize(4)]},
}
MEASURED = "real_model_finetune"  # benchmarks/results/, by the strongest pair's fw / bw
SFT_MEASURED = "real_model_sft"  # instruction tuning on 48 pairs (docs/real_model.md)
THRESHOLDS = {"safe": ("worst", 0.3), "fast": ("median", 1.0)}  # MEASURED: percent over `none`, by seed
SFT_THRESHOLDS = {"safe": 0.3, "fast": 1.0}  # SFT_MEASURED: the median, percent over `none`
SFT_SEEDS = {"safe": 8, "fast": 3}  # seeds the median takes at least (3 seeds resolve 1%, not 0.3%)

# Time to quality on SmolLM2 (benchmarks/time_to_quality.py --model smollm2, 5 Mbit/s; the target
# uncompressed's eval loss, measured in the run): per round, the steps the strongest pair (AQ-SGD
# fw2/bw4 with hadamard_outliers deltas, tie q8) took over uncompressed's. 24 of 24, 16 of 16 and
# 36 of 36 in the one-, two- and three-epoch runs: no charge. "safe" charges the worst round, "fast"
# the median. The toy model's runs had charged 23.5% (2-bit quantize deltas, 168 steps against 136
# on 3 stages), which kept "safe" off these rungs before SmolLM2 measured them.
STEPS_MEASURED = ("time_to_quality_smollm2_5mbit_1epoch", "time_to_quality_smollm2_5mbit_2epoch",
                  "time_to_quality_smollm2_5mbit_3epoch")
EXTRA_STEPS = {"safe": 0.0, "fast": 0.0}
# The rungs a charge would fall on: 2-bit activations and 4-bit gradients (measured together).
STEP_COSTLY = {"forward": [_aqsgd_outliers(2)], "backward": [_quantize(4)]}

# The tie's 4-bit rung, measured apart on SmolLM2 (5 Mbit/s, three epochs, the target uncompressed's
# eval after them, measured in the run): per run, the steps to the target with tie q4 over those of
# the same boundary codecs with tie q8. AQ-SGD fw4/bw8 (h_o4 warm-up): 36 and 36 in all four runs
# (three files, the last of two rounds), the curves within 0.0001 at every evaluation;
# AQ-SGD(h_o) fw2/bw4 with tie q4 also at 36. It replaced the toy
# model's 23.5%, which the tie shared with 2-bit activations and 4-bit gradients (never measured
# apart there).
TIE_STEPS_MEASURED = ("time_to_quality_smollm2_5mbit_3epoch_tie", "time_to_quality_smollm2_5mbit_3epoch_auto",
                      "time_to_quality_smollm2_5mbit_3epoch_auto_2rounds")
TIE_EXTRA_STEPS = {"safe": 0.0, "fast": 0.0}  # the worst run, the median
TIE_STEP_COSTLY = _quantize(4)


def extra_steps(config: AutoConfig, kind: str, rung: Compression | None) -> float:
    """The fraction of steps `rung` ("forward" / "backward" / "tie") is charged under `config`."""
    if not config.aqsgd:
        return 0.0
    if kind == "tie":
        return TIE_EXTRA_STEPS[config.quality] if rung == TIE_STEP_COSTLY else 0.0
    return EXTRA_STEPS[config.quality] if rung in STEP_COSTLY[kind] else 0.0


# The tied embedding's rows (GPT-2, OPT, Gemma, SmolLM2: a first stage and a last stage sharing it),
# when the plan leaves `tie_compression` unset: exact (None), 8 bits, 4 bits only with AQ-SGD. On
# SmolLM2 (MEASURED, rows "... + tie q8/q4", 3 seeds, 2 and 4 stages) each ladder's strongest pair
# with its strongest tie rung ends where it ends with exact rows: AQ-SGD fw4/bw8 + tie q4 and
# AQ-SGD(hadamard_outliers) fw2/bw4 + tie q4 within +0.04% in every seed, hadamard_outliers fw3/bw6
# + tie q8 below uncompressed. (Toy-model first measurement: finetune_quality_tie_warmup.json.)
TIE_LADDERS = {False: [None, _quantize(8)], True: [None, _quantize(8), _quantize(4)]}


def ladder(config: AutoConfig, direction: str) -> list[Compression]:
    """The rungs `config` may pick for `direction` ("forward" / "backward"), least compression first."""
    return LADDERS[(config.quality, config.aqsgd)][direction]


@dataclass
class Link:
    """One direction of one boundary, as measured: bytes per second and round trip in seconds.
    `at_least`: the probe crossed within a round trip's noise, so only a lower bound of the
    bandwidth is known (a fast link; its transfers cost about a round trip whatever they carry)."""

    bandwidth: float
    rtt: float
    at_least: bool = False

    def seconds(self, nbytes: int) -> float:
        """One payload's transfer: half a round trip, then the bytes at the bandwidth."""
        return self.rtt / 2 + nbytes / self.bandwidth


@dataclass
class Measurements:
    """What `choose` decides on.

    Args:
        compute: seconds per micro-batch (forward + backward) of each stage.
        links: per boundary, its `forward` and `backward` `Link`.
        payload_shape: one micro-batch's boundary tensor, (rows, tokens, hidden).
        micro_batches: per step (M).
        dtype: what crosses a boundary uncompressed.
        tie_rows: the rows of a tied embedding one step exchanges (its distinct tokens), when the
            codec of the tie is to be chosen too; they go over the slowest boundary's links.
    """

    compute: list[float]
    links: list[dict[str, Link]]
    payload_shape: tuple[int, int, int]
    micro_batches: int = 1
    dtype: torch.dtype = torch.float32
    tie_rows: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"compute_seconds_per_micro_batch": list(self.compute),
                "links": [{d: {"bandwidth_mbit_s": link.bandwidth * 8 / 1e6, "rtt_ms": link.rtt * 1e3,
                               **({"bandwidth_at_least": True} if link.at_least else {})}
                           for d, link in links.items()} for links in self.links],
                "payload_shape": list(self.payload_shape), "micro_batches": self.micro_batches, "dtype": str(self.dtype).removeprefix("torch."),
                "tie_rows": self.tie_rows, **self.extra}


def payload_nbytes(compression: Compression, shape: tuple[int, int, int], dtype: torch.dtype) -> int:
    """Bytes of one micro-batch's payload through `compression` (AQ-SGD: its steady state, the
    inner codec on deltas; first visits go through the warm-up codec)."""
    return build_codec(compression).payload_nbytes(shape, dtype)


def step_cost(t: float, compute: float, micro_batches: int) -> float:
    """Seconds a direction whose transfer takes `t` per micro-batch adds to a step (module docstring)."""
    return t + micro_batches * max(0.0, t - compute)


def choose_direction(rungs: list[Compression | None], link: Link, compute: float, micro_batches: int,
                     tolerance: float, shape, dtype, *, per_step: bool = False,
                     extra: list[float] | None = None, step_seconds: float = 0.0) -> dict[str, Any]:
    """The rung for one direction: the least compression whose step cost, plus the steps it is
    charged (`extra[i]` x `step_seconds`), is within `tolerance` x the step's compute of the
    cheapest rung's. (A tie's rung None is its exact form, the rows in fp32; `per_step`: two
    transfers per step, both on the step's critical path, as the tie's rows before the first
    forward and their gradient rows after the last backward.)"""
    options = [(c, payload_nbytes(c or NONE, shape, dtype)) for c in rungs]
    times = [link.seconds(n) for _, n in options]
    costs = [2 * t if per_step else step_cost(t, compute, micro_batches) for t in times]
    extra = extra or [0.0] * len(rungs)
    charged = [cost + e * step_seconds for cost, e in zip(costs, extra, strict=True)]
    slack = tolerance * micro_batches * compute
    pick = next(i for i, cost in enumerate(charged) if cost <= min(charged) + slack)
    compression, nbytes = options[pick]
    return {"compression": None if compression is None else asdict(compression),
            "codec": "exact" if compression is None else compression.describe(), "bytes": nbytes,
            "transfer_seconds": times[pick], "uncompressed_transfer_seconds": times[0],
            "step_cost_seconds": costs[pick], "uncompressed_step_cost_seconds": costs[0],
            "extra_steps": extra[pick], "hidden": bool(times[pick] <= compute)}


def cheapest(rungs: list[Compression | None], link: Link, compute: float, micro_batches: int, shape, dtype, *,
             per_step: bool = False) -> float:
    """The least a direction can add to a step, whatever it costs in quality."""
    return choose_direction(rungs, link, compute, micro_batches, 0.0, shape, dtype, per_step=per_step)["step_cost_seconds"]


def choose(measured: Measurements, config: AutoConfig) -> dict[str, Any]:
    """Per boundary and direction, the least compression `config` allows whose step cost, with
    the steps it is charged, is within its tolerance of the cheapest (module docstring). Returns
    the decision, JSON-ready: `boundaries` (per boundary, per direction: the `Compression` as a
    dict, codec, bytes, transfer seconds, step cost, steps charged, whether compute hides it),
    `tie` when the tie's codec was chosen too, the compute, the best step and the measurements
    (`plan_boundaries` / `tie_compression` turn it into a plan)."""
    if not measured.links:
        raise ValueError("Plan.auto chooses the codecs of stage boundaries, and 1 stage has none: use num_stages >= 2.")
    if len(measured.compute) != len(measured.links) + 1:
        raise ValueError(f"{len(measured.compute)} stages need {len(measured.compute) - 1} measured boundaries, "
                         f"got {len(measured.links)}.")
    compute, m = max(measured.compute), measured.micro_batches
    shape, dtype = measured.payload_shape, measured.dtype
    # the step at best: every direction on its cheapest rung (what a charged step costs in seconds)
    best_step = m * compute + sum(cheapest(ladder(config, d), links[d], compute, m, shape, dtype)
                                  for links in measured.links for d in ("forward", "backward"))
    tie = None
    if measured.tie_rows:  # rows there and gradient rows back, each over the slowest link of its way
        slowest = Link(bandwidth=min(links[d].bandwidth for links in measured.links for d in links),
                       rtt=max(links[d].rtt for links in measured.links for d in links))
        tie = (TIE_LADDERS[config.aqsgd], slowest, (measured.tie_rows, shape[2]))
        best_step += cheapest(tie[0], slowest, compute, m, tie[2], torch.float32, per_step=True)

    # the tolerance is the whole step's: each direction may use its share of it
    share = config.tolerance / (2 * len(measured.links) + (tie is not None))

    def pick(kind: str, rungs: list[Compression | None], link: Link, shape=shape, dtype=dtype,
             per_step: bool = False) -> dict[str, Any]:
        return choose_direction(rungs, link, compute, m, share, shape, dtype, per_step=per_step,
                                extra=[extra_steps(config, kind, r) for r in rungs], step_seconds=best_step)

    boundaries = [{d: pick(d, ladder(config, d), links[d]) for d in ("forward", "backward")} for links in measured.links]
    decision = {"quality": config.quality, "aqsgd": config.aqsgd, "tolerance": config.tolerance,
                "compute_seconds": compute, "micro_batches": m, "best_step_seconds": best_step,
                "measurements": measured.to_dict(), "boundaries": boundaries}
    if tie is not None:
        decision["tie"] = pick("tie", tie[0], tie[1], shape=tie[2], dtype=torch.float32, per_step=True)
    return decision


def plan_boundaries(decision: dict[str, Any]) -> list[dict[str, Compression]]:
    """`Plan.boundaries` as `decision` chose them."""
    return [{d: Compression(**entry["compression"]) for d, entry in b.items()} for b in decision["boundaries"]]


def tie_compression(decision: dict[str, Any]) -> Compression | None:
    """`Plan.tie_compression` as `decision` chose it (call only when it chose one: `"tie" in decision`)."""
    chosen = decision["tie"]["compression"]
    return None if chosen is None else Compression(**chosen)


def bandwidth_text(link: dict[str, Any], digits: int = 3) -> str:
    """A measured link's bandwidth as a decision records it: "9.6 Mbit/s", or ">= 1.3e+04 Mbit/s"
    where the probe saw only a lower bound."""
    return f"{'>= ' if link.get('bandwidth_at_least') else ''}{link['bandwidth_mbit_s']:.{digits}g} Mbit/s"


def charges(decision: dict[str, Any]) -> dict[float, list[str]]:
    """The rungs `decision`'s ladders charge in steps, by charge (none without AQ-SGD)."""
    quality, found = decision["quality"], {}
    if not decision["aqsgd"] or "best_step_seconds" not in decision:
        return found
    rungs = LADDERS[(quality, True)]
    for kind, name in (("forward", "2-bit activations"), ("backward", "4-bit gradients")):
        if EXTRA_STEPS[quality] and any(rung in rungs[kind] for rung in STEP_COSTLY[kind]):
            found.setdefault(EXTRA_STEPS[quality], []).append(name)
    if TIE_EXTRA_STEPS[quality] and "tie" in decision:
        found.setdefault(TIE_EXTRA_STEPS[quality], []).append("a 4-bit tie")
    return found


def describe(decision: dict[str, Any]) -> str:
    """One line per boundary direction: codec, measured link, transfer and what it adds to a step."""
    m, compute = decision["micro_batches"], decision["compute_seconds"]
    lines = [f"Plan.auto (quality {decision['quality']}): {compute * 1e3:.1f} ms of compute per micro-batch "
             f"(busiest stage), {m} micro-batches: {m * compute * 1e3:.0f} ms per step"]
    for charge, charged in charges(decision).items():
        what = ", ".join(charged[:-1]) + (" and " if len(charged) > 1 else "") + charged[-1]
        lines.append(f"  {what[0].upper() + what[1:]} charged {charge:.1%} of the best step "
                     f"({decision['best_step_seconds'] * 1e3:.0f} ms) for the steps {'they were' if len(charged) > 1 else 'it was'} "
                     "measured to add")
    links = decision["measurements"]["links"]

    def line(choice: dict) -> str:
        hidden = "hidden" if choice["hidden"] else "link-bound"
        if choice.get("extra_steps"):
            hidden += f", charged {choice['extra_steps']:.1%} of steps"
        return (f"{choice['codec']} ({choice['bytes']} B: {choice['transfer_seconds'] * 1e3:.1f} ms, "
                f"+{choice['step_cost_seconds'] * 1e3:.1f} ms per step; uncompressed "
                f"{choice['uncompressed_transfer_seconds'] * 1e3:.1f} ms, +{choice['uncompressed_step_cost_seconds'] * 1e3:.1f} "
                f"ms) [{hidden}]")

    for b, entry in enumerate(decision["boundaries"]):
        for d, choice in entry.items():
            link = links[b][d]
            lines.append(f"  boundary {b} {d} on {bandwidth_text(link)}, {link['rtt_ms']:.3g} ms RTT: "
                         f"{line(choice)}")
    if "tie" in decision:
        lines.append(f"  tied embedding rows ({decision['measurements']['tie_rows']} per step, slowest link): "
                     f"{line(decision['tie'])}")
    return "\n".join(lines)
