"""Pipeline.generate: the model still split, a KV cache per stage, equal to model.generate."""

import json

import pytest
from distributed import run_workers

FAMILIES = ["gpt2", "opt", "llama", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral"]


@pytest.mark.parametrize("stages", [2, 3])
def test_split_generation_equals_model_generate(tmp_path, stages):
    """Codec none, left-padded prompts of lengths 9, 5 and 2, 8 new tokens: greedy output equals
    `model.generate` on the unsplit model token for token, and sampling with the same seed too
    (only the last stage draws), on every rank."""
    run_workers("generation_worker.py", stages, [str(tmp_path), *FAMILIES], timeout=400)
    for rank in range(stages):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for family in FAMILIES:
            for name in ("greedy", "sampled"):
                assert results[family]["got"][name] == results[family]["expected"][name], (family, name, rank)
