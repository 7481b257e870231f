"""Pipeline.generate: the model still split, a KV cache per stage, equal to model.generate."""

import json

import pytest
import torch
from distributed import WORKERS, free_port, run_workers
from transformers import GenerationConfig

from hf_actcomp.debug import debug_model
from hf_actcomp.split_generation import (
    check_generation_mode,
    check_split_generation,
    generation_pieces,
)

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
    """`prepare("path", plan)`: each rank holds exactly its stage's parameters (its blocks, the
    embedding on the first stage, the final norm and head on the last), and greedy output still
    equals `model.generate` on the unsplit model."""
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
    loaded = [json.loads((tmp_path / f"rank{rank}.json").read_text())["loaded"] for rank in range(2)]
    layers = model.config.num_hidden_layers
    assert loaded[0]["blocks"][0] == 0 and loaded[0]["blocks"][1] == loaded[1]["blocks"][0] and \
        loaded[1]["blocks"][1] == layers and 0 < loaded[0]["blocks"][1] < layers  # both stages hold blocks
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    for rank, result in enumerate(loaded):
        assert result["got"] == expected, rank
        # Exactly its stage's share: its blocks, with the embedding on the first stage and the
        # final norm and the (untied) head on the last; nothing of the other stage.
        start, stop = result["blocks"]
        own = {f"model.layers.{i}." for i in range(start, stop)}
        own |= {"model.embed_tokens."} if rank == 0 else {"model.norm.", "lm_head."}
        share = {name: n for name, n in sizes.items() if name.startswith(tuple(own))}
        assert result["held"] == share, rank
    assert sum(sum(r["held"].values()) for r in loaded) == sum(sizes.values())  # between them, the whole model once


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


SUPPORTED = "It supports greedy decoding (do_sample=False) and multinomial sampling (do_sample=True), one sequence per prompt"


@pytest.mark.parametrize("config,named", [
    (GenerationConfig(num_beams=4), "num_beams=4 (beam search; set num_beams=1)"),
    (GenerationConfig(do_sample=True, num_return_sequences=2),
     "num_return_sequences=2 (several sequences per prompt; set num_return_sequences=1)"),
    (GenerationConfig(num_beams=4, num_beam_groups=2, diversity_penalty=0.5),
     "num_beams=4 (beam search; set num_beams=1), num_beam_groups=2 (group beam search"),
    (GenerationConfig(penalty_alpha=0.6, top_k=4), "penalty_alpha=0.6 (contrastive search"),
    (GenerationConfig(force_words_ids=[[5]]), "force_words_ids=[[5]] (constrained beam search"),
    (GenerationConfig(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens=3 (assisted generation"),
    (GenerationConfig(dola_layers="low"), "dola_layers='low' (DoLa decoding"),
    (GenerationConfig(guidance_scale=1.5), "guidance_scale=1.5 (classifier-free guidance"),
    (GenerationConfig(stop_strings=["\n"]), "stop_strings=['\\n'] (stop strings"),
    (GenerationConfig(return_dict_in_generate=True), "return_dict_in_generate=True (a GenerateOutput"),
])
def test_split_generation_refuses_other_modes_naming_the_setting(config, named):
    """Only greedy decoding and multinomial sampling run split: every other mode of `generate` is
    refused, naming the setting, its value and the value that turns it off, and listing what is
    supported (the check is a pure function of the resolved settings)."""
    with pytest.raises(ValueError) as err:
        check_generation_mode(config)
    message = str(err.value)
    assert message.startswith(f"Pipeline.generate (the model split over processes) does not support {named}")
    assert SUPPORTED in message and "temperature, top_k, top_p" in message and "repetition_penalty" in message
    assert "max_new_tokens / max_length, eos_token_id or max_time" in message


def test_split_generation_accepts_greedy_and_sampling_with_their_processors():
    check_generation_mode(GenerationConfig(do_sample=False, max_new_tokens=4, repetition_penalty=1.3,
                                           no_repeat_ngram_size=2, eos_token_id=3, pad_token_id=0))
    check_generation_mode(GenerationConfig(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, min_p=0.05))
    check_generation_mode(GenerationConfig(num_beams=1, num_return_sequences=1, penalty_alpha=0.6,
                                           do_sample=True, top_k=4))  # generate samples here: no contrastive
    check_generation_mode(GenerationConfig(), {"streamer": None, "synced_gpus": False})  # not given


def test_split_generation_refuses_generate_arguments_and_model_inputs():
    """`generate`'s arguments that are no setting (assisted generation's `assistant_model`, a
    streamer, custom processors, ...) and model inputs the stages do not take."""
    model = debug_model("gpt2", seed=0)
    with pytest.raises(ValueError, match=r"does not support assistant_model=<GPT2LMHeadModel> \(assisted "
                                         r"generation\), logits_processor=\[\] \(custom logits processors\)"):
        check_split_generation(model, max_new_tokens=3, assistant_model=model, logits_processor=[])
    with pytest.raises(ValueError, match=r"does not support position_ids=.* \(no setting of GenerationConfig: a "
                                         r"model input, which the split stages do not take\)"):
        check_split_generation(model, max_new_tokens=3, position_ids=torch.zeros(1, 3, dtype=torch.long))


def test_split_generation_reads_the_models_generation_config():
    """The settings are resolved as `generate` resolves them: `model.generation_config`, then a
    `generation_config` given, then the keywords."""
    model = debug_model("gpt2", seed=0)
    model.generation_config.num_beams = 4
    with pytest.raises(ValueError, match=r"does not support num_beams=4 \(beam search; set num_beams=1\)"):
        check_split_generation(model, max_new_tokens=3, do_sample=False)
    assert check_split_generation(model, max_new_tokens=3, num_beams=1).num_beams == 1  # the keyword overrides it
    assert check_split_generation(model, GenerationConfig(num_beams=1, max_new_tokens=3)).num_beams == 1
    model.generation_config.num_beams = 1
    with pytest.raises(ValueError, match=r"does not support num_return_sequences=2"):
        check_split_generation(model, GenerationConfig(do_sample=True, num_return_sequences=2))


def test_pipeline_generate_refuses_beam_search_before_any_work(monkeypatch):
    """The real call path, in a one-process job with one stage: `num_beams=4` from the keywords
    or from `model.generation_config` raises before anything is built or sent (the cached stage
    and the generation pieces are never reached); without it, greedy output equals `model.generate`."""
    import torch.distributed as dist

    import hf_actcomp
    from hf_actcomp import Plan
    from hf_actcomp.pipeline import split_generator as generate

    model = debug_model("llama", seed=0).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False).tolist()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        pipe = hf_actcomp.prepare(model, Plan(num_stages=1))
        with monkeypatch.context() as patch:
            for name in ("CachedStage", "generation_pieces"):
                patch.setattr(generate, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} was reached"))
            with pytest.raises(ValueError, match=r"^Pipeline.generate \(the model split over processes\) does not "
                                                 r"support num_beams=4 \(beam search; set num_beams=1\)\."):
                pipe.generate(ids, max_new_tokens=4, num_beams=4)
            model.generation_config.num_beams = 4
            with pytest.raises(ValueError, match=r"support num_beams=4 \(beam search"):
                pipe.generate(ids, max_new_tokens=4)
            model.generation_config.num_beams = 1
            with pytest.raises(ValueError, match=r"support num_return_sequences=2 \(several sequences"):
                pipe.generate(ids, max_new_tokens=4, do_sample=True, num_return_sequences=2)
        assert pipe.generate(ids, max_new_tokens=4, do_sample=False).tolist() == expected
    finally:
        dist.destroy_process_group()


def test_sample_callback_refuses_beam_search_when_constructed(tmp_path):
    """`LogSamplesCallback(num_beams=4)`: refused before training, in one process too, so that a
    run samples alike on 1 and N processes (Pipeline.generate runs no beam search)."""
    from trainer_cases import SAMPLE_PROMPTS, ragged_dataset, sample_tokenizer, training_args

    from hf_actcomp import ActCompTrainer, LogSamplesCallback, Plan

    tokenizer = sample_tokenizer()
    model = debug_model("gpt2", seed=0, vocab_size=len(tokenizer))
    trainer = ActCompTrainer(model=model, args=training_args(str(tmp_path)), plan=Plan(num_stages=2),
                             train_dataset=ragged_dataset(), processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"^LogSamplesCallback samples with what Pipeline.generate runs, in one "
                                         r"process too .*does not support num_beams=4 \(beam search"):
        LogSamplesCallback(trainer, SAMPLE_PROMPTS, num_beams=4)
    model.generation_config.update(do_sample=True, num_return_sequences=2)  # from the model's own settings
    with pytest.raises(ValueError, match=r"does not support num_return_sequences=2"):
        LogSamplesCallback(trainer, SAMPLE_PROMPTS, do_sample=True)
    model.generation_config.num_return_sequences = 1
    LogSamplesCallback(trainer, SAMPLE_PROMPTS, do_sample=True, top_k=5)  # sampling is fine


def test_an_adapter_without_a_cached_forward_is_refused_before_any_work():
    """The cached-forward methods are optional (a training-only adapter still trains): every
    shipped family has them, and split generation refuses an adapter that lacks them, naming them."""
    from hf_actcomp import get_adapter
    from hf_actcomp.split_generation import CachedStage

    model = debug_model("gpt2", seed=0)
    adapter = get_adapter(model)
    assert type(adapter).has_cached_forward()
    bare = type("TrainingOnly", (type(adapter),), {"embed_cached": None})  # a family without it
    assert not bare.has_cached_forward()
    with pytest.raises(TypeError, match="cached forward .*embed_cached.*which TrainingOnly does not implement"):
        CachedStage(model, bare(model), 0, 1, first=True, last=False)
