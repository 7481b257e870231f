"""One rank of the slow-link benchmark (started by benchmarks/slow_link.py, one per namespace).

Runs every method one after the other in the same process group, so all of them see the same
link in the same minute: plain `torch.distributed.pipelining` (Schedule1F1B over the same stage
modules), then hf-actcomp uncompressed and compressed. Rank 0 writes a JSON list of rows.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GPT2Config

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan
from hf_actcomp.models import get_adapter
from hf_actcomp.simulate import stage_ranges

METHODS = {
    "ours, uncompressed": (Compression("none"), Compression("none")),
    "ours, AQ-SGD fw4/bw8": (Compression("aqsgd", bits=4), Compression("quantize", bits=8)),
    "ours, AQ-SGD fw2/bw4": (Compression("aqsgd", bits=2), Compression("quantize", bits=4)),
    "ours, TopK 10% + EF": (Compression("topk", ratio=0.1, feedback="ef"), Compression("quantize", bits=8)),
}
PEER = "torch.distributed.pipelining"


def make_model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.hidden, n_layer=args.layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                        bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config)


def batches(args):
    """An endless cycle over `num_samples` fixed samples (AQ-SGD revisits them after warm-up)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, args.vocab, (args.num_samples, args.seq_len), generator=g)
    step = 0
    while True:
        ids = (torch.arange(args.batch_size) + step * args.batch_size) % args.num_samples
        x = data[ids]
        yield dict(input_ids=x, attention_mask=torch.ones_like(x), labels=x.clone(), sample_id=ids)
        step += 1


def run_ours(name, args) -> dict:
    forward, backward = METHODS[name]
    plan = Plan(num_stages=2, micro_batches=args.micro_batches, schedule="1f1b", forward=forward, backward=backward,
                memory=MemoryConfig(num_samples=args.num_samples, dtype="fp32"))
    model = make_model(args)
    pipe = hf_actcomp.prepare(model, plan, timeout=600, track_error=False)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    data = batches(args)

    def step():
        pipe.train_step(next(data))
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.warmup):  # AQ-SGD: the first visit of every sample is uncompressed
        step()
    pipe.reset_stats()
    seconds = timed(step, args.steps)
    stats = pipe.stats(gather=True)
    waiting = {s: t["seconds_waiting"] / t["seconds_step"] for s, t in stats["stages"].items()}
    return dict(seconds_per_step=seconds, bytes_per_step=stats["bytes_sent"] / args.steps,
                byte_ratio=stats["compression_ratio"], waiting_fraction=waiting)


def run_peer(args) -> dict:
    """What a user would write with torch.distributed.pipelining: the same stage modules,
    PipelineStage + Schedule1F1B, plain fp32 activations and gradients."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank = dist.get_rank()
    model = make_model(args)
    adapter = get_adapter(model)
    plan = Plan(num_stages=2, micro_batches=args.micro_batches)
    r = stage_ranges(adapter, plan)[rank]
    module = adapter.build_stage(r.start, r.stop, first=rank == 0, last=rank == 1)
    stage = PipelineStage(module, stage_index=rank, num_stages=2, device=torch.device("cpu"))

    def loss_fn(logits, labels):
        return model.loss_function(logits, labels, vocab_size=args.vocab)

    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    data = batches(args)

    def step():
        batch = next(data)
        if rank == 0:
            schedule.step(batch["input_ids"], attention_mask=batch["attention_mask"])
        else:
            schedule.step(attention_mask=batch["attention_mask"], target=batch["labels"])
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.warmup):
        step()
    seconds = timed(step, args.steps)
    raw = 2 * args.batch_size * args.seq_len * args.hidden * 4  # fp32 activations + gradients
    return dict(seconds_per_step=seconds, bytes_per_step=raw, byte_ratio=1.0, waiting_fraction=None)


def timed(step, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--link", required=True)
    p.add_argument("--methods", nargs="+", default=[PEER, *METHODS])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--micro_batches", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    args = p.parse_args()
    args.num_samples = args.batch_size * args.warmup
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for name in args.methods:
        result = run_peer(args) if name == PEER else run_ours(name, args)
        tokens = args.batch_size * args.seq_len
        rows.append(dict(link=args.link, method=name, tokens_per_s=tokens / result["seconds_per_step"], **result))
        if dist.get_rank() == 0:
            print(f"{args.link:>10} {name:<32} {rows[-1]['tokens_per_s']:8.0f} tok/s "
                  f"{result['bytes_per_step'] / 1e6:7.2f} MB/step", flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
