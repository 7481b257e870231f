"""One data-parallel worker of benchmarks/dp_hooks.py: every hook, one after the other, under DDP.

For each hook: `--loss_steps` training steps from the same initialisation on this worker's shard
of the offline corpus (then the eval loss), or, with `--loss_steps 0`, only `--steps` timed steps
(step time, hook time, bytes). Rank 0 writes the rows.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, GPT2Config

from hf_actcomp import dp
from hf_actcomp.data import build_tokenizer, causal_lm_datasets, offline_corpus

# (label, hook, params). Sparsifiers at two levels whose wire bytes are ~50x and ~1000x below
# a ring all-reduce's at 2 workers; the rest at their natural setting.
HOOKS = [
    ("all-reduce (no compression)", "allreduce", {}),
    ("PowerSGD rank 4 (torch)", "powersgd", {"matrix_approximation_rank": 4, "start_powerSGD_iter": 10}),
    ("topk 50x", "topk", {"ratio": 0.01}),
    ("topk 1000x", "topk", {"ratio": 0.0005}),
    ("randk 50x", "randk", {"ratio": 0.02}),
    ("randk 1000x", "randk", {"ratio": 0.001}),
    ("dgc 50x", "dgc", {"ratio": 0.01, "warmup_steps": 20}),
    ("dgc 1000x", "dgc", {"ratio": 0.0005, "warmup_steps": 20}),
    ("qsgd 4 levels", "qsgd", {"levels": 4, "bucket_size": 512}),
    ("ef_sign", "ef_sign", {}),
    ("marsit", "marsit", {}),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--link", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--loss_steps", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--only", nargs="*", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    texts = offline_corpus()
    tokenizer = build_tokenizer(texts, vocab_size=1024)
    train, evaluation = causal_lm_datasets(tokenizer, texts, seq_len=args.seq_len)
    train = train.with_format("torch")
    shard = train.shard(world, rank)  # disjoint shards
    eval_rows = evaluation.with_format("torch")[:64]
    rows = []
    for label, hook, params in HOOKS:
        if args.only and hook not in args.only:
            continue
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq_len, n_embd=256, n_layer=2, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = DDP(AutoModelForCausalLM.from_config(config))
        # Timing runs measure the steady state: no DGC sparsity warm-up, PowerSGD compressing from
        # step 2 (torch needs 2 uncompressed steps), and 3 warm-up steps before the clock starts.
        if not args.loss_steps and hook == "dgc":
            params = {**params, "warmup_steps": 0}
        if not args.loss_steps and hook == "powersgd":
            params = {**params, "start_powerSGD_iter": 2}
        state = dp.register(model, hook, **params)
        # DGC applies momentum in the hook; the others use SGD with momentum.
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0 if hook == "dgc" else 0.9)
        steps = args.loss_steps or args.steps

        def step(i: int, model=model, optimizer=optimizer) -> None:
            start = (i * args.batch_size) % (len(shard) - args.batch_size)
            batch = shard[start : start + args.batch_size]
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        warmup = 1 if args.loss_steps else 3  # bucket rebuild; PowerSGD's uncompressed start
        for i in range(warmup):
            step(i)
        state.bytes_sent = state.bytes_uncompressed = 0
        state.seconds = 0.0
        dist.barrier()
        start = time.perf_counter()
        for i in range(warmup, warmup + steps):
            step(i)
        dist.barrier()
        seconds = (time.perf_counter() - start) / steps
        stats = state.stats()
        row = dict(link=args.link, workers=world, label=label, hook=hook, params=params,
                   seconds_per_step=seconds, bytes_per_step=stats["bytes_sent"] / steps,
                   byte_ratio=stats["compression_ratio"], hook_seconds_per_step=stats["seconds"] / steps,
                   parameters=sum(p.numel() for p in model.parameters()))
        if args.loss_steps:
            with torch.no_grad():
                row["eval_loss"] = model.module(input_ids=eval_rows["input_ids"], labels=eval_rows["labels"]).loss.item()
            row["steps"] = steps + warmup
        rows.append(row)
        if rank == 0:
            extra = f" eval {row['eval_loss']:.3f}" if "eval_loss" in row else ""
            print(f"{args.link:>10} W={world} {label:<28} {seconds * 1e3:7.1f} ms/step "
                  f"{row['bytes_per_step'] / 1e6:7.3f} MB/step x{row['byte_ratio']:.0f}{extra}", flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
