"""One rank of the time-to-quality benchmark (started by benchmarks/time_to_quality.py).

Fine-tunes the pre-trained model the parent prepared (`--data`: tokens, weights, vocabulary)
once per method, every method from the same weights, initialisation, data order and seed, and
evaluates it every `--eval_every` steps. The clock runs only while training: before an
evaluation both ranks meet at a barrier and the clock stops; each rank writes its stage's
weights to `--scratch`, both rebuild the whole model from the two files and evaluate half of
the held-out blocks each (the link carries only the two sums). Every method runs in every
round (`--repeats`), in the order of benchmarks/harness.py `round_order`.

Methods: torch.distributed.pipelining (Schedule1F1B over the same stage modules, plus the
all-reduce of the tied embedding's gradient that a user has to write; 2 stages only), and
hf-actcomp uncompressed, compressed with fixed settings (the same on every boundary), and
`Plan.auto` ("ours, auto": the pipeline measures its links and compute at the first step and picks
each boundary direction's codec and the tie's; the probe's seconds are inside the run's clock and
its bytes in its counts, as they are part of what auto costs). The uncompressed methods run
`--epochs` (the fine-tune of benchmarks/finetune_quality.py); the compressed ones up to
`--max_epochs`, so that a setting slightly worse per step can still show when it gets there.
`--stages 3` splits the model at blocks 1 and 3 instead of 2.

`--replicas 2` (issue 37: pipeline x data parallel) runs 2 pipelines of `--stages` ranks on
contiguous halves of the training blocks, each replica its own shuffled order, `--batch_size`
the global batch (each replica steps on half of it). Rank r is stage r % S of replica r // S, as
hf-actcomp lays them out. The peer is torch.distributed.pipelining with each stage module in
DDP over its replicas (as torchtitan composes PP x DP); ours runs `Plan(data_parallel=2,
dp_compression=...)` (DP_METHODS). Every replica evaluates its own weights; a curve point is the
worst replica's loss (DiLoCo's replicas differ between syncs).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from convergence import make_model
from diloco_worker import interface_address
from harness import add_arguments, busy_cpu_seconds, other_cpu_share, round_order
from peer import build_peer
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader
from transformers import default_data_collator

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan, dp
from hf_actcomp.models import get_adapter

PEER = "torch.distributed.pipelining"
BASE = "ours, uncompressed"
AUTO = "ours, auto"
AUTO_FAST = "ours, auto (fast)"
AUTOS = {AUTO: "safe", AUTO_FAST: "fast"}  # Plan.auto's quality per auto method
q = lambda b: Compression("quantize", bits=b)  # noqa: E731
h = lambda b: Compression("hadamard", bits=b)  # noqa: E731
warm = lambda b: Compression("aqsgd", bits=b, first_visit=h(4))  # noqa: E731
h_o = lambda b: Compression("hadamard_outliers", bits=b)  # noqa: E731
aq_outliers = lambda b: Compression("aqsgd", inner="hadamard_outliers", bits=b, first_visit=h_o(4))  # noqa: E731
warm_o = lambda b: Compression("aqsgd", bits=b, first_visit=h_o(4))  # noqa: E731
codebook = lambda n: Compression("hadamard_codebook", levels=n)  # noqa: E731
# ternary deltas (3 levels, no outlier channels) after a ternary first epoch
ternary = Compression("hadamard_codebook", levels=3, outliers=0)
aqsgd_ternary = Compression("aqsgd", inner="hadamard_codebook", levels=3, outliers=0, first_visit=ternary)
# (forward, backward[, tie_compression]) per method; the tie is exact where not given.
METHODS: dict[str, tuple | None] = {
    PEER: None,
    BASE: (Compression("none"), Compression("none")),
    "ours, AQ-SGD fw4/bw8": (Compression("aqsgd", bits=4), q(8)),
    "ours, AQ-SGD fw2/bw4": (Compression("aqsgd", bits=2), q(4)),
    "ours, TopK 10%": (Compression("topk", ratio=0.1), q(8)),
    "ours, Hadamard fw4/bw8": (h(4), h(8)),
    "ours, Hadamard fw3/bw6": (h(3), h(6)),
    # Compressed warm-up (first visits Hadamard-4) and 8-bit tied-embedding rows.
    "ours, AQ-SGD fw4/bw8, warm-up h4, tie q8": (warm(4), q(8), q(8)),
    "ours, AQ-SGD fw2/bw4, warm-up h4, tie q8": (warm(2), q(4), q(8)),
    "ours, AQ-SGD fw2/bw4, warm-up h4, tie q4": (warm(2), q(4), q(4)),
    "ours, Hadamard fw4/bw8, tie q8": (h(4), h(8), q(8)),
    # The stateless rung Plan.auto's ladders take on SmolLM2 (hf_actcomp/plan/codec_choice.py).
    "ours, hadamard_outliers fw4/bw8, tie q8": (h_o(4), q(8), q(8)),
    # AQ-SGD with its deltas (and warm-up) through hadamard_outliers: what a real model's massive values need.
    "ours, AQ-SGD(h_o) fw4/bw8, warm-up h_o4, tie q8": (aq_outliers(4), q(8), q(8)),
    "ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q8": (aq_outliers(2), q(4), q(8)),
    # quantize's 4-bit deltas after a hadamard_outliers-4 warm-up (the Hadamard-4 one trails on SmolLM2).
    "ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q8": (warm_o(4), q(8), q(8)),
    # The 4-bit tie on SmolLM2 ("safe"'s last rung with its charge in steps; "fast"'s strongest pair).
    "ours, AQ-SGD fw4/bw8, warm-up h_o4, tie q4": (warm_o(4), q(8), q(4)),
    "ours, AQ-SGD(h_o) fw2/bw4, warm-up h_o4, tie q4": (aq_outliers(2), q(4), q(4)),
    # The moonshot setting on SmolLM2 (benchmarks/results/real_model_finetune_256.md): ternary
    # hadamard_codebook deltas after a ternary first epoch, 9 levels backward.
    "ours, AQ-SGD(codebook3) fw/codebook9 bw, tie q4": (aqsgd_ternary, codebook(9), q(4)),
    # The same codecs under zero-bubble H1 instead of 1F1B (a name ending in ZBH1).
    "ours, AQ-SGD fw2/bw4, warm-up h4, tie q4" + (ZBH1 := ", zbh1"): (warm(2), q(4), q(4)),
    "ours, AQ-SGD fw4/bw8, warm-up h4, tie q8" + ZBH1: (warm(4), q(8), q(8)),
    AUTO: None,  # Plan.auto(quality="safe", aqsgd=True): chosen per boundary direction, and the tie's codec
    AUTO_FAST: None,  # the same with quality="fast"
}
SPLIT_POINTS = {2: [2], 3: [1, 3]}  # of the toy model's 4 blocks
REAL_SPLIT_POINTS = {2: [15], 3: [10, 20]}  # of SmolLM2-135M's 30 blocks (--model smollm2)
# Pipeline x data parallel (--replicas 2): (boundary codecs as in METHODS or None, dp_compression).
PEER_DP = "torch.distributed.pipelining + DDP"
BASE_DP = "ours, uncompressed + all-reduce"
AQ = (warm(2), q(4), q(4))  # the fastest setting to the target at 10 Mbit/s on one pipeline
INT8 = {"method": "quantize", "bits": 8}
PLAIN = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}  # DiLoCo as model averaging (benchmarks/results/diloco.md)
DP_METHODS: dict[str, tuple | None] = {
    PEER_DP: None,
    BASE_DP: ((Compression("none"), Compression("none")), "allreduce"),
    "ours, AQ-SGD + PowerSGD rank 4": (AQ, {"method": "powersgd", "matrix_approximation_rank": 4,
                                            "start_powerSGD_iter": 10}),
    "ours, AQ-SGD + TopK 1% EF": (AQ, {"method": "topk", "ratio": 0.01}),
    "ours, AQ-SGD + DiLoCo H=8 int8": (AQ, {"method": "diloco", "sync_every": 8, **PLAIN, "compression": INT8}),
    "ours, AQ-SGD + DiLoCo H=32 int8": (AQ, {"method": "diloco", "sync_every": 32, **PLAIN, "compression": INT8}),
    "ours, AQ-SGD + Streaming DiLoCo H=8, 2 fragments, delay 1, int8": (
        AQ, {"method": "diloco", "sync_every": 8, "fragments": 2, "fragment_sync_delay": 1, **PLAIN,
             "compression": INT8}),
    "ours, AQ-SGD + DiLoCo H=8 top 2% 2-bit": (
        AQ, {"method": "diloco", "sync_every": 8, **PLAIN, "compression": {"method": "topk_quantize", "ratio": 0.02,
                                                                         "bits": 2}}),
}
UNCOMPRESSED = (PEER, BASE, PEER_DP, BASE_DP)


def load_data(path: str) -> tuple[dict, dict, dict, int, str | None]:
    """The parent's file: train and eval columns, the pre-trained weights (the toy model's), the
    vocabulary size, and the directory of a real model to load instead (None for the toy)."""
    tensors = load_file(path)
    with open(path + ".json") as f:
        sizes = json.load(f)
    part = lambda prefix: {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}  # noqa: E731
    return part("train."), part("eval."), part("weights."), sizes["vocab"], sizes.get("model_dir")


def load_model(data, args) -> torch.nn.Module:
    """The model every method starts from: the pre-trained toy model, or the real one from its folder."""
    _, _, weights, vocab, model_dir = data
    if model_dir is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = make_model(vocab, args.seq_len, args.seed)
    model.load_state_dict(weights, strict=False)  # lm_head.weight is the tied wte
    return model


def split_points(data, args) -> list[int]:
    return (REAL_SPLIT_POINTS if data[4] is not None else SPLIT_POINTS)[args.stages]


def tie_names(model) -> tuple[str, str]:
    """(the head's name, the input embedding's name) of the tied weight."""
    (tie,) = get_adapter(model).tied_weights()
    return tie


class Rows(torch.utils.data.Dataset):
    """Rows of a dict of equally long tensors, for DataLoader."""

    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.columns.items()}


class Evaluator:
    """Eval loss of each replica's whole model from its stages' weights, half the blocks on each of
    its stages 0 and 1 (with 3 stages too, so that the loss is summed exactly as with 2). Returns
    the worst replica's loss; `losses` keeps every replica's."""

    def __init__(self, data, args) -> None:
        rank = dist.get_rank()
        self.stages, self.replicas = args.stages, args.replicas
        self.stage, self.replica = rank % args.stages, rank // args.stages
        self.model = load_model(data, args).eval()
        self.tie = tie_names(self.model)
        self.expected = set(self.model.state_dict()) - {self.tie[1]}  # the input embedding is the head's weight
        evaluation = data[1]
        rows = {k: v[self.stage::2] if self.stage < 2 else v[:0] for k, v in evaluation.items()}
        self.loader = DataLoader(Rows(rows), batch_size=32, collate_fn=default_data_collator)
        self.scratch = args.scratch
        self.losses: list[float] = []

    def __call__(self, stage_state: dict[str, torch.Tensor]) -> float:
        """The tied embedding is the last stage's `lm_head.weight`: hf-actcomp's owner copy (the
        first stage's copy is refreshed only in the rows of each batch's tokens before its
        forward), and equal to the first stage's copy in the peer (all-reduced gradients)."""
        path = lambda s: os.path.join(self.scratch, f"replica{self.replica}_stage{s}.safetensors")  # noqa: E731
        save_file({k: v.detach().clone().contiguous() for k, v in stage_state.items()}, path(self.stage))
        dist.barrier()
        *others, last = [load_file(path(s)) for s in range(self.stages)]
        weights = {**{k: v for part in others for k, v in part.items() if k != self.tie[1]}, **last}
        if set(weights) != self.expected:
            raise RuntimeError(f"the stages' weights do not make the model: {sorted(set(weights) ^ self.expected)}")
        self.model.load_state_dict(weights, strict=False)
        total = torch.zeros(self.replicas, 2, dtype=torch.float64)
        with torch.no_grad():
            for batch in self.loader:
                n = int((batch["labels"][:, 1:] != -100).sum())
                total[self.replica, 0] += self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                                     labels=batch["labels"]).loss.item() * n
                total[self.replica, 1] += n
        dist.all_reduce(total)  # also keeps any rank from overwriting its file while another reads
        self.losses = (total[:, 0] / total[:, 1]).tolist()
        return max(self.losses)


class Clock:
    """Training seconds only: started and stopped at barriers, so both ranks agree and the last
    step's pipeline drain is inside. Also the machine's busy CPU seconds over the same windows,
    to flag a run measured while other processes ran."""

    def __init__(self) -> None:
        self.seconds = self.own = self.busy = 0.0

    def start(self) -> None:
        dist.barrier()
        self._wall, self._own, self._busy = time.perf_counter(), time.process_time(), busy_cpu_seconds()[0]

    def stop(self) -> None:
        dist.barrier()
        self.seconds += time.perf_counter() - self._wall
        self.own += time.process_time() - self._own
        self.busy += busy_cpu_seconds()[0] - self._busy

    def other_cpu_share(self) -> float:
        """Share of the machine's CPUs other processes used while the clock ran."""
        own = [None] * dist.get_world_size()
        dist.all_gather_object(own, self.own)
        return other_cpu_share(self.busy, own, self.seconds)


def replica_rows(train: dict, args) -> Rows:
    """This rank's replica's training blocks: a contiguous share (`Pipeline.shard_dataset`'s cut)."""
    n = len(Rows(train)) // args.replicas
    replica = dist.get_rank() // args.stages
    return Rows({k: v[replica * n:(replica + 1) * n] for k, v in train.items()})


def build_ours(name: str, data, args):
    """`hf_actcomp.prepare` with the method's plan (METHODS, or DP_METHODS with --replicas 2)."""
    train = data[0]
    common = dict(num_stages=args.stages, micro_batches=args.micro_batches, split_points=split_points(data, args),
                  schedule="zbh1" if name.endswith(ZBH1) else "1f1b",
                  memory=MemoryConfig(num_samples=len(Rows(train)), store="host", dtype="fp16"))
    if name in AUTOS:  # the tie's codec left unset: auto chooses it
        return Plan.auto(quality=AUTOS[name], aqsgd=True, **common)
    if name in DP_METHODS:
        (forward, backward, *tie), dp_compression = DP_METHODS[name]
        common.update(data_parallel=args.replicas, dp_compression=dp_compression)
    else:
        forward, backward, *tie = METHODS[name]
    return Plan(forward=forward, backward=backward, tie_compression=tie[0] if tie else None, **common)


def peer_bytes(module: torch.nn.Module, model, batch_rows: int, args) -> dict[str, float]:
    """What the peer sends per step over all ranks, by category (tensor sizes; the ring formulas):
    fp32 activations and their gradients per pipeline, the all-reduce of the tied weight between
    each pipeline's 2 stages, and DDP's all-reduce of every stage's gradients over its replicas."""
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    stage_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    own: list = [None] * dist.get_world_size()
    dist.all_gather_object(own, dp.ring_allreduce_bytes(stage_bytes, args.replicas))
    activations = args.replicas * batch_rows * args.seq_len * hidden * 4
    categories = dict(activations=activations, activation_gradients=activations,
                      tie=args.replicas * 2 * vocab * hidden * 4)
    if args.replicas > 1:
        categories["data_parallel"] = sum(own)
    return categories


def world_stats(pipe) -> dict:
    """`pipe.stats(gather=True)` with the bytes summed over every replica's pipeline (each rank's
    own counters, all-gathered over the world): the stages' timings stay this replica's."""
    stats = pipe.stats(gather=True)
    if dist.get_world_size() == pipe.mesh.num_stages:
        return stats
    mine: list = [None] * dist.get_world_size()
    dist.all_gather_object(mine, pipe.stats()["categories"])
    categories: dict = {}
    for part in mine:
        for k, c in part.items():
            entry = categories.setdefault(k, {"bytes_sent": 0, "bytes_uncompressed": 0})
            entry["bytes_sent"] += c["bytes_sent"]
            entry["bytes_uncompressed"] += c["bytes_uncompressed"]
    sent = sum(c["bytes_sent"] for c in categories.values())
    raw = sum(c["bytes_uncompressed"] for c in categories.values())
    return {**stats, "categories": categories, "bytes_sent": sent, "compression_ratio": raw / sent if sent else 1.0}


def run(name: str, data, args) -> dict:
    model = load_model(data, args)
    rows = replica_rows(data[0], args)
    batch_rows = args.batch_size // args.replicas
    pipe = None
    if name in (PEER, PEER_DP):
        groups = replica_groups(args) if args.replicas > 1 else (None, None)
        module, peer_step, _ = build_peer(model, args.micro_batches, tied=True, pipe_group=groups[0],
                                          dp_group=groups[1], tie=tie_names(model), split=split_points(data, args))
        params, state = module.parameters(), module.state_dict
    else:
        pipe = hf_actcomp.prepare(model, build_ours(name, data, args), timeout=600, track_error=False)
        params, state = pipe.parameters(), pipe.stage.state_dict
    torch.manual_seed(args.seed)
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    if pipe is not None:
        pipe.attach_optimizer(optimizer)  # DiLoCo's outer step runs after every H of its steps
    seed = args.seed + 1000 * (dist.get_rank() // args.stages)  # each replica its own order
    loader = DataLoader(rows, batch_size=batch_rows, shuffle=True, drop_last=True,
                        collate_fn=default_data_collator, generator=torch.Generator().manual_seed(seed))
    evaluate = Evaluator(data, args)
    curve = [dict(seconds=0.0, step=0, eval_loss=evaluate(state()), losses=evaluate.losses)]
    clock, step = Clock(), 0
    epochs = args.epochs if name in UNCOMPRESSED else args.max_epochs
    # The peer's steps cut short (--peer_steps): on a real tied model its all-reduce of the whole
    # embedding's gradient takes minutes a step on a slow link; it computes what ours uncompressed does.
    last_step = args.peer_steps if name in (PEER, PEER_DP) and args.peer_steps else None
    after_first_epoch = None
    stop = args.stop_below if name not in UNCOMPRESSED else None
    clock.start()
    for epoch in range(epochs):
        if stop is not None and curve[-1]["eval_loss"] <= stop:
            break
        if epoch == 1 and pipe is not None:  # AQ-SGD's memory is full from here on: the steady state
            clock.stop()
            after_first_epoch = (step, world_stats(pipe))
            clock.start()
        for batch in loader:
            if pipe is None:
                peer_step(batch)
            else:
                pipe.train_step(batch)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if epochs == 1 and step == 1 and pipe is not None:  # one epoch: the steady state from step 2 on
                clock.stop()
                after_first_epoch = (step, world_stats(pipe))
                clock.start()
            if step % args.eval_every == 0 or step in (epochs * len(loader), last_step):
                clock.stop()
                curve.append(dict(seconds=clock.seconds, step=step, eval_loss=evaluate(state()),
                                  losses=evaluate.losses))
                clock.start()
                if stop is not None and curve[-1]["eval_loss"] <= stop:
                    break
            if step == last_step:
                break
        if step == last_step:
            break
    clock.stop()
    if pipe is None:
        categories = peer_bytes(module, model, batch_rows, args)
        traffic = dict(bytes_per_step=sum(categories.values()), byte_ratio=1.0, categories_per_step=categories)
    else:
        stats = world_stats(pipe)
        traffic = dict(bytes_per_step=stats["bytes_sent"] / step, byte_ratio=stats["compression_ratio"],
                       categories={c: v["bytes_sent"] for c, v in stats["categories"].items()},
                       steady_state=steady_state(stats, *after_first_epoch, step) if after_first_epoch else None)
        traffic["categories_per_step"] = {c: v / step for c, v in traffic["categories"].items()}
        if name in AUTOS:
            traffic["auto"] = auto_summary(stats)
        if pipe.outer is not None:
            traffic["outer_sync_seconds"] = max(t.get("seconds_outer_sync", 0.0) for t in stats["stages"].values())
            pipe.outer.close()
    return dict(method=name, steps=step, epochs=epochs, train_seconds=clock.seconds, curve=curve, cut_at_step=last_step,
                stopped_at_target=stop is not None and curve[-1]["eval_loss"] <= stop,
                final_eval_loss=curve[-1]["eval_loss"], replicas=args.replicas,
                other_cpu_share=clock.other_cpu_share(), **traffic)


_GROUPS: tuple | None = None


def replica_groups(args) -> tuple:
    """(this rank's pipeline group, its stage's data-parallel group), made once: every rank must
    create every group, in the same order."""
    global _GROUPS
    if _GROUPS is None:
        world, s = dist.get_world_size(), args.stages
        pipes = [dist.new_group(list(range(r * s, (r + 1) * s))) for r in range(world // s)]
        stages = [dist.new_group(list(range(k, world, s))) for k in range(s)]
        rank = dist.get_rank()
        _GROUPS = (pipes[rank // s], stages[rank % s])
    return _GROUPS


def auto_summary(stats: dict) -> dict:
    """What Plan.auto measured and chose, and what its probe cost: the slowest stage's seconds
    measuring (links and compute, inside the run's clock) and the bytes counted under `probe`."""
    decision = stats["auto"]["decision"]
    return dict(decision=decision, switches=stats["auto"]["switches"],
                boundaries=[{d: c["codec"] for d, c in b.items()} for b in decision["boundaries"]],
                tie=decision["tie"]["codec"] if "tie" in decision else None,
                probe_seconds=max(t["seconds_probing"] for t in stats["stages"].values()),
                probe_bytes=stats["categories"]["probe"]["bytes_sent"])


def steady_state(end: dict, start_step: int, start: dict, end_step: int) -> dict:
    """Per step from the second epoch on (AQ-SGD's memory full): bytes sent and uncompressed by
    category, the byte ratio, and each stage's seconds computing and waiting on its peer."""
    steps = end_step - start_step
    categories = {}
    for name, c in end["categories"].items():
        before = start["categories"].get(name, {"bytes_sent": 0, "bytes_uncompressed": 0})
        categories[name] = {k: (c[k] - before[k]) / steps for k in ("bytes_sent", "bytes_uncompressed")}
    sent = sum(c["bytes_sent"] for c in categories.values())
    raw = sum(c["bytes_uncompressed"] for c in categories.values())
    stages = {}
    for stage, t in end["stages"].items():
        t0 = start["stages"][stage]
        step_s = (t["seconds_step"] - t0["seconds_step"]) / steps
        wait_s = (t["seconds_waiting"] - t0["seconds_waiting"]) / steps
        stages[str(stage)] = {"seconds_step": step_s, "seconds_waiting": wait_s, "seconds_computing": step_s - wait_s}
    return dict(steps=steps, bytes_per_step=sent, byte_ratio=raw / sent if sent else 1.0, categories=categories,
                stages=stages)


def main() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, required=("out", "link", "data", "scratch"),
                  replicas=(1, "data-parallel pipelines (2: DP_METHODS)"), epochs=4, max_epochs=6,
                  eval_every=8, batch_size=16, micro_batches=4, seq_len=128, lr=5e-4, seed=0, repeats=3,
                  peer_steps=(None, "the peer stops after this many steps"))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=[*METHODS, *DP_METHODS])
    p.add_argument("--stages", type=int, default=2, choices=sorted(SPLIT_POINTS))
    p.add_argument("--stop_below", type=float, default=None,
                   help="compressed methods stop at the first evaluation at or below this loss")
    args = p.parse_args()
    torch.set_num_threads(1)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    if ifname != "lo":  # inside a namespace: torchft's servers (DiLoCo) bind to this namespace's address
        os.environ[hf_actcomp.dp.outer.HOST_ENV] = interface_address(ifname)
    dist.init_process_group("gloo")
    data = load_data(args.data)
    runs = []
    for k in range(args.repeats):
        order = round_order(len(args.methods), k, args.repeats)
        for position, index in enumerate(order):
            row = dict(run(args.methods[index], data, args), round=k, position=position, link=args.link)
            runs.append(row)
            if dist.get_rank() == 0:
                print(f"{args.link} round {k} {row['method']:<30} {row['steps']} steps in {row['train_seconds']:6.1f}s "
                      f"final eval {row['final_eval_loss']:.4f}  {row['bytes_per_step'] / 1e6:.3f} MB/step  "
                      f"other CPU {100 * row['other_cpu_share']:.0f}%"
                      + (f"  auto: {row['auto']['boundaries']} tie {row['auto']['tie']}, probe "
                         f"{row['auto']['probe_seconds']:.2f}s" if "auto" in row else ""), flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": runs}, f, indent=1)
    dist.destroy_process_group()
    os._exit(0)  # torchft's threads (DiLoCo) must not keep the process alive


if __name__ == "__main__":
    main()
