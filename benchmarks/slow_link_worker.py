"""One rank of the slow-link benchmark (started by benchmarks/slow_link.py, one per namespace).

Runs every (model, method) pair one after the other in the same process group, so all of them
see the same link in the same minute: plain `torch.distributed.pipelining` (Schedule1F1B over the
same stage modules), then hf-actcomp uncompressed and compressed. Models:

- `small`: GPT-2 style with a small vocabulary (`--vocab`, 1024), untied head.
- `tied`: the same blocks with GPT-2's real vocabulary (`--large_vocab`, 50257) and
  `tie_word_embeddings=True`, so `lm_head.weight` is `transformer.wte.weight`: the first stage
  holds the input embedding, the last the head.
- `untied`: the same real-vocabulary model with `tie_word_embeddings=False`.

`torch.distributed.pipelining` does not keep a weight shared by two stages in sync (its tracer
frontend replicates it and leaves the gradient sync as a TODO in `_IR.py`; `PipelineStage`
over hand-split modules knows nothing of it). For the tied model the peer is therefore what a
user must write by hand: the pipelining schedule plus an all-reduce of the full vocab x hidden
tied gradient between the first and the last stage after every step.

On a shaped link (each rank alone in a network namespace, `GLOO_SOCKET_IFNAME` its veth end),
each rank also reads its veth tx byte counter just before and just after the measured steps, so
the bytes the run counted can be checked against the bytes the interface really sent.
`--repeats` rounds: round k runs each model's methods starting at method k*n/repeats,
backwards on odd rounds (benchmarks/harness.py `round_order`), every run from a fresh model
with its own warm-up. Rank 0 writes one row per (model, method) with the rounds' results.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from harness import add_arguments, busy_cpu_seconds, other_cpu_share, round_order, wait_until_quiet
from peer import TIE, build_peer
from transformers import AutoModelForCausalLM, GPT2Config

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan

METHODS = {
    "ours, uncompressed": (Compression("none"), Compression("none")),
    "ours, AQ-SGD fw4/bw8": (Compression("aqsgd", bits=4), Compression("quantize", bits=8)),
    "ours, AQ-SGD fw2/bw4": (Compression("aqsgd", bits=2), Compression("quantize", bits=4)),
    "ours, TopK 10% + EF": (Compression("topk", ratio=0.1, feedback="ef"), Compression("quantize", bits=8)),
}
PEER = "torch.distributed.pipelining"
PEER_TIED = "torch.distributed.pipelining + all-reduce of the tied weight"

# What runs for each model, in this order.
RUNS = {
    "small": [PEER, *METHODS],
    "tied": [PEER_TIED, "ours, uncompressed", "ours, AQ-SGD fw4/bw8"],
    "untied": ["ours, uncompressed", "ours, AQ-SGD fw4/bw8"],
}


def model_spec(key: str, args) -> dict:
    """vocab, tie and label of a model of the benchmark."""
    vocab = args.vocab if key == "small" else args.large_vocab
    tied = key == "tied"
    return dict(model=f"vocab {vocab}, {'tied' if tied else 'untied'}", vocab=vocab, tied=tied)


def make_model(spec: dict, args) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=spec["vocab"], n_positions=args.seq_len, n_embd=args.hidden, n_layer=args.layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=spec["tied"], bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    shared = model.lm_head.weight is model.transformer.wte.weight
    if shared != spec["tied"]:
        raise RuntimeError(f"{spec['model']}: lm_head.weight is transformer.wte.weight = {shared}")
    return model


def batches(spec: dict, args):
    """An endless cycle over `num_samples` fixed samples (AQ-SGD revisits them after warm-up).
    Tokens are uniform over the vocabulary, so with the real vocabulary nearly every token of a
    batch is distinct: the most tied-embedding rows to exchange (real text repeats tokens)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, spec["vocab"], (args.num_samples, args.seq_len), generator=g)
    step = 0
    while True:
        ids = (torch.arange(args.batch_size) + step * args.batch_size) % args.num_samples
        x = data[ids]
        yield dict(input_ids=x, attention_mask=torch.ones_like(x), labels=x.clone(), sample_id=ids)
        step += 1


def run_ours(name, spec, args) -> dict:
    forward, backward = METHODS[name]
    plan = Plan(num_stages=2, micro_batches=args.micro_batches, schedule="1f1b", forward=forward, backward=backward,
                memory=MemoryConfig(num_samples=args.num_samples, dtype="fp32"))
    model = make_model(spec, args)
    pipe = hf_actcomp.prepare(model, plan, timeout=600, track_error=False)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    data = batches(spec, args)

    def step():
        pipe.train_step(next(data))
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.warmup):  # AQ-SGD: the first visit of every sample is uncompressed
        step()
    steps = steps_of(spec, args)
    seconds, window = measure(step, steps, args, reset=pipe.reset_stats)
    stats = pipe.stats(gather=True)
    rank_bytes: list = [None] * dist.get_world_size()  # what each rank put on its direction of the link
    dist.all_gather_object(rank_bytes, pipe.stats()["bytes_sent"] / steps)
    waiting = {s: t["seconds_waiting"] / t["seconds_step"] for s, t in stats["stages"].items()}
    categories = {k: dict(bytes_sent_per_step=c["bytes_sent"] / steps,
                          bytes_uncompressed_per_step=c["bytes_uncompressed"] / steps)
                  for k, c in stats["categories"].items()}
    return dict(seconds_per_step=seconds, steps=steps, bytes_per_step=stats["bytes_sent"] / steps,
                byte_ratio=stats["compression_ratio"], categories=categories, waiting_fraction=waiting,
                rank_bytes_per_step=rank_bytes, counted_bytes_window=stats["bytes_sent"], **window)


def run_peer(name, spec, args) -> dict:
    """What a user would write with torch.distributed.pipelining: the same stage modules,
    PipelineStage + Schedule1F1B, plain fp32 activations and gradients (and, for a tied model,
    an all-reduce of the tied weight's gradient between the two stages that hold a copy)."""
    model = make_model(spec, args)
    module, peer_step, tied = build_peer(model, args.micro_batches, tied=name == PEER_TIED)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    data = batches(spec, args)

    def step():
        peer_step(next(data))
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.warmup):
        step()
    steps = steps_of(spec, args)
    seconds, window = measure(step, steps, args)
    activations = args.batch_size * args.seq_len * args.hidden * 4
    categories = {"activations": activations, "activation_gradients": activations}
    if tied is not None:  # ring all-reduce of vocab x hidden fp32 on 2 ranks: each sends all of it
        categories["tie"] = 2 * tied.numel() * 4
    total = sum(categories.values())
    categories = {k: dict(bytes_sent_per_step=v, bytes_uncompressed_per_step=v) for k, v in categories.items()}
    each = total / 2  # activations one way, their gradients the other; the tie all-reduce halves
    return dict(seconds_per_step=seconds, steps=steps, bytes_per_step=total, byte_ratio=1.0,
                categories=categories, waiting_fraction=None, rank_bytes_per_step=[each, each],
                counted_bytes_window=total * steps, **window)


def steps_of(spec: dict, args) -> int:
    return args.steps if spec["vocab"] == args.vocab else args.large_steps


def distinct_tokens(spec: dict, args) -> float:
    """Mean number of distinct tokens in the measured batches (the tied rows exchanged)."""
    data = batches(spec, args)
    counts = [torch.unique(next(data)["input_ids"]).numel() for _ in range(args.num_samples // args.batch_size)]
    return sum(counts) / len(counts)


def tx_counters() -> tuple[int, int] | None:
    """This namespace's tx (bytes, packets) counters of our veth end (as `ip -s link show DEV`),
    or None on loopback (shared with the rest of the machine, so not a clean count)."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    if dev == "lo":
        return None
    with open("/proc/net/dev") as f:  # per network namespace
        for line in f:
            name, _, values = line.partition(":")
            if name.strip() == dev:
                fields = values.split()  # receive: 8 fields, then transmit bytes, packets, ...
                return int(fields[8]), int(fields[9])
    raise RuntimeError(f"{dev} not in /proc/net/dev")


def timed(step, steps: int) -> tuple[float, dict]:
    """Seconds per step, the veth tx bytes and packets of both ranks over the measured steps,
    and the share of the machine's CPUs that other processes used meanwhile (a timing taken
    while something else ran is not comparable).

    The counters are read after a barrier that follows the warm-up and after one that follows
    the last step (plus a short pause for the last TCP acknowledgements), so gloo's
    connection set-up and the stats gathering afterwards are outside the window; the two
    barriers themselves (a few hundred bytes) are inside."""
    dist.barrier()
    before = tx_counters()
    busy, steal = busy_cpu_seconds()
    own = time.process_time()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    wall = time.perf_counter() - start
    own = time.process_time() - own
    busy_after, steal_after = busy_cpu_seconds()
    time.sleep(0.2)
    after = tx_counters()
    mine = dict(tx=None if before is None else [a - b for a, b in zip(after, before, strict=True)], own=own,
                busy=busy_after - busy, steal=steal_after - steal, wall=wall)
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    # Both ranks' windows are about the same; rank 0's view of the machine stands for both (and
    # every rank computes the same number, so they agree on a retry).
    other = other_cpu_share(per_rank[0]["busy"], [r["own"] for r in per_rank], per_rank[0]["wall"])
    result = dict(other_cpu_share=other, steal_cpu_share=per_rank[0]["steal"] / (os.cpu_count() * per_rank[0]["wall"]),
                  link_tx_bytes_window=None, link_tx_packets_window=None, link_tx_per_rank=None)
    if None not in (r["tx"] for r in per_rank):
        txs = [r["tx"] for r in per_rank]
        result.update(link_tx_bytes_window=sum(b for b, _ in txs), link_tx_packets_window=sum(n for _, n in txs),
                      link_tx_per_rank=txs)
    return wall / steps, result


def measure(step, steps: int, args, reset=None) -> tuple[float, dict]:
    """`timed`, repeated (after waiting for the machine to go quiet) while other processes used
    more than `--max_other_cpu` of the CPUs during the window, at most `--retries` times."""
    for attempt in range(args.retries + 1):
        if reset is not None:
            reset()
        seconds, window = timed(step, steps)
        window["attempts"] = attempt + 1
        if window["other_cpu_share"] <= args.max_other_cpu or attempt == args.retries:
            return seconds, window
        if dist.get_rank() == 0:
            print(f"other processes used {100 * window['other_cpu_share']:.0f}% of the CPUs: waiting to measure "
                  "again", flush=True)
            wait_until_quiet(args.max_other_cpu)
        dist.barrier()
    raise AssertionError("unreachable")


def main() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, required=("out", "link"), steps=(8, "measured steps of the small model"),
                  large_steps=6, warmup=2, batch_size=16, micro_batches=4, seq_len=128, hidden=256,
                  layers=2, vocab=1024, large_vocab=50257, max_other_cpu=0.1, retries=3,
                  repeats=(3, "rounds, each running the methods in another order"))
    p.add_argument("--models", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = p.parse_args()
    args.num_samples = args.batch_size * args.warmup
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = {}
    tokens = args.batch_size * args.seq_len
    specs = {key: model_spec(key, args) for key in args.models}
    distinct = {key: distinct_tokens(spec, args) for key, spec in specs.items()}
    for k in range(args.repeats):
        for key, spec in specs.items():
            names = RUNS[key]
            order = round_order(len(names), k, args.repeats)
            for index in order:
                name = names[index]
                result = run_peer(name, spec, args) if name in (PEER, PEER_TIED) else run_ours(name, spec, args)
                row = rows.setdefault((key, name), dict(
                    link=args.link, model=spec["model"], vocab=spec["vocab"], tied=spec["tied"],
                    tie=list(TIE) if spec["tied"] else None, distinct_tokens_per_batch=distinct[key], method=name,
                    tokens_per_step=tokens, rounds=[]))
                row["rounds"].append(dict(result, position=order.index(index)))
                if dist.get_rank() == 0:
                    link = result["link_tx_bytes_window"]
                    check = "" if link is None else f"  veth/counted {link / result['counted_bytes_window']:.3f}"
                    print(f"{args.link:>10} round {k} {spec['model']:<20} {name:<60} "
                          f"{tokens / result['seconds_per_step']:8.0f} tok/s {result['bytes_per_step'] / 1e6:7.2f} "
                          f"MB/step{check}  other CPU {100 * result['other_cpu_share']:.0f}%", flush=True)
    rows = [rows[(key, name)] for key in args.models for name in RUNS[key]]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
