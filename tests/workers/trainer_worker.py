"""Worker of the multi-process ActCompTrainer tests: `python trainer_worker.py SPEC_JSON OUT_DIR`.

SPEC: {"family", "dtype", "plan" (Plan dict), "args" (TrainingArguments overrides), "lora" (bool),
"resume" (checkpoint dir or null), "save" (dir or null), "evaluate" (bool), "samples" (prompts for a
LogSamplesCallback, with a small tokenizer and the model's vocabulary sized to it), "model_path" (a saved
checkpoint given to ActCompTrainer by path instead of the in-memory debug model), "predict" (compute_metrics
and preprocess_logits_for_metrics from trainer_cases; after training, predict() and evaluate()), "subclass"
(trainer_cases.extending_trainer instead of ActCompTrainer), "model_mean" (a model that takes no loss kwargs), "double_loss" (model.loss_function doubled), "plain" (transformers.Trainer on the whole model instead, DDP over
the processes), "push" (Trainer.push_to_hub at the end, with the Hub's two calls recorded per rank), "task"
(debug_model's task: a classifier trains on trainer_cases.classification_rows, an image classifier
on image_rows), "config" (debug_model's config overrides)}. Each rank writes its logged losses
(`losses-rank{r}.json`) and its stage's parameters (`weights-rank{r}.safetensors`).
"""

import concurrent.futures
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import Trainer

import hf_actcomp
from hf_actcomp.debug import debug_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer_cases import (  # noqa: E402
    argmax_logits,
    class_collator,
    classification_rows,
    doubled,
    extending_trainer,
    image_collator,
    image_rows,
    lora_model,
    pad_collator,
    ragged_dataset,
    sample_tokenizer,
    token_metrics,
    training_args,
)


def record_uploads(out_dir: str) -> list:
    """Stand in for the Hub (as tests/test_hub.py's RecordingApi): each rank's create_repo and
    upload_folder calls, and the card and files of each upload, land in `uploads-rank{r}.json`."""
    from huggingface_hub import HfApi
    from huggingface_hub import constants as hub_constants

    hub_constants.HF_HUB_OFFLINE = False  # nothing leaves the machine: both calls are replaced
    calls = []
    path = os.path.join(out_dir, f"uploads-rank{os.environ['RANK']}.json")

    def write():
        with open(path, "w") as f:
            json.dump(calls, f)

    def create_repo(api, repo_id, **kwargs):
        calls.append({"call": "create_repo", "repo_id": repo_id})
        write()
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(api, **kwargs):
        folder = kwargs["folder_path"]
        card = os.path.join(folder, "README.md")
        calls.append({"call": "upload_folder", "repo_id": kwargs["repo_id"], "files": sorted(os.listdir(folder)),
                      "card": open(card).read() if os.path.isfile(card) else None})
        write()
        if kwargs.get("run_as_future"):  # Trainer's pushes at each checkpoint
            future = concurrent.futures.Future()
            future.set_result("commit")
            return future
        return "commit"

    HfApi.create_repo, HfApi.upload_folder = create_repo, upload_folder
    write()
    return calls


def main(spec: dict, out_dir: str) -> None:
    if spec.get("push"):
        record_uploads(out_dir)
    tokenizer = sample_tokenizer() if spec.get("samples") else None
    overrides = {"vocab_size": len(tokenizer)} if tokenizer is not None else {}
    overrides.update(spec.get("config", {}))  # debug_model's config overrides
    task = spec.get("task", "causal_lm")  # a classifier trains on classification_rows
    model = spec.get("model_path") or debug_model(spec.get("family", "gpt2"), seed=0, task=task, **overrides).to(
        getattr(torch, spec.get("dtype", "float32")))
    if task == "causal_lm":
        train, evaluation, collator = ragged_dataset(), ragged_dataset(8, seed=1), pad_collator
    elif task == "image_classification":
        train, evaluation, collator = image_rows(), image_rows(8, seed=1), image_collator
    else:
        train, evaluation, collator = classification_rows(), classification_rows(8), class_collator
    if spec.get("model_mean"):  # Trainer then passes no num_items_in_batch: the model takes each batch's mean
        model.accepts_loss_kwargs = False
    if spec.get("double_loss"):  # a loss of the user's own, set on the model (what replaces compute_loss)
        model.loss_function = doubled(model.loss_function)
    if spec.get("lora"):
        model = lora_model(model)
    plan = hf_actcomp.Plan.from_dict(spec.get("plan", {"num_stages": 2}))
    args = training_args(os.path.join(out_dir, "run"), **spec.get("args", {}))
    metrics_kwargs = {"compute_metrics": token_metrics, "preprocess_logits_for_metrics": argmax_logits} \
        if spec.get("predict") else {}
    if spec.get("plain"):  # transformers.Trainer on the whole model, DDP over the processes: a reference
        trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation, data_collator=collator)
    else:
        trainer_class = extending_trainer() if spec.get("subclass") else hf_actcomp.ActCompTrainer
        trainer = trainer_class(model=model, args=args, plan=plan, train_dataset=train, eval_dataset=evaluation,
                                data_collator=collator, processing_class=tokenizer, **metrics_kwargs)
    if spec.get("samples"):
        sampler = hf_actcomp.LogSamplesCallback(trainer, spec["samples"], max_new_tokens=6)
        trainer.add_callback(sampler)
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    rank = trainer.args.process_index
    metrics = trainer.evaluate() if spec.get("evaluate") else {}
    predicted = None
    if spec.get("predict"):  # predict() with the metrics, then the bytes the predictions took
        output = trainer.predict(ragged_dataset(8, seed=1))
        save_file({"predictions": torch.from_numpy(output.predictions), "label_ids": torch.from_numpy(output.label_ids)},
                  os.path.join(out_dir, f"predict-rank{trainer.args.process_index}.safetensors"))
        predicted = {"metrics": output.metrics,
                     "bytes": trainer.pipe.stats(gather=True)["categories"]["predictions"]["bytes_sent"],
                     "evaluate": trainer.evaluate()}
    if spec.get("save"):
        trainer.save_model(spec["save"])
    if spec.get("push"):  # collective: every rank saves its stage, rank 0 uploads
        trainer.push_to_hub(commit_message="End of training", language="en", tags="pushed")
    logs = [h for h in trainer.state.log_history if "loss" in h]
    with open(os.path.join(out_dir, f"losses-rank{rank}.json"), "w") as f:
        json.dump({"losses": [h["loss"] for h in logs], "logs": logs, "metrics": metrics,
                   "total_flos": trainer.state.total_flos, "tokens_seen": trainer.state.num_input_tokens_seen,
                   "seen_logs": getattr(trainer, "seen_logs", None),
                   "meta_parameters": sum(p.device.type == "meta" for p in trainer.model.parameters()),
                   "memory": None if spec.get("plain") else _memory_report(trainer.pipe),
                   "samples": sampler.samples if spec.get("samples") else None, "predict": predicted}, f)
    stage = trainer.model if spec.get("plain") else trainer.pipe.stage
    weights = {n: p.detach().contiguous() for n, p in stage.named_parameters()}
    save_file(weights, os.path.join(out_dir, f"weights-rank{rank}.safetensors"))


def _memory_report(pipe) -> dict | None:
    """AQ-SGD: the sample ids this rank keeps memory for, its rows, and how many were visited."""
    boundary = pipe.forward_out or pipe.forward_in
    if boundary is None:  # one stage: no boundary
        return None
    end = boundary.receiver if boundary.receiver is not None else boundary.sender.mirror
    if not hasattr(end, "memory"):
        return None
    return {"sample_range": list(pipe.sample_range or []), "rows": end.memory.num_samples,
            "seen": int(end.memory.seen.sum())}


def run_all(spec: dict, out_dir: str) -> None:
    """One spec, or {"runs": {name: spec}} run one after another in these processes (a launch
    costs seconds of start-up per process), each into OUT_DIR/name."""
    from accelerate.state import AcceleratorState

    for name, run in spec["runs"].items() if "runs" in spec else [(None, spec)]:
        out = os.path.join(out_dir, name) if name else out_dir
        os.makedirs(out, exist_ok=True)
        AcceleratorState._reset_state()  # each run's TrainingArguments choose their own mixed precision
        main(run, out)
    # As `trainer.end()` ends a script: a gloo group left to interpreter shutdown can abort the
    # process after all its work (exit -6, "terminate called without an active exception").
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    run_all(json.loads(sys.argv[1]), sys.argv[2])
