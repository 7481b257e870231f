"""Fine-tune a causal LM with compressed stage boundaries, launched by `accelerate launch`.

Default (no network): a small GPT-2 config trained on the Python reference documentation that
ships with CPython, with a tokenizer built locally, under AQ-SGD fw4/bw8, two pipeline stages in
two processes (`hf_actcomp.prepare`):

    accelerate launch --config_file recipes/configs/cpu_2stage.yaml recipes/finetune_gpt2.py

With one process (`cpu_single.yaml`) the same plan runs in-process (`hf_actcomp.simulate`).
Real use: `--model gpt2 --dataset wikitext --dataset_config wikitext-2-raw-v1 --plan my_plan.yaml`,
or override the plan from flags: `--forward aqsgd,bits=2 --backward quantize,bits=4 --schedule gpipe`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, default_data_collator

import hf_actcomp
from hf_actcomp.data import build_tokenizer, causal_lm_datasets, offline_corpus
from hf_actcomp.samples import complete
from hf_actcomp.state.resume import (
    checkpoint_dir,
    init_distributed,
    maybe_pause_for_fault_test,
    resolve_resume_from_checkpoint,
    writing_checkpoint,
)
from hf_actcomp.state.training_state import load_training_state, save_training_state

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PLAN = os.path.join(HERE, "configs", "plan_aqsgd_fw4_bw8.yaml")


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser(__doc__).parse_args(argv)


def build_parser(description: str) -> argparse.ArgumentParser:
    """The model, data, plan and optimisation flags (shared with `finetune_trainer.py`)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="offline-gpt2",
                   help="'offline-gpt2' (a small random-init GPT-2, no download) or a model name/path for from_pretrained")
    p.add_argument("--dataset", default="offline",
                   help="'offline' (CPython's reference docs) or a datasets name/path for load_dataset")
    p.add_argument("--dataset_config", default=None)
    p.add_argument("--data_files", default=None, help="local files for a builder such as 'text' or 'json'")
    p.add_argument("--text_column", default="text")
    p.add_argument("--plan", default=DEFAULT_PLAN, help="plan YAML/JSON file")
    p.add_argument("--num_stages", type=int, default=None, help="override the plan's num_stages")
    p.add_argument("--micro_batches", type=int, default=None, help="override the plan's micro_batches")
    p.add_argument("--schedule", default=None, help="override the plan's schedule: gpipe, 1f1b or zbh1")
    p.add_argument("--data_parallel", type=int, default=None,
                   help="pipeline replicas (processes = num_stages x data_parallel)")
    p.add_argument("--dp_compression", default=None,
                   help="data-parallel hook, e.g. 'allreduce' or 'topk,ratio=0.01' or 'dgc,ratio=0.001'")
    p.add_argument("--forward", default=None,
                   help="override the forward compression, e.g. 'aqsgd,bits=2' or 'topk,ratio=0.1,feedback=ef'")
    p.add_argument("--backward", default=None, help="override the backward compression, e.g. 'quantize,bits=8'")
    p.add_argument("--tie_compression", default=None,
                   help="compress the tied embedding's rows between the first and last stage, e.g. 'quantize,bits=8'")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--max_train_samples", type=int, default=512)
    p.add_argument("--max_eval_samples", type=int, default=None, help="evaluate on the first N eval rows only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="outputs/finetune_gpt2")
    p.add_argument("--save_steps", type=int, default=0,
                   help="write a checkpoint (output_dir/checkpoint-STEP) every N steps; 0: only the final model")
    p.add_argument("--resume_from_checkpoint", default=None,
                   help="'auto' (the newest complete checkpoint in output_dir, or a fresh start) or a checkpoint "
                        "directory; default: a fresh start, or 'auto' when torchrun restarted the job")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a rank waits for a peer (or a collective) before it fails, naming the peer")
    p.add_argument("--report_to", default=None, help="a tracker (tensorboard, wandb, ...); fails at once if missing")
    p.add_argument("--logging_steps", type=int, default=10, help="record losses and bytes for the curves every N steps")
    p.add_argument("--sample_prompts", nargs="+", default=None, metavar="PROMPT",
                   help="complete these prompts with the model still split, greedy (after training; with "
                        "finetune_trainer.py at every evaluation) and keep them in actcomp_results.json")
    p.add_argument("--sample_max_new_tokens", type=int, default=32, help="new tokens per sample")
    p.add_argument("--push_to_hub", action="store_true", help="upload the saved model, card and curves to the Hub")
    p.add_argument("--hub_model_id", default=None, help="the Hub repo to push to, e.g. user/model")
    p.add_argument("--hub_private_repo", action="store_true")
    return p


def parse_compression(spec: str) -> dict:
    """'topk,ratio=0.1,feedback=ef' -> {'method': 'topk', 'ratio': 0.1, 'feedback': 'ef'}."""
    method, *options = spec.split(",")
    out: dict = {"method": method.strip()}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"Compression option {option!r} in {spec!r} must look like key=value.")
        out[key.strip()] = yaml.safe_load(value)
    return out


def load_plan(path: str, num_samples: int, args: argparse.Namespace) -> hf_actcomp.Plan:
    data = hf_actcomp.Plan.from_file(path).to_dict()
    memory = data["memory"]
    if memory.get("num_samples") is None:
        memory["num_samples"] = num_samples
    if args.num_stages is not None:
        data["num_stages"] = args.num_stages
    if args.micro_batches is not None:
        data["micro_batches"] = args.micro_batches
    if args.schedule is not None:
        data["schedule"] = args.schedule
    if args.data_parallel is not None:
        data["data_parallel"] = args.data_parallel
    if args.dp_compression is not None:
        hook = parse_compression(args.dp_compression)
        data["dp_compression"] = hook if len(hook) > 1 else hook["method"]
    for direction in ("forward", "backward", "tie_compression"):
        spec = getattr(args, direction)
        if spec is not None:
            data[direction] = parse_compression(spec)
    return hf_actcomp.Plan.from_dict(data)


def load_data(args, tokenizer=None):
    if args.dataset == "offline":
        texts = offline_corpus()
        tokenizer = tokenizer or build_tokenizer(texts, vocab_size=1024)
    else:
        from datasets import load_dataset

        raw = load_dataset(args.dataset, args.dataset_config, data_files=args.data_files, split="train")
        texts = [t for t in raw[args.text_column] if t.strip()]
    train, evaluation = causal_lm_datasets(tokenizer, texts, seq_len=args.seq_len,
                                           max_train_samples=args.max_train_samples)
    if args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(args.max_eval_samples, len(evaluation))))
    return tokenizer, train, evaluation


def build_model(args, tokenizer):
    if args.model == "offline-gpt2":
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq_len, n_embd=128, n_layer=4,
                            n_head=4, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        return AutoModelForCausalLM.from_config(config)
    return AutoModelForCausalLM.from_pretrained(args.model)


def evaluate_simulated(model, loader) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            loss = model(**batch).loss
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            total += loss.item() * tokens
            count += tokens
    model.train()
    return total / max(count, 1)


def evaluate_pipeline(pipe, loader, compress: bool = True) -> float:
    total, count = 0.0, 0
    for batch in loader:
        out = pipe.eval_step(batch, compress=compress)
        total += out.loss.item() * out.num_tokens
        count += out.num_tokens
    return total / max(count, 1)


def check_hub_args(args) -> None:
    """Before any work: a push needs a repo id, and every requested tracker must be installed."""
    hf_actcomp.trackers.check_trackers(args.report_to)
    if args.push_to_hub and not args.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id (e.g. your-name/gpt2-aqsgd).")


def sample(args, pipe, model, plan, tokenizer, accelerator) -> list[dict] | None:
    """`--sample_prompts`: greedy completions by the trained model with the plan's inference codec,
    the model still split over the processes (`Pipeline.generate`, every rank) or, in one
    process, under `compressed_inference`; printed by the main process."""
    if not args.sample_prompts:
        return None
    settings = {"max_new_tokens": args.sample_max_new_tokens, "do_sample": False}
    if pipe is not None:
        completions = complete(pipe.generate, tokenizer, args.sample_prompts, device=accelerator.device, **settings)
    else:
        model.eval()
        with torch.no_grad(), hf_actcomp.compressed_inference(model, plan) as inference:
            completions = complete(inference.generate, tokenizer, args.sample_prompts, device=accelerator.device,
                                   **settings)
    for prompt, completion in zip(args.sample_prompts, completions, strict=True):
        accelerator.print(f"sample: {prompt!r} -> {completion!r}")
    return [{"prompt": p, "completion": c} for p, c in zip(args.sample_prompts, completions, strict=True)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_hub_args(args)
    if args.save_steps < 0:
        raise ValueError(f"--save_steps={args.save_steps} must be 0 (no checkpoints) or a positive number of steps.")
    # Collectives of the default group time out too, so that no rank waits forever for a lost one,
    # and a group restarted by torchrun finds its peers (not the addresses of the dead ones).
    init_distributed(args.timeout)
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=args.timeout))
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with=args.report_to,
                              project_dir=args.output_dir, kwargs_handlers=[timeout])
    resume_from = resolve_resume_from_checkpoint(args.resume_from_checkpoint, args.output_dir)
    set_seed(args.seed)
    tokenizer = None if args.model == "offline-gpt2" else AutoTokenizer.from_pretrained(args.model)
    tokenizer, train, evaluation = load_data(args, tokenizer)
    plan = load_plan(args.plan, len(train), args)
    distributed = accelerator.num_processes > 1
    if not distributed and plan.num_stages > 1:
        accelerator.print(f"One process: the {plan.num_stages} stages run in-process (hf_actcomp.simulate).")
    model = build_model(args, tokenizer)
    if distributed:
        # One stage per process; every rank must see the same batches, so the loaders are NOT
        # sharded by Accelerate: a seeded shuffle gives every rank the same order.
        runner = hf_actcomp.prepare(model, plan, device=accelerator.device, timeout=args.timeout)
        params = runner.parameters()
    else:
        runner = hf_actcomp.simulate(model, plan)
        params = runner.parameters()
    accelerator.print(f"plan: forward {plan.forward.describe()}, backward {plan.backward.describe()}, "
                      f"{plan.num_stages} stages of {[len(r) for r in runner.ranges]} blocks, "
                      f"{plan.micro_batches} micro-batches, {len(train)} train samples, "
                      f"{accelerator.num_processes} process(es)")

    generator = torch.Generator().manual_seed(args.seed)
    if distributed and plan.data_parallel > 1:
        # Pipeline replicas train on disjoint shards; the stages of one replica on the same one.
        # (sample_id keeps the global row index, so AQ-SGD memory stays keyed by dataset row.)
        train = runner.shard_dataset(train)  # equal shards: no replica waits for another forever
    train_loader = DataLoader(train.with_format("torch"), batch_size=args.batch_size, shuffle=True,
                              collate_fn=default_data_collator, drop_last=True, generator=generator)
    eval_loader = DataLoader(evaluation.with_format("torch"), batch_size=args.batch_size,
                             collate_fn=default_data_collator, drop_last=distributed)
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    if distributed:
        runner.attach_optimizer(optimizer)  # DiLoCo plans: the outer step runs every sync_every of its steps
    if not distributed:
        runner, optimizer, train_loader, eval_loader = accelerator.prepare(runner, optimizer, train_loader,
                                                                           eval_loader)
    if args.report_to:
        accelerator.init_trackers("hf_actcomp_finetune", config=vars(args))
    pipeline = accelerator.unwrap_model(runner) if not distributed else runner
    # The untrained model's loss on the same evaluation data, through the same boundaries: the
    # baseline that says whether training helped (random init gives about ln(vocab_size)).
    # fork_rng: iterating a DataLoader draws a seed from the global RNG, which would shift dropout.
    # Its traffic is not counted: the results report what training and the final evaluation send.
    evaluate = evaluate_pipeline if distributed else evaluate_simulated
    # What this rank trains and checkpoints: its stage, or (one process) the whole model.
    module, rank = (runner.stage, accelerator.process_index) if distributed else (pipeline.model, 0)
    step, start_epoch, skip, history = 0, 0, 0, []  # history: for the curves next to the model
    if resume_from is not None:
        if distributed:  # Plan.auto: the codecs chosen before, so that their state loads back
            runner.restore_auto_decision(os.path.join(resume_from, "actcomp_state"))
        # Weights, optimizer, compression state, RNG and the epoch's data order, as they were.
        done = load_training_state(resume_from, rank=rank, module=module, optimizer=optimizer,
                                   compression=pipeline.compression, generator=generator)
        step, start_epoch, skip = done["step"], done["epoch"], done["batches_done_in_epoch"]
        history, initial_eval_loss = done["history"], done["initial_eval_loss"]
        accelerator.print(f"Resumed from {resume_from} at step {step} (epoch {start_epoch}, batch {skip}).")
    else:
        with torch.random.fork_rng(devices=[]):
            initial_eval_loss = evaluate(runner, eval_loader)
    if distributed:
        runner.reset_stats()

    def save_checkpoint(epoch: int, batches_done: int, epoch_order: torch.Tensor) -> None:
        """Every rank writes its part of output_dir/checkpoint-STEP; complete once all have."""
        order = torch.Generator()
        order.set_state(epoch_order)  # resuming redraws this epoch's order, then skips what was done
        progress_state = {"step": step, "epoch": epoch, "batches_done_in_epoch": batches_done,
                          "history": history, "initial_eval_loss": initial_eval_loss}
        with writing_checkpoint(checkpoint_dir(args.output_dir, step)) as directory:
            save_training_state(directory, rank=rank, module=module, optimizer=optimizer,
                                compression=pipeline.compression, progress=progress_state, generator=order)
        maybe_pause_for_fault_test(step, rank, "after")

    progress = tqdm(total=args.epochs * len(train_loader), initial=step,
                    disable=not accelerator.is_local_main_process)
    for epoch in range(start_epoch, args.epochs):
        epoch_order = generator.get_state()  # the loader draws this epoch's order from it
        for b, batch in enumerate(train_loader):
            if epoch == start_epoch and b < skip:
                continue
            if distributed:
                loss = runner.train_step(batch).loss
                runner.clip_grad_norm_(args.max_grad_norm)
            else:
                loss = runner(**batch).loss
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(runner.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            stats = pipeline.stats()
            progress.update(1)
            progress.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", ratio=f"{stats['compression_ratio']:.1f}x")
            accelerator.log({"train/loss": loss.item(), "comm/bytes_sent": stats["bytes_sent"],
                             "comm/compression_ratio": stats["compression_ratio"]}, step=step)
            if step % args.logging_steps == 0:
                gathered = runner.stats(gather=True) if distributed else stats  # collective when distributed
                history.append({"step": step, "loss": loss.item(), "comm/bytes_sent": gathered["bytes_sent"],
                                **{f"comm/{n}/bytes_sent": c["bytes_sent"] for n, c in gathered["channels"].items()}})
            if args.save_steps and step % args.save_steps == 0:
                save_checkpoint(epoch, b + 1, epoch_order)
    progress.close()

    if distributed:
        eval_loss = evaluate_pipeline(runner, eval_loader)
        stats = runner.stats(gather=True)
        eval_plain_loss = evaluate_pipeline(runner, eval_loader, compress=False)  # the model without the codec
    else:
        eval_loss = evaluate_simulated(runner, eval_loader)
        stats = pipeline.stats()
        eval_plain_loss = evaluate_simulated(pipeline.model, eval_loader)
    samples = sample(args, runner if distributed else None, pipeline.model, plan, tokenizer, accelerator)
    result = {
        "eval_loss": eval_loss,
        "eval_plain_loss": eval_plain_loss,
        "initial_eval_loss": initial_eval_loss,
        "perplexity": math.exp(eval_loss),
        "steps": step,
        "processes": accelerator.num_processes,
        "bytes_sent": stats["bytes_sent"],
        "bytes_uncompressed": stats["bytes_uncompressed"],
        "compression_ratio": stats["compression_ratio"],
        "categories": stats["categories"],
        "relative_error": stats["relative_error"],
    }
    if samples:
        result["samples"] = samples
    if distributed:
        result["seconds"] = {str(s): t for s, t in stats["stages"].items()}
        if "data_parallel" in stats:
            result["data_parallel"] = stats["data_parallel"]
    accelerator.log({"eval/loss": eval_loss, "eval/perplexity": result["perplexity"]}, step=step)
    accelerator.end_training()
    os.makedirs(args.output_dir, exist_ok=True)
    state_dir = os.path.join(args.output_dir, "actcomp_state")
    history.append({"step": step, "eval_loss": eval_loss, "eval_plain_loss": eval_plain_loss})
    run = {"metrics": {"eval_loss": eval_loss, "eval_perplexity": result["perplexity"],
                       "eval_plain_loss": eval_plain_loss, "eval_plain_perplexity": math.exp(eval_plain_loss)},
           "log_history": history, "base_model": None if args.model == "offline-gpt2" else args.model,
           "datasets": None if args.dataset == "offline" else args.dataset,
           **({"samples": samples} if samples else {})}
    if distributed:  # every stage writes its shard; rank 0 the index, results, curves and card, once
        runner.save_pretrained(args.output_dir, model=model, results=run)
        runner.save_compression_state(state_dir)
    elif accelerator.is_main_process:
        pipeline.model.save_pretrained(args.output_dir)
        plan.save_pretrained(args.output_dir)
        hf_actcomp.hub.save_run(args.output_dir, stats=stats, blocks=[[r.start, r.stop] for r in pipeline.ranges],
                                **run)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(result, f, indent=2)
        accelerator.print(json.dumps(result, indent=2))
        if args.push_to_hub:
            hf_actcomp.hub.push_to_hub(args.output_dir, args.hub_model_id, private=args.hub_private_repo)
    return result


if __name__ == "__main__":
    main()
