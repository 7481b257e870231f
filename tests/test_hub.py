"""Model cards, run results, curves and pushing to the Hub (no network: HfApi calls are recorded)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from trainer_cases import lora_model, pad_collator, ragged_dataset, training_args

import hf_actcomp
from hf_actcomp import ActCompTrainer, Compression, Plan, hub
from hf_actcomp.debug import debug_model
from hf_actcomp.hub.card import _is_repo_id

AQSGD = Plan(num_stages=2, forward=Compression("aqsgd", bits=4), backward=Compression("quantize", bits=8))


def _train_and_save(out, model=None, plan=AQSGD, **args):
    trainer = ActCompTrainer(model=model or debug_model("gpt2"), plan=plan,
                             args=training_args(str(out), max_steps=8, eval_strategy="steps", eval_steps=4, **args),
                             train_dataset=ragged_dataset(), eval_dataset=ragged_dataset(8, seed=1),
                             data_collator=pad_collator)
    trainer.train()
    trainer.evaluate()
    trainer.save_model(str(out))
    return trainer


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    trainer = _train_and_save(out)
    return out, trainer


def test_card_metadata_and_body(saved_run):
    out, trainer = saved_run
    assert {"README.md", "actcomp_results.json", "training_curves.png", "actcomp_config.json",
            "model.safetensors"} <= set(os.listdir(out))
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = ModelCard.load(out / "README.md")
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert {"hf-actcomp", "pipeline-parallel", "aq-sgd", "quantization"} <= set(data.tags)
    metrics = trainer.state.log_history[-1]
    values = {(r.metric_type, r.metric_name): r.metric_value for r in data.eval_results}
    assert values[("loss", "loss (codec at inference)")] == round(metrics["eval_loss"], 4)
    assert values[("loss", "loss (no compression)")] == round(metrics["eval_plain_loss"], 4)
    assert values[("perplexity", "perplexity (no compression)")] == round(metrics["eval_plain_perplexity"], 4)
    results = json.loads((out / "actcomp_results.json").read_text())
    forward = results["stats"]["channels"]["boundary0.forward"]
    text = card.text
    assert f"| boundary0.forward | {forward['bytes_sent']:,} | {forward['bytes_uncompressed']:,} |" in text
    assert "| forward (activations) | `aqsgd-quantize4` |" in text
    assert "| AQ-SGD memory | 32 samples, fp16, on host |" in text
    assert "hf_actcomp.compressed_inference(model)" in text and "AutoModelForCausalLM.from_pretrained" in text
    # AQ-SGD has no memory at inference: the card names what the boundary sends there.
    assert "through the plan's inference form, `hadamard_outliers6` at each boundary" in text
    assert "![Training curves](training_curves.png)" in text
    assert "wang2022aqsgd" in text and "rudakov2024activations" in text and "dgc" not in text
    assert f"transformers {__import__('transformers').__version__}" in text


def test_checkpoints_carry_a_card(tmp_path):
    _train_and_save(tmp_path, plan=Plan(num_stages=2), save_strategy="steps", save_steps=4)
    card = ModelCard.load(tmp_path / "checkpoint-4" / "README.md")
    assert "hf-actcomp" in card.data.tags and "aq-sgd" not in card.data.tags
    assert "compressed_inference" not in card.text  # identity codec: nothing to apply at inference


def test_adapter_card(tmp_path):
    _train_and_save(tmp_path, model=lora_model(debug_model("gpt2")), plan=Plan(num_stages=2))
    card = hub.model_card(tmp_path, base_model="openai-community/gpt2", datasets="wikitext")
    assert card.data.library_name == "peft" and card.data.base_model == "openai-community/gpt2"
    assert card.data.datasets == ["wikitext"] and {"peft", "lora"} <= set(card.data.tags)
    assert "AutoPeftModelForCausalLM" in card.text and "- peft " in card.text
    assert card.data.eval_results[0].dataset_name == "wikitext"


def test_base_model_only_when_it_names_a_hub_model(tmp_path):
    assert _is_repo_id("gpt2") and _is_repo_id("meta-llama/Llama-3.2-1B")
    assert not _is_repo_id("") and not _is_repo_id(str(tmp_path)) and not _is_repo_id("a/b/c")


def test_card_of_a_compressed_warm_up(tmp_path):
    plan = Plan(num_stages=2, forward=Compression("aqsgd", bits=2, first_visit=Compression("hadamard", bits=4)),
                backward=Compression("quantize", bits=4))
    plan.save_pretrained(tmp_path)  # the card reads the plan back (from_pretrained)
    card = hub.model_card(tmp_path)
    assert {"aq-sgd", "quantization", "hadamard"} <= set(card.data.tags)
    assert "| forward (activations) | `aqsgd-quantize2 (warm-up hadamard4)` |" in card.text


def test_card_of_diloco(tmp_path):
    plan = Plan(num_stages=2, data_parallel=2, dp_compression={
        "method": "diloco", "sync_every": 32, "stagger": True, "compression": {"method": "hadamard", "bits": 4}})
    plan.save_pretrained(tmp_path)
    card = hub.model_card(tmp_path)
    assert {"diloco", "data-parallel"} <= set(card.data.tags)
    assert ("| data parallel | 2 replicas, DiLoCo: an outer step every 32 optimizer steps (outer SGD lr 0.7, Nesterov "
            "momentum 0.9), pseudo-gradients as `hadamard4` with error feedback; stages staggered |") in card.text
    assert "douillard2023diloco" in card.text


class RecordingApi:
    """Stands in for the Hub: records create_repo / upload_folder calls."""

    def __init__(self, monkeypatch):
        self.calls = []
        recorder = self

        def create_repo(api, repo_id, **kwargs):
            recorder.calls.append(("create_repo", repo_id, kwargs))
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def upload_folder(api, **kwargs):
            recorder.calls.append(("upload_folder", kwargs["repo_id"], kwargs))
            recorder.uploaded_card = open(os.path.join(kwargs["folder_path"], "README.md")).read()
            return "commit"

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)


def test_push_folder(saved_run, monkeypatch):
    out, _ = saved_run
    api = RecordingApi(monkeypatch)
    assert hub.push_to_hub(out, "user/tiny", private=True, token="hf_x", commit_message="msg") == "commit"
    (kind, repo, kwargs), (kind2, repo2, kwargs2) = api.calls
    assert (kind, repo, kwargs["private"], kwargs["exist_ok"], kwargs["token"]) == ("create_repo", "user/tiny", True,
                                                                                    True, "hf_x")
    assert (kind2, repo2, kwargs2["folder_path"], kwargs2["commit_message"]) == ("upload_folder", "user/tiny",
                                                                                  str(out), "msg")
    assert 'from_pretrained("user/tiny")' in api.uploaded_card  # re-rendered with the repo id


def test_push_offline_fails_clearly(saved_run, monkeypatch):
    out, _ = saved_run
    monkeypatch.setattr(hub.hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE is set"):
        hub.push_to_hub(out, "user/tiny")


def test_trainer_push_to_hub_uploads_our_card(tmp_path, monkeypatch):
    api = RecordingApi(monkeypatch)
    trainer = _train_and_save(tmp_path, push_to_hub=True, hub_model_id="user/trained", hub_private_repo=True)
    assert api.calls[0][:2] == ("create_repo", "user/trained") and api.calls[0][2]["private"] is True
    trainer.push_to_hub(commit_message="End of training", language="en", license="apache-2.0", tags="mine",
                        tasks="text-generation", dataset_args="default", dataset="user/data")
    assert api.calls[-1][0] == "upload_folder" and api.calls[-1][2]["commit_message"] == "End of training"
    assert "hf-actcomp" in api.uploaded_card and 'from_pretrained("user/trained")' in api.uploaded_card
    card = ModelCard(api.uploaded_card)
    assert (card.data.language, card.data.license, card.data.model_name) == ("en", "apache-2.0", "trained")
    assert {"mine", "hf-actcomp"} <= set(card.data.tags) and card.data.datasets == ["user/data"]
    assert card.data.eval_results[0].dataset_args == "default"
    # Kept with the run: re-rendering the folder (as `hf-actcomp card DIR` does) keeps them.
    assert hub.model_card(tmp_path).data.license == "apache-2.0"


def test_plan_saved_with_model_drives_compressed_inference(saved_run):
    out, _ = saved_run
    model = type(debug_model("gpt2")).from_pretrained(out)
    batch = pad_collator([ragged_dataset()[i] for i in range(4)])
    with hf_actcomp.compressed_inference(model) as inf:  # no plan: the one saved with the model
        assert inf.plan == Plan.from_pretrained(out)
        with torch.no_grad():
            inf(**batch)
        assert inf.stats()["channels"]["boundary0.forward"]["messages"] == 1
    with pytest.raises(ValueError, match="no plan was given and none was saved"):
        hf_actcomp.compressed_inference(debug_model("gpt2"))


def test_trainer_refuses_push_when_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(hub.hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="push_to_hub=True\\) but HF_HUB_OFFLINE is set"):
        ActCompTrainer(model=debug_model("gpt2"), plan=Plan(num_stages=2),
                       args=training_args(str(tmp_path), push_to_hub=True, hub_model_id="user/x"),
                       train_dataset=ragged_dataset(), data_collator=pad_collator)


def test_pipeline_push_to_hub(tmp_path, monkeypatch):
    """`Pipeline.push_to_hub` saves (weights, plan, results, card) and uploads from rank 0; here a
    one-process job with one stage."""
    import torch.distributed as dist
    from distributed import free_port

    api = RecordingApi(monkeypatch)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = debug_model("gpt2")
        pipe = hf_actcomp.prepare(model, Plan(num_stages=1, forward=Compression("quantize", bits=8)))
        pipe.push_to_hub("user/piped", model=model, save_directory=str(tmp_path), private=False)
        pipe.push_to_hub("user/piped")  # a temporary folder, removed after the upload
    finally:
        dist.destroy_process_group()
    assert [c[0] for c in api.calls] == ["create_repo", "upload_folder"] * 2
    temporary = api.calls[-1][2]["folder_path"]
    assert temporary != str(tmp_path) and not os.path.exists(temporary)
    assert {"model-00001-of-00001.safetensors", "model.safetensors.index.json", "actcomp_config.json",
            "actcomp_results.json", "README.md"} <= set(os.listdir(tmp_path))
    assert 'from_pretrained("user/piped")' in api.uploaded_card
