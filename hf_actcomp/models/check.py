"""Check an adapter: chained stages must give the unsplit model's logits, loss and gradients.

This is the test every built-in family passes (tests/test_models.py), offered to users trying
an unverified family with `register_standard_decoder` or their own adapter.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .base import StageModule
from .registry import get_adapter


def even_ranges(num_blocks: int, num_stages: int) -> list[tuple[int, int]]:
    """`num_stages` contiguous block ranges of near-equal length covering `num_blocks` blocks."""
    if not 1 <= num_stages <= num_blocks:
        raise ValueError(f"num_stages must be in [1, {num_blocks}], got {num_stages}.")
    bounds = [round(i * num_blocks / num_stages) for i in range(num_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def padded_batch(vocab_size: int, padding: str, batch: int = 3, length: int = 10) -> dict:
    """A seeded batch whose rows 1 and 2 are padded on `padding`'s side ("right", "left", "none")."""
    if padding not in ("right", "left", "none"):
        raise ValueError(f"padding must be 'right', 'left' or 'none', got {padding!r}.")
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if padding == "right":
        mask[1, 7:] = 0
        mask[2, 4:] = 0
    elif padding == "left":
        mask[1, :3] = 0
        mask[2, :6] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    return dict(
        input_ids=input_ids, attention_mask=None if padding == "none" else mask, labels=labels
    )


def check_adapter(
    model: nn.Module,
    *,
    stage_ranges: list[tuple[int, int]] | None = None,
    batch: dict | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> None:
    """Raise AssertionError unless stages of `model` reproduce the unsplit model exactly.

    Runs `batch` (default: a seeded left-padded batch, for a causal LM; an image classifier's holds
    `pixel_values` and `labels`) through the stages `stage_ranges`
    (default: 3 near-equal stages, fewer for shallower models) and through an unsplit deep
    copy, then compares logits, loss and every parameter's gradient (tolerances `atol`,
    `rtol`; exact by default, as the stages run the model's own operations in its order).
    Leaves the stages' gradients in `model`'s parameters.
    """
    adapter = get_adapter(model)
    ranges = stage_ranges or even_ranges(adapter.num_blocks, min(3, adapter.num_blocks))
    if batch is None:
        batch = padded_batch(model.config.vocab_size, "left")
    model.zero_grad(set_to_none=True)
    reference = copy.deepcopy(model)
    stages: list[StageModule] = [
        adapter.build_stage(start, stop, first=i == 0, last=i == len(ranges) - 1)
        for i, (start, stop) in enumerate(ranges)
    ]
    rng = torch.get_rng_state()  # dropout draws the same numbers in both runs
    images = "input_ids" not in batch  # an image classifier's batch: pixel_values, no mask
    hidden = main = batch["pixel_values"] if images else batch["input_ids"]
    for stage in stages:
        hidden = stage(hidden, batch.get("attention_mask"), main, batch.get("token_type_ids"))
    torch.set_rng_state(rng)
    ref = reference(**batch) if images else reference(**batch, use_cache=False)
    tol = dict(atol=atol, rtol=rtol)
    torch.testing.assert_close(hidden, ref.logits, **tol, msg=lambda m: f"logits: {m}")
    loss = adapter.loss(hidden, batch["labels"])
    torch.testing.assert_close(loss, ref.loss, **tol, msg=lambda m: f"loss: {m}")
    loss.backward()
    ref.loss.backward()
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            continue
        expected = ref_params[name].grad
        if param.grad is None or expected is None:
            assert param.grad is None and expected is None, f"{name}: gradient missing on one side"
            continue
        torch.testing.assert_close(
            param.grad, expected, **tol, msg=lambda m, n=name: f"gradient of {n}: {m}"
        )
