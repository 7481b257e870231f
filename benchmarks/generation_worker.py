"""One rank of the generation benchmark (started by benchmarks/generation.py, one per rank).

Builds one 2-stage `Pipeline` per variant (codec) from the same pre-trained weights, then times
`Pipeline.generate` (greedy) on the prompt batches the parent wrote: every (batch, variant) at two
lengths, `--new_tokens` new tokens and 1 (the prompt step alone), so that the steady-state time of
one step (one new token per row) is `(T(new_tokens) - T(1)) / (new_tokens - 1)`. Each
measurement is `--calls` generate calls, back to back, inside `slow_link_worker.measure` (barriers
around the window, the veth tx counters on a shaped link, the share of the CPUs other processes
used, and a retry while that share is above `--max_other_cpu`); every rank also times each call. `--repeats` rounds, each running the variants
in another order (`harness.round_order`).

Per measurement each rank reports what `pipe.stats()` counted under `inference` (what THIS rank
sent: activations on stage 0; chosen ids and tied-embedding rows on stage 1) and
`stages[i]["seconds_waiting"]` (this rank blocked on the transport); `generate` does not advance
`seconds_step`, so compute is the window's wall time minus the waiting.

Before the rounds, the link's round trip as gloo sees it: `--pings` ping-pongs (median and minimum) of
one int64 between the two ranks. Rank 0 writes the rows and the generated ids of round 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from dataclasses import asdict

import slow_link_worker
import torch
import torch.distributed as dist
import transformers
from convergence import make_model
from harness import add_arguments, median, round_order, wait_until_quiet
from safetensors.torch import load_file
from slow_link_worker import measure

import hf_actcomp
from hf_actcomp import Compression, Plan

# The codecs themselves at inference (`inference="direct"`): what each costs in time and agreement
# (the default `inference="auto"` would replace the ones a real LLM breaks; docs/real_model.md).
CODECS = {
    "none": Compression("none"),
    "bf16": Compression("bf16"),
    "quantize-8": Compression("quantize", bits=8, inference="direct"),
    "hadamard-4": Compression("hadamard", bits=4, inference="direct"),
}
# Codec none with every parameter frozen (requires_grad=False): the tied embedding is then never
# exchanged (`TiedEmbedding.active`), which shows what the per-step row exchange costs.
FROZEN = "none, frozen weights"
VARIANTS = {**CODECS, FROZEN: CODECS["none"]}
SPLIT = [2]  # blocks 0-1 on stage 0, 2-3 on stage 1 (finetune_quality.py's split)
IDS_PER_ROW = 2 * 8  # per step, to each other stage: the chosen id and the unfinished flag, int64 each


def plan_of(variant: str) -> Plan:
    return Plan(num_stages=2, split_points=SPLIT, forward=VARIANTS[variant])


def call_seconds(result: dict) -> float:
    """Seconds of one generate call: rank 0's mean over the window's calls after the first (back to
    back, from the last token of one call to the last of the next), or the window's seconds per call
    with one call (then one closing barrier included)."""
    calls = result["call_seconds_per_rank"][0]
    return sum(calls[1:]) / (len(calls) - 1) if len(calls) > 1 else result["seconds"]


def load_data(path: str) -> tuple[dict, dict, dict]:
    """The parent's file: the pre-trained weights, the prompt batches by size, and its metadata."""
    tensors = load_file(path)
    with open(path + ".json") as f:
        meta = json.load(f)
    weights = {k[len("weights."):]: v for k, v in tensors.items() if k.startswith("weights.")}
    prompts = {b: (tensors[f"prompts{b}.input_ids"], tensors[f"prompts{b}.attention_mask"]) for b in meta["batch_sizes"]}
    return weights, prompts, meta


def build_model(weights: dict, meta: dict) -> torch.nn.Module:
    """The pre-trained model, generating exactly the requested number of tokens: no EOS (the
    tokenizer's end-of-text is a real token of the corpus; an early stop would change what is
    timed), pads 0."""
    model = make_model(meta["vocab"], meta["seq_len"], seed=0)
    model.load_state_dict(weights)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = meta["pad_token_id"]
    return model.eval()


def round_trip_seconds(pings: int) -> list[float]:
    """Seconds of each ping-pong of one int64 between rank 0 and rank 1 (gloo send/recv)."""
    x = torch.zeros(1, dtype=torch.long)
    times = []
    for _ in range(pings + 2):  # the first two: connection warm-up
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        times.append(time.perf_counter() - start)
    return times[2:]


def run(pipe, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, args) -> tuple[dict, torch.Tensor]:
    """`args.calls` generate calls of `new_tokens` tokens, back to back: the window's seconds per call
    (closing barrier included), each call's own seconds on every rank, and per-rank counters. The
    prompt step's windows (tens of ms, a few of /proc/stat's 10 ms ticks) are not judged by the
    other processes' CPU share: too short for it to mean anything."""
    out, calls = {}, []

    def step() -> None:
        start = time.perf_counter()
        out["ids"] = pipe.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        calls.append(time.perf_counter() - start)

    def reset() -> None:
        pipe.reset_stats()
        calls.clear()

    judged = args if new_tokens > 1 else argparse.Namespace(**{**vars(args), "retries": 0})
    seconds, window = measure(step, args.calls, judged, reset=reset)
    if out["ids"].shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate returned {out['ids'].shape[1] - ids.shape[1]} new tokens, not {new_tokens}")
    local = pipe.stats()
    mine = dict(sent=local["categories"]["inference"]["bytes_sent"] / args.calls,
                uncompressed=local["categories"]["inference"]["bytes_uncompressed"] / args.calls,
                waiting=next(iter(local["stages"].values()))["seconds_waiting"] / args.calls, calls=list(calls))
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    result = dict(seconds=seconds, call_seconds_per_rank=[r["calls"] for r in per_rank],
                  bytes_sent_per_rank=[r["sent"] for r in per_rank],
                  bytes_uncompressed_per_rank=[r["uncompressed"] for r in per_rank],
                  seconds_waiting_per_rank=[r["waiting"] for r in per_rank], **window)
    return result, out["ids"]


def main() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, required=("out", "link", "data"), new_tokens=64,
                  calls=(4, "generate calls per timed window"), repeats=3, pings=50, max_other_cpu=0.1,
                  retries=2,
                  quiet_wait=(30.0, "seconds at most to wait for a quiet machine"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args()
    transformers.logging.set_verbosity_error()  # generate's notices, once per call and rank
    started = time.time()
    # measure() waits for a quiet machine before measuring again; bound each wait (shared machine)
    slow_link_worker.wait_until_quiet = functools.partial(wait_until_quiet, longest=args.quiet_wait)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    weights, prompts, meta = load_data(args.data)
    pings = round_trip_seconds(args.pings)
    rtt = median(pings)
    pipes = {}
    for variant in args.variants:
        model = build_model(weights, meta)
        if variant == FROZEN:
            model.requires_grad_(False)
        pipes[variant] = hf_actcomp.prepare(model, plan_of(variant), timeout=600, track_error=False)
    for pipe in pipes.values():  # one-time costs out of the timed windows
        for ids, mask in prompts.values():
            pipe.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    if dist.get_rank() == 0:
        print(f"{args.link}: ready after {time.time() - started:.1f} s, RTT {1e3 * rtt:.2f} ms (min "
              f"{1e3 * min(pings):.2f})", flush=True)
    rows = {}
    for k in range(args.repeats):
        for batch, (ids, mask) in prompts.items():
            order = round_order(len(args.variants), k, args.repeats)
            for index in order:
                variant = args.variants[index]
                prompt, _ = run(pipes[variant], ids, mask, 1, args)
                full, generated = run(pipes[variant], ids, mask, args.new_tokens, args)
                row = rows.setdefault((batch, variant), dict(
                    link=args.link, batch=batch, variant=variant, codec=VARIANTS[variant].method,
                    compression=asdict(VARIANTS[variant]), frozen=variant == FROZEN, new_tokens=args.new_tokens,
                    prompt_length=ids.shape[1], prompt_tokens=int(mask.sum()), link_rtt_seconds=rtt,
                    ids_bytes_per_step=IDS_PER_ROW * batch, rounds=[]))
                row["link_rtt_min_seconds"] = min(pings)
                if k == 0:
                    row["generated"] = generated[:, ids.shape[1]:].tolist()
                row["rounds"].append(dict(position=order.index(index), prompt_step=prompt, full=full))
                if dist.get_rank() == 0:
                    step_ms = 1e3 * (call_seconds(full) - call_seconds(prompt)) / (args.new_tokens - 1)
                    print(f"{args.link:>24} round {k} batch {batch} {variant:<22} {step_ms:7.2f} ms/step "
                          f"prompt {1e3 * call_seconds(prompt):7.2f} ms  "
                          f"{batch * args.new_tokens / call_seconds(full):7.0f} "
                          f"tok/s  other CPU {100 * max(full['other_cpu_share'], prompt['other_cpu_share']):.0f}%",
                          flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "link_rtt_seconds": pings, "rows": list(rows.values())}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
