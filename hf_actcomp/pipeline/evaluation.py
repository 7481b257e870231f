"""`eval_step`'s loop: every micro-batch forward through the boundaries' stateless codecs.

Kept apart from the training executor because it touches none of the training state: no AQ-SGD
memory or error feedback, no backward, no schedule (forwards in micro-batch order). Its bytes go
to the `evaluation` counter, the tie's rows included.
"""

from __future__ import annotations

import torch

from ..batching import MicroBatch
from ..codecs import make_codec
from ..telemetry import TrafficCounter
from .link import naming_the_step
from .runner import StageRunner
from .tie import TiedEmbedding


class Evaluation:
    """This rank's part of `Pipeline.eval_step`.

    Args:
        runner: this stage (its module, its boundary ends and their links).
        tie: this stage's end of a tied embedding, or None (its rows are sent as in training).
        counter: where everything evaluation sends is counted (`evaluation`).
    """

    def __init__(self, runner: StageRunner, tie: TiedEmbedding | None, counter: TrafficCounter) -> None:
        self.runner = runner
        self.tie = tie
        self.counter = counter
        self.uncompressed = make_codec("none")  # `eval_step(compress=False)`

    def codecs(self, compress: bool) -> tuple:
        """(receiving, sending) codec of this stage's forward links; None at the pipeline's ends."""
        ends = self.runner.ends
        forward_in, forward_out = ends.get("forward_in"), ends.get("forward_out")
        return (forward_in and (forward_in.inference if compress else self.uncompressed),
                forward_out and (forward_out.inference if compress else self.uncompressed))

    def run(self, micro: list[MicroBatch], input_ids: torch.Tensor, normaliser, *, compress: bool, labelled: bool,
            keep_logits: bool, step: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward `micro` (the micro-batches of the batch with `input_ids`). Returns the sum of
        the micro-batches' losses on the last stage with `labelled` (zero elsewhere, float32) and,
        with `keep_logits`, the last stage's logits per micro-batch; `step` names the step in an
        error. The caller flushes the transport."""
        runner = self.runner
        receiver, sender = self.codecs(compress)
        runner.post_receives(micro, training=False, codec=receiver)
        if self.tie is not None:
            self.tie.share_rows(input_ids, self.counter)
        total = torch.zeros((), dtype=torch.float32, device=runner.device)
        logits = []
        for i, mb in enumerate(micro):
            with naming_the_step("evaluation", step, runner.mesh.stage):
                out, stats, probs = runner.infer(i, mb, receiver, sender, self.counter)
            if runner.is_last:
                if keep_logits:
                    logits.append(out)
                if labelled:
                    loss = runner.loss(out, mb.labels, normaliser).float()
                    total += loss if stats is None else loss + runner.router.whole_loss(stats, probs)
        return total, logits
