"""Training across a link that the parent stalls: `python link_stall_worker.py OUT_DIR [options]`.

Used by tests/test_link_stall.py and benchmarks/link_stall.py (one worker, so the test checks
what the benchmark measures). Each rank trains its stage of a small tied GPT-2 (2 stages; with
`--layout diloco` the whole model, one of 2 DiLoCo replicas) in
one or more runs (`--runs plain stalled`), each from a fresh model with the same seed over the
same batches, in the same processes. In the run named `stalled`, rank 0 writes
OUT_DIR/stall.marker after step `--stall_after`, so the parent (tests/stall.py) stalls the link
while the next step is in flight.

Each rank writes OUT_DIR/rank{r}.json after every run: per run the losses, each step's
wall-clock start and end (time.time(), the parent's clock too), this rank's bytes and seconds
(computing vs waiting), whether its final weights equal the first run's bit for bit and their
largest |difference|, and the message of a PeerTimeoutError that stopped the run. Such an
error is then raised again, so that the process ends as a user's would.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GPT2Config

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, PeerTimeoutError, Plan

CODECS = {"none": (Compression("none"), Compression("none")),
          "aqsgd": (Compression("aqsgd", bits=4), Compression("quantize", bits=8))}  # AQ-SGD fw4/bw8


def tied_gpt2(args: argparse.Namespace) -> torch.nn.Module:
    """As benchmarks/slow_link_worker.py's make_model: GPT-2 blocks without dropout,
    `lm_head.weight` tied to `transformer.wte.weight`, seed 0."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.hidden, n_layer=args.layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                        bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config)


def batches(args: argparse.Namespace) -> Iterator[dict]:
    """An endless cycle over `--num_batches` fixed batches (AQ-SGD's first visits are exact);
    under DiLoCo each replica its own."""
    g = torch.Generator().manual_seed(dist.get_rank() if args.layout == "diloco" else 0)
    samples = args.batch_size * args.num_batches
    data = torch.randint(0, args.vocab, (samples, args.seq_len), generator=g)
    step = 0
    while True:
        ids = (torch.arange(args.batch_size) + step * args.batch_size) % samples
        x = data[ids]
        yield dict(input_ids=x, attention_mask=torch.ones_like(x), labels=x.clone(), sample_id=ids)
        step += 1


def plan(args: argparse.Namespace) -> Plan:
    """`--layout pipeline`: 2 stages, the link between them; `diloco`: 1 stage x 2 replicas with
    DiLoCo syncing every 2 steps (int8, plain averaging), the link between the replicas."""
    if args.layout == "diloco":
        return Plan(num_stages=1, data_parallel=2, dp_compression={
            "method": "diloco", "sync_every": 2, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False,
            "compression": {"method": "quantize", "bits": 8}})
    forward, backward = CODECS[args.compression]
    return Plan(num_stages=2, micro_batches=args.micro_batches, schedule="1f1b", forward=forward, backward=backward,
                memory=MemoryConfig(num_samples=args.batch_size * args.num_batches, dtype="fp32"))


def namespace_address() -> str:
    """This namespace's IPv4 address (of GLOO_SOCKET_IFNAME), where torchft's servers must bind."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", os.environ["GLOO_SOCKET_IFNAME"]], check=True,
                         capture_output=True, text=True).stdout
    return out.split()[3].split("/")[0]


def mark(path: str) -> None:
    """Write the marker atomically, so the parent never sees it half-written."""
    with open(path + ".tmp", "w") as f:
        f.write(str(time.time()))
    os.replace(path + ".tmp", path)


def train(name: str, args: argparse.Namespace, result: dict) -> dict[str, torch.Tensor]:
    """One run into `result`; this stage's final weights. A PeerTimeoutError is recorded, then raised."""
    model = tied_gpt2(args)
    dist.barrier()  # both ranks reach prepare() together: a short --timeout also bounds its set-up
    pipe = hf_actcomp.prepare(model, plan(args), timeout=args.timeout, track_error=False)
    optimizer = pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
    data = batches(args)
    result.update(losses=[], steps=[], error=None)
    for i in range(args.steps):
        start = time.time()
        try:
            loss = pipe.train_step(next(data)).loss.item()
        except PeerTimeoutError as err:
            result.update(error=str(err), error_step=i, error_at=time.time(), step_start=start)
            raise
        optimizer.step()
        optimizer.zero_grad()
        result["steps"].append([start, time.time()])
        result["losses"].append(loss)
        if name == "stalled" and i == args.stall_after and dist.get_rank() == 0:
            mark(os.path.join(args.out_dir, "stall.marker"))
    stats = pipe.stats()
    stage = stats["stages"][pipe.mesh.stage]
    result.update(bytes_sent=stats["bytes_sent"], seconds_step=stage["seconds_step"],
                  seconds_waiting=stage["seconds_waiting"])
    if pipe.outer is not None:
        result.update(syncs=stats["data_parallel"]["syncs"], failed_syncs=stats["data_parallel"]["failed_syncs"],
                      seconds_outer_sync=stage["seconds_outer_sync"])
        pipe.outer.close()
    return {n: p.detach().clone() for n, p in pipe.stage.named_parameters()}


def compare(weights: dict[str, torch.Tensor], first: dict[str, torch.Tensor]) -> dict:
    return dict(weights_equal=all(torch.equal(weights[n], first[n]) for n in first),
                weights_max_abs_diff=max(float((weights[n] - first[n]).abs().max()) for n in first))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--runs", nargs="+", default=["plain", "stalled"], choices=["plain", "stalled"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--stall_after", type=int, default=3, help="rank 0 writes the marker after this step (from 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="prepare(timeout=)")
    p.add_argument("--compression", default="aqsgd", choices=list(CODECS))
    p.add_argument("--layout", default="pipeline", choices=["pipeline", "diloco"],
                   help="the stalled link: between 2 stages, or between 2 DiLoCo replicas of 1 stage")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--micro_batches", type=int, default=4)
    p.add_argument("--num_batches", type=int, default=2, help="distinct batches, cycled")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.layout == "diloco" and "GLOO_SOCKET_IFNAME" in os.environ:
        os.environ[hf_actcomp.dp.outer.HOST_ENV] = namespace_address()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict = {"rank": rank, "args": vars(args)}
    first = None
    for name in args.runs:
        results[name] = {}
        try:
            weights = train(name, args, results[name])
            first = first or weights
            results[name].update(compare(weights, first))
        finally:  # also what a run stopped by a PeerTimeoutError recorded
            with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    if args.layout == "diloco":
        os._exit(0)  # torchft's threads must not keep the process alive


if __name__ == "__main__":
    main()
