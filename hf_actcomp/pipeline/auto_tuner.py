"""Plan.auto inside a running pipeline: measure this stage's compute and its links, agree with
every rank on the codecs (rank 0 decides, probe.py), and switch the runner's boundary ends.

Measured at the first step, and every `adapt_every` optimizer steps after when the plan asks; a
resumed run takes back the decision its compression state was saved under.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import torch

from ..batching import MicroBatch
from ..plan import Plan
from ..plan.codec_choice import describe as describe_decision
from ..plan.codec_choice import plan_boundaries, tie_compression
from ..state.compression import saved_metadata
from ..telemetry import TrafficCounter
from .probe import agree, measure_links, timed_median
from .runner import StageRunner
from .tie import TiedEmbedding

logger = logging.getLogger("hf_actcomp.pipeline.engine")  # the logger docs/auto.md names for switches


class AutoTuner:
    """Plan.auto's measure-and-decide for one stage; the plan it changes is the runner's.

    Args:
        runner: this stage (its module for the compute measure, its boundary ends to switch).
        tie: this stage's end of a tied embedding, or None (its codec is chosen once).
        counter: where the probes' bytes are counted (`probe`).
    """

    def __init__(self, runner: StageRunner, tie: TiedEmbedding | None, counter: TrafficCounter) -> None:
        self.runner = runner
        self.tie = tie
        self.counter = counter
        self.switches: list[dict] = []
        self.decided_at = 0  # the optimizer step of the last decision
        self.seconds = 0.0  # measuring and deciding, outside the steps' clocks

    def due(self, optimizer_steps: int, at_optimizer_step: bool) -> bool:
        """Measure and choose now: at the first step of an undecided `Plan.auto`, and every
        `adapt_every` optimizer steps after (only between optimizer steps)."""
        config = self.runner.plan.autotune
        if config.decision is None:
            return True
        return (config.adapt_every is not None and at_optimizer_step
                and optimizer_steps - self.decided_at >= config.adapt_every)

    def select(self, micro: list[MicroBatch], input_ids: torch.Tensor, optimizer_steps: int) -> None:
        """Measure the compute and the links, agree on the codecs (rank 0 decides), apply them.
        The tie's codec is chosen once, at the first decision, when the plan leaves it unset."""
        runner, plan = self.runner, self.runner.plan
        config = plan.autotune
        start = time.perf_counter()
        # the largest micro-batch (tensor_split puts extra rows first); Plan.auto takes only models whose
        # boundaries all carry this shape (`ModelAdapter.uniform_boundaries`, checked by split_model)
        shape = runner.shape(micro[0])
        nbytes = math.prod(shape) * torch.empty((), dtype=runner.boundary_dtype).element_size()
        compute = self.measure_compute(micro[0], config.probe_repeats)
        links = measure_links(runner.transport, runner.mesh, runner.device, nbytes, config.probe_repeats, self.counter)
        tie_rows = None
        if config.decision is None and plan.tie_compression is None and self.tie is not None and self.tie.active:
            tie_rows = int(TiedEmbedding.rows_of(input_ids).numel())  # known on rank 0 (the first stage)
        decision = agree(config, runner.mesh, compute, links, shape, runner.boundary_dtype, runner.device,
                         self.counter, len(micro), tie_rows)
        decision["optimizer_step"] = optimizer_steps
        self.apply(decision, optimizer_steps)
        self.seconds += time.perf_counter() - start

    def measure_compute(self, mb: MicroBatch, repeats: int) -> float:
        """Seconds of this stage's forward and backward of one micro-batch (the median of
        `repeats` runs on stand-in inputs of its shape), leaving gradients and random state as
        they were: a run that keeps its codecs is the run it would have been."""
        runner, device = self.runner, self.runner.device
        params = [p for p in runner.stage.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None

        def run() -> None:
            x = mb.input_ids if runner.is_first else torch.randn(
                runner.shape(mb), dtype=runner.boundary_dtype, device=device, requires_grad=True)
            with runner.autocast():
                out = runner.stage(x, mb.attention_mask, mb.input_ids, mb.token_type_ids)
                loss = runner.loss(out, mb.labels, None) if runner.is_last else out.float().sum()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            for p in params:
                p.grad = None

        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                return timed_median(run, repeats)
        finally:
            for p, grad in zip(params, saved, strict=True):
                p.grad = grad

    def apply(self, decision: dict, optimizer_steps: int, why: str = "measured") -> None:
        """Switch the runner to the codecs `decision` chose (where they differ), log what changed."""
        runner = self.runner
        previous = runner.boundaries
        plan = dataclasses.replace(runner.plan, boundaries=plan_boundaries(decision),
                                   autotune=dataclasses.replace(runner.plan.autotune, decision=decision))
        if "tie" in decision:  # only in a first decision (or the saved one): no tie row has crossed yet
            plan = dataclasses.replace(plan, tie_compression=tie_compression(decision))
            if self.tie is not None:
                self.tie.set_compression(plan.tie_compression)
        runner.use(plan)
        self.decided_at = optimizer_steps
        if runner.mesh.rank == 0:
            logger.info("%s", describe_decision(decision))
        if optimizer_steps == 0:
            return  # the first choice, before any training: nothing is switched
        for name, old in previous.items():
            new = runner.boundaries[name].compression
            if new == old.compression:
                continue
            memory = ("AQ-SGD memory kept" if old.compression.method == new.method == "aqsgd"
                      else "AQ-SGD memory started empty" if new.method == "aqsgd" else "")
            self.switches.append({"optimizer_step": optimizer_steps, "channel": name,
                                  "from": old.compression.describe(), "to": new.describe(), "memory": memory,
                                  "why": why})
            logger.info("Plan.auto: %s switched from %s to %s at optimizer step %d%s", name,
                        old.compression.describe(), new.describe(), optimizer_steps,
                        f" ({memory})" if memory else "")

    def restore(self, directory: str | os.PathLike, rank: int, optimizer_steps: int) -> bool:
        """Take back the decision saved with the compression state of `rank` in `directory`;
        whether there was one (then the runner's ends changed)."""
        saved = Plan.from_dict(saved_metadata(directory, rank)["plan"])
        if saved.autotune is None or saved.autotune.decision is None:
            return False
        self.apply(saved.autotune.decision, optimizer_steps, why="resumed")
        return True

    def summary(self) -> dict:
        """The decision in force and every switch so far (`Pipeline.stats()['auto']`)."""
        return {"decision": self.runner.plan.autotune.decision, "switches": list(self.switches)}
