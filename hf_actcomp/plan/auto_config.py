"""`AutoConfig`: the settings of `Plan.auto(...)`, whose boundary codecs the pipeline picks from
measurements (`hf_actcomp.plan.codec_choice` decides, `hf_actcomp.pipeline.probe` measures).

Only the settings, checked, and the decision once taken: saved with the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import check_choice

AUTO_QUALITY = ("safe", "fast")


@dataclass(frozen=True)
class AutoConfig:
    """`Plan.auto(...)`: the codecs of each boundary direction chosen from measurements.

    Args:
        quality: which measured settings may be picked (docs/quality.md), and at what charge:
            `"safe"` those within 0.3% of uncompressed fine-tuning's eval loss in every seed of
            continued training and by the median of 8 seeds instruction tuning, the ones measured
            to need more steps to a target loss charged the worst run's extra steps (docs/auto.md);
            `"fast"` those within 1% (median over seeds), charged the median.
        aqsgd: pick AQ-SGD for activations (needs `memory.num_samples` and a `sample_id` in
            every training batch; `ActCompTrainer` fills both); else stateless quantization.
        adapt_every: re-measure every N optimizer steps and switch a boundary's codec when the
            choice changes (None: measure once, at the first step; keeps runs reproducible).
        tolerance: the share of a step's compute that more compression may still save and yet
            not be chosen, over the whole step (each boundary direction and the tie gets an
            equal part; docs/auto.md: the least compression within it of the fastest).
        probe_repeats: transfers and compute runs timed per measurement (the median is kept).
        decision: what was measured and chosen (filled by the pipeline; saved with the plan).
    """

    quality: str = "safe"
    aqsgd: bool = False
    adapt_every: int | None = None
    tolerance: float = 0.05
    probe_repeats: int = 2
    decision: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_choice("Plan.auto", "quality", self.quality, AUTO_QUALITY)
        if not isinstance(self.aqsgd, bool):
            raise ValueError(f"Plan.auto aqsgd={self.aqsgd!r} must be True or False.")
        every = self.adapt_every
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise ValueError(f"Plan.auto adapt_every={every!r} must be an integer >= 1 (optimizer steps), or None.")
        if not isinstance(self.tolerance, int | float) or not 0 <= self.tolerance <= 1:
            raise ValueError(f"Plan.auto tolerance={self.tolerance!r} must be a number in [0, 1].")
        if not isinstance(self.probe_repeats, int) or not 1 <= self.probe_repeats <= 100:
            raise ValueError(f"Plan.auto probe_repeats={self.probe_repeats!r} must be an integer in 1..100.")

