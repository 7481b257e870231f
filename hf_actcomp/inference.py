"""Compressed inference: the plan's forward codec at every stage boundary of an unsplit model.

Forward hooks on the last block of each stage replace that block's output with its encoded and
decoded version, so everything the model does still works, including `generate()` with the KV
cache (each new token's activation is compressed as a pipeline would send it). Removing the
hooks gives the original model back unchanged.

`Plan.tie_compression` plays no part here: it is how a training pipeline keeps the first stage's
copy of a tied embedding in step with the owner's weight, while the unsplit model reads its one
tied weight exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from .boundary import Boundary
from .models import get_adapter
from .models.split import stage_ranges
from .plan import Plan
from .telemetry import summarize


class CompressedInference:
    """An unsplit model whose stage boundaries are compressed; undo with `remove()`.

    Use it like the model (`inf(**batch)`, `inf.generate(...)`) or as a context manager::

        with hf_actcomp.compressed_inference(model, plan) as inf:
            out = inf.generate(input_ids, max_new_tokens=20)
    """

    def __init__(self, model: nn.Module, plan: Plan) -> None:
        self.model = model
        self.plan = plan
        adapter = get_adapter(model)
        self.ranges = stage_ranges(adapter, plan)
        blocks = adapter.blocks()
        # Only the stateless inference codec of each boundary: no training state is touched.
        self.boundaries = {f"boundary{i}.forward": Boundary(f"boundary{i}.forward", plan.forward_at(i), sender=False,
                                                             receiver=False) for i in range(len(self.ranges) - 1)}
        self._handles = []
        for boundary, r in zip(self.boundaries.values(), self.ranges, strict=False):
            self._handles.append(blocks[r.stop - 1].register_forward_hook(self._make_hook(boundary)))

    @staticmethod
    def _make_hook(boundary: Boundary):
        stats = boundary.stats

        # Eager when the block is compiled (simulate/prepare(compile=True) compile the model's own
        # blocks, in place): a block's forward hooks run inside its compiled call otherwise.
        @torch.compiler.disable
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            with stats.timing("encode"):
                payload = boundary.inference_send(hidden)
            with stats.timing("decode"):
                decoded = boundary.inference_receive(payload, hidden.shape, hidden.dtype)
            stats.record(hidden, payload.numel(), decoded)
            # Straight-through so that gradients (if any) still reach earlier stages.
            decoded = hidden + (decoded - hidden).detach()
            return (decoded, *output[1:]) if isinstance(output, tuple) else decoded

        return hook

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def generate(self, *args, **kwargs) -> torch.Tensor:
        """`model.generate` with compressed boundaries (greedy, sampling, KV cache)."""
        return self.model.generate(*args, **kwargs)

    def stats(self) -> dict:
        return summarize({name: b.stats for name, b in self.boundaries.items()})

    def remove(self) -> nn.Module:
        """Remove the hooks and return the original, unchanged model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return self.model

    def __enter__(self) -> CompressedInference:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def compressed_inference(model: nn.Module, plan: Plan | None = None) -> CompressedInference:
    """Apply the plan's forward compression (its inference form) at every stage boundary of `model`.

    Without `plan`, the plan saved with the model (`actcomp_config.json` next to its weights,
    locally or on the Hub) is used. Each boundary sends what `Compression.inference` resolves to
    (by default a codec measured to hold within 1% on a real LLM; hf_actcomp/plan/inference_form.py);
    error feedback is dropped.
    """
    if plan is None:
        source = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
        try:
            plan = Plan.from_pretrained(source) if source else None
        except FileNotFoundError:
            plan = None
        if plan is None:
            raise ValueError(
                f"compressed_inference: no plan was given and none was saved with the model (looked for "
                f"actcomp_config.json in {source or 'nothing: the model was not loaded with from_pretrained'}). "
                "Pass plan=hf_actcomp.Plan(...) or Plan.from_pretrained(dir)."
            )
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a hf_actcomp.Plan, got {type(plan).__name__}.")
    return CompressedInference(model, plan)
