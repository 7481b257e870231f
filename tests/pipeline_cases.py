"""Batches and plans shared by the pipeline tests and their worker processes."""

import torch

from hf_actcomp import Compression, MemoryConfig, Plan, get_adapter
from hf_actcomp.debug import DEBUG_FAMILIES

NUM_SAMPLES = 16

# The pipeline's exactness cases: every family, and Mixtral with its router's load-balancing loss.
EXACT_CASES = {
    **{family: (family, {}) for family in DEBUG_FAMILIES},
    "mixtral-aux": ("mixtral", {"output_router_logits": True, "router_aux_loss_coef": 0.5}),
}


def exact_schedules(case: str) -> tuple[str, ...]:
    """1F1B (the default) and zero-bubble H1 (its own backward split) for every case; GPipe too for
    a tied, an untied and the MoE case (GPipe's order does not depend on the family)."""
    if case in ("gpt2", "llama", "mixtral-aux"):
        return ("gpipe", "1f1b", "zbh1")
    return ("1f1b", "zbh1")



def exact_runs(num_stages: int) -> list[tuple[str, str]]:
    """(case, schedule) pairs the exactness test runs: every case and its schedules on 2 and 3
    stages, and zero-bubble H1 with 4 micro-batches for a tied and an untied case ("zbh1-m4":
    the first stage then splits some backwards, running them whole at `W`); on 4 stages (one
    block each), zero-bubble H1 for a tied, an untied and the MoE case."""
    if num_stages == 4:
        return [(case, "zbh1") for case in ("gpt2", "llama", "mixtral-aux")]
    more_micro_batches = [("gpt2", "zbh1-m4"), ("llama", "zbh1-m4")]
    return [(case, schedule) for case in EXACT_CASES for schedule in exact_schedules(case)] + more_micro_batches


def schedule_of(run: str, num_stages: int) -> tuple[str, int]:
    """(schedule, micro-batches) of an exact run's schedule name: `zbh1-m4` is zbh1 with 4."""
    schedule, _, micro_batches = run.partition("-m")
    return schedule, int(micro_batches) if micro_batches else num_stages

def reference_loss(model, batch: dict, micro_batches: int) -> torch.Tensor:
    """The unsplit model's loss as a pipeline of `micro_batches` computes it: the token mean over
    the whole batch, plus, for MoE with output_router_logits, each micro-batch's load-balancing
    loss (transformers adds it per forward call)."""
    batch = {k: v for k, v in batch.items() if k != "sample_id"}
    if not getattr(model.config, "output_router_logits", False):
        return model(**batch).loss
    num_items = int((batch["labels"][:, 1:] != -100).sum())
    parts = zip(*(torch.tensor_split(batch[k], micro_batches) for k in batch), strict=True)
    return sum(model(**dict(zip(batch, part, strict=True)), num_items_in_batch=num_items).loss for part in parts)


def padded_batch(vocab: int, batch: int = 4, length: int = 12, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, -3:] = 0  # right padding on two rows
    mask[batch - 1, -5:] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=mask, labels=labels, sample_id=torch.arange(batch))


def training_batches(vocab: int, steps: int, batch: int = 4, length: int = 16):
    """`steps` batches over a fixed set of NUM_SAMPLES samples (ids revisit, as AQ-SGD needs)."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (NUM_SAMPLES, length), generator=g)
    for step in range(steps):
        ids = (torch.arange(batch) + step * batch) % NUM_SAMPLES
        input_ids = data[ids]
        yield dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids.clone(),
                   sample_id=ids)


def sgd_losses(model, step, steps: int, lr: float = 0.1) -> list[float]:
    """The losses of `steps` SGD steps (clip norm 1) over `training_batches`, where
    `step(batch)` runs forward and backward and returns the loss and `model` is what is optimised
    and clipped: a `simulate()` module, or a `Pipeline` (its global clip norm)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    clip = getattr(model, "clip_grad_norm_", None) or (lambda norm: torch.nn.utils.clip_grad_norm_(model.parameters(), norm))
    losses = []
    for batch in training_batches(model.config.vocab_size, steps):
        loss = step(batch)
        clip(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def simulated_sgd_losses(sim, steps: int) -> list[float]:
    """`sgd_losses` of a `simulate()` module: what a pipeline's workers compare against. The
    batches go where the model is (as a pipeline moves them to its stage's device)."""
    device = next(sim.parameters()).device

    def step(batch):
        loss = sim(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        return loss

    return sgd_losses(sim, step, steps)


COMPRESSED_PLANS = {
    "aqsgd": lambda schedule: Plan(
        num_stages=2, micro_batches=2, schedule=schedule,
        forward=Compression("aqsgd", bits=4), backward=Compression("quantize", bits=8),
        memory=MemoryConfig(num_samples=NUM_SAMPLES, dtype="fp32"),
        tie_compression=Compression("quantize", bits=6, rounding="stochastic", seed=3)),
    # Deltas on every second revisit (samples revisit from step 4: steps 4-7 send no activations).
    "aqsgd_refresh": lambda schedule: Plan(
        num_stages=2, micro_batches=2, schedule=schedule,
        forward=Compression("aqsgd", bits=4, refresh_every=2), backward=Compression("quantize", bits=8),
        memory=MemoryConfig(num_samples=NUM_SAMPLES, dtype="fp32")),
    # Rank-2 deltas of the drift alone after 4-bit first visits (revisits from step 4).
    "aqsgd_drift": lambda schedule: Plan(
        num_stages=2, micro_batches=2, schedule=schedule,
        forward=Compression("aqsgd", inner="lowrank", rank=2, deltas="drift", first_visit=Compression("quantize", bits=4)),
        backward=Compression("quantize", bits=8), memory=MemoryConfig(num_samples=NUM_SAMPLES, dtype="fp32")),
    "topk_ef": lambda schedule: Plan(
        num_stages=2, micro_batches=2, schedule=schedule,
        forward=Compression("topk", ratio=0.1, feedback="ef"), backward=Compression("quantize", bits=8)),
}


def tie_partners(model) -> dict[str, str]:
    """Both names of every tied parameter, each mapped to the other."""
    pairs = get_adapter(model).tied_weights()
    return {a: b for later, first in pairs for a, b in ((later, first), (first, later))}


def check_stage_grads(got: dict, ref_grads: dict, partners: dict, what: str, seen: set) -> None:
    """Each stage's gradients equal the unsplit model's; a stage without a gradient for a
    parameter is only allowed for the first stage's copy of a tied embedding."""
    for key, grad in got.items():
        if key.startswith("grad."):
            name = key[5:]
            torch.testing.assert_close(grad, ref_grads[name].grad, atol=1e-5, rtol=1e-4,
                                       msg=lambda m, n=f"{what}/{name}": f"{n}: {m}")
            seen.add(name)
            seen.add(partners.get(name, name))
        elif key.startswith("nograd."):
            assert key[7:] in partners, f"{what}: {key[7:]} has no gradient"
