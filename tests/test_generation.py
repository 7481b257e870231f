"""Pipeline.generate: the model still split, a KV cache per stage, equal to model.generate."""

import json

import pytest
import torch
from distributed import WORKERS, run_workers

from hf_actcomp.debug import debug_model
from hf_actcomp.generation import generation_pieces

# mixtral-aux: with output_router_logits, whose side channel on the links carries zeros here
FAMILIES = ["gpt2", "opt", "llama", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "mixtral-aux"]


@pytest.mark.parametrize("stages", [2, 3])
def test_split_generation_equals_model_generate(tmp_path, stages):
    """Left-padded prompts of lengths 9, 5 and 2, 8 new tokens. Codec none: greedy output equals
    `model.generate` on the unsplit model token for token, and sampling with the same seed too
    (only the last stage draws), on every rank. int8 boundaries: greedy equals in-process
    `compressed_inference` token for token. The bytes are exact: a stage sends the prompt's
    hidden states once, then one token's per row (fp32), and the last stage sends the chosen
    ids and unfinished flags (int64) to every other stage at each of the 8 steps (with the MoE
    router's side channel: its fixed size with every message); with a tied embedding, the last
    stage also sends the rows of the prompt's distinct tokens, then with each step's ids to the
    first stage the rows of the chosen tokens. The raw logits
    of every greedy step equal `model.generate`'s (`output_logits`) to 1e-5."""
    run_workers("generation_worker.py", stages, [str(tmp_path), *FAMILIES], timeout=400)
    batch, prompt, new = 3, 9, 8
    for rank in range(stages):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results["mixtral-aux"]["router"]
        if rank < stages - 1:
            assert results["mixtral-aux"]["side_bytes"] > 0  # the router's side channel is on the link
        for family in FAMILIES:
            result = results[family]
            for name in ("greedy", "sampled", "int8"):
                assert result["got"][name] == result["expected"][name], (family, name, rank)
            if rank == stages - 1:  # the raw logits of every greedy step, not only their argmax
                logits = result["logits"]
                assert logits["steps"] == new and logits["max_diff"] <= 1e-5 * max(1.0, logits["scale"]), family
            hidden = result["hidden_size"]
            expected_bytes = 0
            for name in ("greedy", "sampled"):
                if rank < stages - 1:  # the prompt's hidden states, then one token's per row
                    expected_bytes += batch * hidden * 4 * (prompt + new - 1) + result["side_bytes"] * new
                    continue
                expected_bytes += 2 * batch * 8 * new * (stages - 1)  # ids and unfinished flags (int64)
                if result["tied"]:  # the tie's rows of the prompt's distinct tokens, then with each step's
                    ids = torch.tensor(result["got"][name])  # ids, the rows of the chosen tokens
                    expected_bytes += torch.unique(ids[:, :prompt]).numel() * hidden * 4 + new * batch * hidden * 4
            assert result["inference_bytes"] == expected_bytes, (family, rank)


def test_generation_after_per_stage_loading(tmp_path):
    """`prepare("path", plan)`: no rank holds the whole model, and greedy output still equals
    `model.generate` on the unsplit model."""
    import sys

    import torch

    from hf_actcomp.debug import debug_model

    sys.path.insert(0, str(WORKERS))
    from generation_worker import left_padded_prompts

    model = debug_model("llama", seed=0).eval()
    model.save_pretrained(tmp_path / "checkpoint")
    ids, mask = left_padded_prompts(model)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False).tolist()
    run_workers("generation_worker.py", 2, [str(tmp_path), f"loaded:{tmp_path / 'checkpoint'}"], timeout=200)
    for rank in range(2):
        loaded = json.loads((tmp_path / f"rank{rank}.json").read_text())["loaded"]
        assert loaded["got"] == expected, rank
        assert loaded["held"] < sum(p.numel() for p in model.parameters())  # no rank holds the whole model


def test_hung_peer_during_generation_raises_peer_timeout(tmp_path):
    """The last stage never answers: the first stage's wait for the next token ids fails with
    `PeerTimeoutError` after the pipeline's timeout (2 s), naming the peer."""
    run_workers("generation_worker.py", 2, [str(tmp_path), "hung"], timeout=120)
    report = json.loads((tmp_path / "hung.json").read_text())
    assert report["error"] is not None, "generate returned although its peer never answered"
    assert "Rank 0 failed receiving the next token ids of generation step 0" in report["error"]
    assert "with rank 1 (timeout 2s)" in report["error"]
    assert 1.5 < report["seconds"] < 20


@pytest.mark.parametrize("lengths,warned", [({"max_new_tokens": 3}, False),
                                            ({"max_new_tokens": 3, "max_length": 50}, True)])
def test_generation_pieces_warn_about_lengths_only_where_generate_does(caplog, lengths, warned):
    """`max_new_tokens` alone is not "both set" (it was, on every split generate call)."""
    model = debug_model("gpt2", seed=0)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 5))
    mask = torch.ones_like(input_ids)

    def warnings() -> list[str]:
        found = [r.getMessage() for r in caplog.records if "seem to have been set" in r.getMessage()]
        caplog.clear()
        return found

    caplog.clear()
    model.generate(input_ids, attention_mask=mask, do_sample=False, **lengths)
    theirs = warnings()
    generation_pieces(model, input_ids, mask, do_sample=False, **lengths)
    assert warnings() == theirs and bool(theirs) == warned
