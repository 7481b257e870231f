"""Batches and plans shared by the pipeline tests and their worker processes."""

import torch

from hf_actcomp import Compression, MemoryConfig, Plan

NUM_SAMPLES = 16


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


COMPRESSED_PLANS = {
    "aqsgd": lambda schedule: Plan(
        num_stages=2, micro_batches=2, schedule=schedule,
        forward=Compression("aqsgd", bits=4), backward=Compression("quantize", bits=8),
        memory=MemoryConfig(num_samples=NUM_SAMPLES, dtype="fp32")),
    "topk_ef": lambda schedule: Plan(
        num_stages=2, micro_batches=2, schedule=schedule,
        forward=Compression("topk", ratio=0.1, feedback="ef"), backward=Compression("quantize", bits=8)),
}
