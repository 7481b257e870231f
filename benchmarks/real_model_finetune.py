"""Fine-tuning quality on a real pretrained LLM: SmolLM2-135M continued on stdlib source through
compressed boundaries (`simulate`, one process), each recommended plan beside uncompressed.

Per (stages, setting, seed): a fresh copy of the model from the fixture (benchmarks/smollm2.py),
AdamW, the same batches in the same order for every setting of a seed; after the last epoch the
held-out eval loss with plain inference (the trained weights) and through the plan's inference
form (`compressed_inference`, `Compression.inference="auto"`). Bytes per step are the boundary
traffic `simulate` counts (activations and their gradients); the tied embedding's rows apart: in
the TIES settings they cross compressed (`Plan.tie_compression`) and the row says their bytes.

    python benchmarks/real_model_finetune.py --stages 2 --seeds 0 1 2        # ~3 min per run here
    python benchmarks/real_model_finetune.py --stages 4 --seeds 0 1 2 --merge  # add rows to the file
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, default_data_collator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smollm2  # noqa: E402
from convergence import eval_loss, train_epochs  # noqa: E402  (token-weighted eval, the epochs loop)
from harness import add_arguments, write_markdown  # noqa: E402

import hf_actcomp  # noqa: E402
from hf_actcomp import Compression, MemoryConfig, Plan  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WARM_UP = Compression("hadamard", bits=4)


# Settings whose tied embedding rows (SmolLM2's input embedding is its head) cross compressed too
# (`Plan.tie_compression`): the ladders' tie rungs on each ladder's strongest pair. The boundary
# codecs are those of the setting named before " + tie ".
# Ternary activations: `hadamard_codebook` with 3 levels and no outlier channels, alone and as
# AQ-SGD's inner codec with a ternary first epoch (the same bytes every epoch).
TERNARY = Compression("hadamard_codebook", levels=3, outliers=0)
AQSGD_TERNARY = Compression("aqsgd", inner="hadamard_codebook", levels=3, outliers=0, first_visit=TERNARY)
VQ64 = Compression("hadamard_vq", levels=64)  # 0.75 bits a value before the sink and scales
AQSGD_VQ64 = Compression("aqsgd", inner="hadamard_vq", levels=64, first_visit=VQ64)
# The whole run's bytes spent unevenly: a 1-bit first epoch (256 words, 26.6x), deltas without the
# sink and mean apart (128 words 36.0x, 64 words 41.9x): 32.2x / 35.2x forward over three epochs.
VQ256 = Compression("hadamard_vq", levels=256)
AQSGD_VQ128_NOSINK = Compression("aqsgd", inner="hadamard_vq", levels=128, sink_and_mean=False, first_visit=VQ256)
AQSGD_VQ64_NOSINK = Compression("aqsgd", inner="hadamard_vq", levels=64, sink_and_mean=False, first_visit=VQ256)
AQSGD_VQ64_FIRST256 = Compression("aqsgd", inner="hadamard_vq", levels=64, first_visit=VQ256)  # 30.9x: a diagnostic
# One outlier channel a token sent apart (SmolLM2's channel 507 is massive in many tokens at the
# first 4-stage boundary, block 4, where 64 Gaussian words lose 80% of the energy): 31.7x at 64
# words, 36.3x at 32; 32-word deltas after a 64-word first epoch are 34.6x over three epochs.
VQ64_O1 = Compression("hadamard_vq", levels=64, outliers=1)
AQSGD_VQ32_O1 = Compression("aqsgd", inner="hadamard_vq", levels=32, outliers=1, first_visit=VQ64_O1)
AQSGD_VQ64_O1 = Compression("aqsgd", inner="hadamard_vq", levels=64, outliers=1, first_visit=VQ64_O1)  # 31.7x: a diagnostic
# A first epoch that keeps the 4-stage forward working (the ternary code, 15.7x; under one bit a
# value the first epoch's training loss at 4 stages runs 2-3 times uncompressed's), paid for by revisits that
# send nothing (`refresh_every=2`: the second epoch reuses the memory, the third sends deltas):
# 33.5x forward over three epochs with 32-word deltas, 32.1x with 64; refresh_every=3 sends no delta
# in three epochs (47.1x: what the stale memory alone costs, a diagnostic).
AQSGD_VQ32_REFRESH2 = Compression("aqsgd", inner="hadamard_vq", levels=32, refresh_every=2, first_visit=TERNARY)
AQSGD_VQ64_REFRESH2 = Compression("aqsgd", inner="hadamard_vq", levels=64, refresh_every=2, first_visit=TERNARY)
AQSGD_TERNARY_REFRESH3 = Compression("aqsgd", inner="hadamard_codebook", levels=3, outliers=0, refresh_every=3,
                                     first_visit=TERNARY)
# Where the 4-stage cost lives: `aqsgd-vq64` forward at one boundary, the others exact (4 stages).
# And the bytes spent by boundary: the boundary that costs most gets a ternary first epoch and
# 16-word deltas without the sink apart (62.2x), the others `aqsgd-vq64` (33.6x): 32.8x forward over
# three epochs and three boundaries.
VQ16_NOSINK_AFTER_TERNARY = Compression("aqsgd", inner="hadamard_vq", levels=16, sink_and_mean=False,
                                        first_visit=TERNARY)
# Deltas of the weights' drift alone (`deltas="drift"`: against the sender's exact record, so the
# ternary first epoch's error stays in the receiver's memory), low-rank: rank 4 of a 2 x 128-token
# micro-batch (88.6x), 34.8x forward over three epochs; with AQ-SGD's own deltas (against the
# receiver's memory) at the same bytes, a diagnostic.
AQSGD_LOWRANK4_DRIFT = Compression("aqsgd", inner="lowrank", rank=4, deltas="drift", first_visit=TERNARY)
AQSGD_LOWRANK4 = Compression("aqsgd", inner="lowrank", rank=4, first_visit=TERNARY)
FORWARD_AT = {
    **{f"aqsgd-vq64 at boundary {b} only fw/vq64 bw": {b: AQSGD_VQ64} for b in range(3)},
    **{f"aqsgd-vq16-nosink (first epoch codebook3) at boundary {b}, aqsgd-vq64 elsewhere fw/vq64 bw":
       {c: VQ16_NOSINK_AFTER_TERNARY if c == b else AQSGD_VQ64 for c in range(3)} for b in range(3)},
}
TIES = {"aqsgd fw4/bw8 warm-up h_o4 + tie q8": Compression("quantize", bits=8),
        "aqsgd fw4/bw8 warm-up h_o4 + tie q4": Compression("quantize", bits=4),
        "aqsgd-h_o fw2/bw4 warm-up h_o4 + tie q4": Compression("quantize", bits=4),
        "hadamard_outliers fw3/bw6 + tie q8": Compression("quantize", bits=8),
        "hadamard_outliers fw6/bw8 + tie q8": Compression("quantize", bits=8),
        "aqsgd-codebook3 fw/codebook9 bw + tie q4": Compression("quantize", bits=4)}


# Settings toward the 32x stretch, run by name into their own file (real_model_finetune_32x), not
# into the main table.
STRETCH = ("aqsgd-codebook3 fw/codebook3 bw", "topk_quantize 8% 2-bit fw/bw", "aqsgd-vq64 fw/vq64 bw",
           "aqsgd-vq64 fw/codebook3 bw", "aqsgd-codebook3 fw/vq64 bw",
           "aqsgd-vq128-nosink (first epoch vq256) fw/vq64 bw", "aqsgd-vq64-nosink (first epoch vq256) fw/vq64 bw",
           "aqsgd-vq64 (first epoch vq256) fw/vq64 bw", "aqsgd-vq32o1 (first epoch vq64o1) fw/vq64 bw",
           "aqsgd-vq64o1 fw/vq64 bw", "aqsgd-vq32 refresh 2 (first epoch codebook3) fw/vq64 bw",
           "aqsgd-vq64 refresh 2 (first epoch codebook3) fw/vq64 bw", "aqsgd refresh 3 (first epoch codebook3) fw/vq64 bw",
           "aqsgd-lowrank4 drift (first epoch codebook3) fw/vq64 bw", "aqsgd-lowrank4 (first epoch codebook3) fw/vq64 bw",
           *FORWARD_AT)


def settings() -> dict[str, tuple[Compression, Compression]]:
    """The plans README, the docs and `Plan.auto`'s ladders recommend (forward, backward); the
    tie codec of a TIES setting is `TIES[name]`."""
    boundaries = boundary_settings()
    return {**boundaries, **{name: boundaries[name.split(" + tie ")[0]] for name in TIES}}


def describe_tie(tie: Compression | None) -> str:
    """A row's "tie": the codec of the tied rows, or "exact"."""
    return "exact" if tie is None else tie.describe()


def boundary_settings() -> dict[str, tuple[Compression, Compression]]:
    """The settings with exact tied rows."""
    q = lambda bits: Compression("quantize", bits=bits)  # noqa: E731
    return {
        "none": (Compression(), Compression()),
        # The noise floor: a rounding-sized perturbation of every boundary, nothing more.
        "bf16 fw/bw (noise floor)": (Compression("bf16"), Compression("bf16")),
        "aqsgd fw2/bw4 warm-up h4": (Compression("aqsgd", bits=2, first_visit=WARM_UP), q(4)),
        "aqsgd fw4/bw8 warm-up h4": (Compression("aqsgd", bits=4, first_visit=WARM_UP), q(8)),
        # The same with hadamard_outliers' 4 bits on first visits (the Hadamard-4 warm-up trails on SmolLM2).
        "aqsgd fw4/bw8 warm-up h_o4": (Compression("aqsgd", bits=4, first_visit=Compression("hadamard_outliers", bits=4)),
                                       q(8)),
        "hadamard fw4/bw8": (Compression("hadamard", bits=4), Compression("hadamard", bits=8)),
        "quantize fw3/bw6": (q(3), q(6)),
        "hadamard_outliers fw4/bw8": (Compression("hadamard_outliers", bits=4), q(8)),
        "hadamard_outliers fw3/bw6": (Compression("hadamard_outliers", bits=3), q(6)),
        # The inference form's codec forward, 8-bit gradients: the stateless "safe" candidate after
        # fw4/bw8 and fw3/bw6 ended above 0.3% instruction tuning on 48 pairs (docs/real_model.md).
        "hadamard_outliers fw6/bw8": (Compression("hadamard_outliers", bits=6), q(8)),
        # The 8x stateless codec (11 levels, ~4 bits a value) at training time.
        "hadamard_codebook11 fw/bw8": (Compression("hadamard_codebook", levels=11), q(8)),
        # The moonshot's byte budget from the first step on: 3 levels forward (1.92 bits a value, 16.7x),
        # the 8x codebook backward (3.99 bits).
        "hadamard_codebook3 fw/codebook11 bw": (TERNARY, Compression("hadamard_codebook", levels=11)),
        # The same bytes with AQ-SGD: ternary deltas after a ternary first epoch.
        "aqsgd-codebook3 fw/codebook11 bw": (AQSGD_TERNARY, Compression("hadamard_codebook", levels=11)),
        # The same with 9 levels backward: 16.5x / 8.6x at 2 x 256-token micro-batches (the moonshot's bytes).
        "aqsgd-codebook3 fw/codebook9 bw": (AQSGD_TERNARY, Compression("hadamard_codebook", levels=9)),
        # Toward the stretch of 32x both ways (under 1 bit a value with every scale counted, which no
        # code that sends every value reaches): ternary both ways (15.7x at 2 x 128 tokens), and the one
        # registered codec that goes below a bit, topk_quantize (8% of each 128-value chunk at 2 bits: 35.3x).
        "aqsgd-codebook3 fw/codebook3 bw": (AQSGD_TERNARY, TERNARY),
        "topk_quantize 8% 2-bit fw/bw": (Compression("topk_quantize", ratio=0.08, bits=2),
                                         Compression("topk_quantize", ratio=0.08, bits=2)),
        # Under one bit a value by vector quantization (every value sent): 33.6x both ways at 2 x 128
        # tokens, AQ-SGD's deltas and its first epoch included.
        "aqsgd-vq64 fw/vq64 bw": (AQSGD_VQ64, VQ64),
        # Which direction costs the quality: each with the other at the ternary code (15.7x).
        "aqsgd-vq64 fw/codebook3 bw": (AQSGD_VQ64, TERNARY),
        "aqsgd-codebook3 fw/vq64 bw": (AQSGD_TERNARY, VQ64),
        # The forward's first epoch is what costs at 4 stages: a 1-bit one, paid for by cheaper deltas.
        "aqsgd-vq128-nosink (first epoch vq256) fw/vq64 bw": (AQSGD_VQ128_NOSINK, VQ64),
        "aqsgd-vq64-nosink (first epoch vq256) fw/vq64 bw": (AQSGD_VQ64_NOSINK, VQ64),
        # Which of the two changes costs: the 1-bit first epoch alone, deltas with the sink and mean apart.
        "aqsgd-vq64 (first epoch vq256) fw/vq64 bw": (AQSGD_VQ64_FIRST256, VQ64),
        # The massive channel apart: 32-word deltas after a 64-word first epoch (34.6x over the run),
        # and 64 words throughout (31.7x, under the stretch's bytes: which part the outlier buys).
        "aqsgd-vq32o1 (first epoch vq64o1) fw/vq64 bw": (AQSGD_VQ32_O1, VQ64),
        "aqsgd-vq64o1 fw/vq64 bw": (AQSGD_VQ64_O1, VQ64),
        # A ternary first epoch, the second reusing the memory, deltas in the third (33.5x / 32.1x
        # forward over the run), and no delta at all (47.1x, a diagnostic).
        "aqsgd-vq32 refresh 2 (first epoch codebook3) fw/vq64 bw": (AQSGD_VQ32_REFRESH2, VQ64),
        "aqsgd-vq64 refresh 2 (first epoch codebook3) fw/vq64 bw": (AQSGD_VQ64_REFRESH2, VQ64),
        "aqsgd refresh 3 (first epoch codebook3) fw/vq64 bw": (AQSGD_TERNARY_REFRESH3, VQ64),
        # A ternary first epoch, then rank-4 deltas of the drift alone (34.8x forward over the run),
        # and rank-4 deltas against the receiver's memory (AQ-SGD's own, the same bytes: a diagnostic).
        "aqsgd-lowrank4 drift (first epoch codebook3) fw/vq64 bw": (AQSGD_LOWRANK4_DRIFT, VQ64),
        "aqsgd-lowrank4 (first epoch codebook3) fw/vq64 bw": (AQSGD_LOWRANK4, VQ64),
        # Per boundary (4 stages): the forward of FORWARD_AT[name] at its boundaries, exact elsewhere.
        **{name: (Compression(), VQ64) for name in FORWARD_AT},
        # AQ-SGD whose deltas go through hadamard_outliers (quantize's groups break on massive values).
        "aqsgd-h_o fw4/bw8 warm-up h_o4": (_aqsgd_outliers(4), q(8)),
        "aqsgd-h_o fw2/bw4 warm-up h_o4": (_aqsgd_outliers(2), q(4)),
    }


def _aqsgd_outliers(bits: int) -> Compression:
    return Compression("aqsgd", inner="hadamard_outliers", bits=bits, first_visit=Compression("hadamard_outliers", bits=4))


def train_simulated(model, forward: Compression, backward: Compression, stages: int, seed: int, train, args,
                    evaluate, tie: Compression | None = None, forward_at: dict[int, Compression] | None = None) -> dict:
    """`model` fine-tuned through the stages of a plan (`simulate`, GPipe, AQ-SGD memory for the
    training rows, `tie` its `tie_compression`, `forward_at` per-boundary forwards), AdamW, the
    seed's batch order: its plan, training curve, `evaluate()` after each epoch (plain inference),
    seconds, the boundary bytes sent / uncompressed, and the compressed tie's bytes sent (0 when
    exact: `simulate` sends none then)."""
    boundaries = None
    if forward_at:
        if max(forward_at) >= stages - 1:
            raise SystemExit(f"forward overrides at boundaries {sorted(forward_at)} need more than {stages} stages")
        boundaries = [{"forward": forward_at[b]} if b in forward_at else None for b in range(stages - 1)]
    plan = Plan(num_stages=stages, micro_batches=args.micro_batches, schedule="gpipe", forward=forward,
                backward=backward, memory=MemoryConfig(num_samples=len(train), store="host", dtype="fp16"),
                tie_compression=tie, boundaries=boundaries)
    sim = hf_actcomp.simulate(model, plan)
    optimizer = torch.optim.AdamW(sim.parameters(), lr=args.lr)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        collate_fn=default_data_collator, generator=torch.Generator().manual_seed(seed))
    start = time.perf_counter()
    curve, epochs = train_epochs(sim, loader, optimizer, args.epochs, evaluate)
    seconds = time.perf_counter() - start
    stats = sim.stats()
    boundary = [stats["categories"][c] for c in ("activations", "activation_gradients")]
    tie_traffic = stats["categories"].get("tie", {})  # only with a tie_compression
    model.eval()
    return {"plan": plan, "curve": curve, "epochs": epochs, "seconds": seconds,
            "sent": sum(c["bytes_sent"] for c in boundary), "raw": sum(c["bytes_uncompressed"] for c in boundary),
            "forward_compression_ratio": boundary[0]["compression_ratio"],
            "backward_compression_ratio": boundary[1]["compression_ratio"],
            "tie_sent": tie_traffic.get("bytes_sent", 0), "tie_raw": tie_traffic.get("bytes_uncompressed", 0)}


def finetune(name: str, stages: int, seed: int, data, args) -> dict:
    train, held_out = data
    forward, backward = settings()[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(smollm2.smollm2_dir(), dtype=torch.float32)
    evaluation = DataLoader(held_out, batch_size=8, collate_fn=default_data_collator)
    # The epochs' eval losses with plain inference: the trained weights, no boundary codec.
    tie = TIES.get(name)
    run = train_simulated(model, forward, backward, stages, seed, train, args, lambda: eval_loss(model, evaluation),
                          tie, FORWARD_AT.get(name))
    plan, curve, epoch_eval, seconds, sent, raw = (run[k] for k in ("plan", "curve", "epochs", "seconds", "sent", "raw"))
    with hf_actcomp.compressed_inference(model, plan) as inf:
        inference_form = eval_loss(inf, evaluation)
    forward_label = " / ".join(plan.forward_at(b).describe() for b in range(stages - 1)) if plan.per_boundary \
        else forward.describe()
    row = {"setting": name, "stages": stages, "seed": seed, "forward": forward_label,
           "backward": backward.describe(), "tie": describe_tie(tie),
           "eval_loss": epoch_eval[-1], "epoch_eval_loss": epoch_eval,
           "eval_loss_inference_form": inference_form,
           "inference_form": plan.forward.inference if isinstance(plan.forward.inference, str) else "explicit",
           "bytes_per_step": sent / len(curve), "bytes_per_step_uncompressed": raw / len(curve),
           "compression_ratio": raw / sent if sent else 1.0,
           **{k: run[k] for k in ("forward_compression_ratio", "backward_compression_ratio")},
           "train_curve": curve, "seconds": seconds}
    if tie is not None:  # the tie's rows apart from the boundary traffic (as the toy study's files)
        row.update(tie_bytes_per_step=run["tie_sent"] / len(curve),
                   tie_bytes_per_step_uncompressed=run["tie_raw"] / len(curve))
    print(f"S={stages} seed {seed} {name:28s} eval {row['eval_loss']:.4f} (inference form {inference_form:.4f}) "
          f"{row['bytes_per_step'] / 1e6:6.3f} MB/step {row['compression_ratio']:5.1f}x {seconds:5.0f} s", flush=True)
    return row


def summarise(rows: list[dict]) -> list[dict]:
    """Per (stages, setting): median [range] over seeds, and the gap to `none` of the same seed."""
    base = {(r["stages"], r["seed"]): r["eval_loss"] for r in rows if r["setting"] == "none"}
    out = []
    for stages, name in dict.fromkeys((r["stages"], r["setting"]) for r in rows):
        mine = [r for r in rows if r["stages"] == stages and r["setting"] == name]
        gap_by_seed = {r["seed"]: 100 * (r["eval_loss"] / base[stages, r["seed"]] - 1) for r in mine
                       if (stages, r["seed"]) in base}
        gaps = list(gap_by_seed.values())
        form = [100 * (r["eval_loss_inference_form"] / base[stages, r["seed"]] - 1) for r in mine
                if (stages, r["seed"]) in base]
        losses = [r["eval_loss"] for r in mine]
        out.append({"stages": stages, "setting": name, "forward": mine[0]["forward"], "backward": mine[0]["backward"],
                    "tie": mine[0].get("tie", "exact"),
                    "seeds": sorted(r["seed"] for r in mine), "eval_loss": statistics.median(losses),
                    "eval_loss_min": min(losses), "eval_loss_max": max(losses),
                    "gap": statistics.median(gaps) if gaps else None, "gap_min": min(gaps) if gaps else None,
                    "gap_max": max(gaps) if gaps else None, "gap_by_seed": gap_by_seed,
                    "gap_inference_form": statistics.median(form) if form else None,
                    "bytes_per_step": statistics.median(r["bytes_per_step"] for r in mine),
                    "compression_ratio": statistics.median(r["compression_ratio"] for r in mine),
                    **direction_ratios(mine),
                    "tie_bytes_per_step": statistics.median(r["tie_bytes_per_step"] for r in mine)
                    if "tie_bytes_per_step" in mine[0] else None,
                    "seconds": statistics.median(r["seconds"] for r in mine)})
    return out


def direction_ratios(rows: list[dict]) -> dict:
    """The forward and backward ratios (measured, each direction's bytes), median over the rows
    of `rows` that record them (rows run before they were recorded have none; a setting's bytes
    differ between seeds only by the batches' padding); none if no row does."""
    keys = ("forward_compression_ratio", "backward_compression_ratio")
    measured = [r for r in rows if all(k in r for k in keys)]
    return {k: statistics.median(r[k] for r in measured) if measured else None for k in keys}


def describe(meta: dict) -> str:
    """The continued-training run's settings, for the results file's opening paragraph."""
    a = meta["args"]
    return (f"`benchmarks/real_model_finetune.py`: SmolLM2-135M-Instruct (fp32, from its Q4_1 GGUF) continued on "
            f"{meta['train_blocks']} blocks of {a['seq_len']} tokens of stdlib source for {a['epochs']} epochs, batch "
            f"{a['batch_size']} in {a['micro_batches']} micro-batches, AdamW lr {a['lr']}, `simulate` (one process) "
            f"at the default split; eval: {meta['eval_blocks']} held-out blocks (plain eval loss of the model before "
            f"fine-tuning {meta['eval_loss_before']:.4f}).")


def write(rows: list[dict], meta: dict, name: str, title: str = "Fine-tuning SmolLM2-135M through compressed "
          "boundaries", description: str | None = None) -> None:
    """`results/{name}.json` (rows and their summary) and `.md` (the summary as a table)."""
    summary = summarise(rows)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1)
    lines = [
        f"# {title}",
        "",
        f"{description or describe(meta)} Per seed the same batches in the same order for every setting; "
        "median [min-max] over seeds; gap: against `none` of the same seed and stage count. 'inference form': the "
        "eval loss through the plan's default inference form (`compressed_inference`, `inference=\"auto\"`). "
        f"{meta['machine']}.",
        "",
        "| stages | setting | fw | bw | tie | seeds | eval loss | gap vs none | through the inference form | MB/step "
        "| vs fp32 | fw / bw vs fp32 | tie MB/step | s/run |",
        "|---:|---|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        gap = "-" if s["setting"] == "none" or s["gap"] is None else \
            f"{s['gap']:+.2f}% [{s['gap_min']:+.2f}, {s['gap_max']:+.2f}]"
        form = "-" if s["gap_inference_form"] is None else f"{s['gap_inference_form']:+.2f}%"
        tie_mb = "-" if s.get("tie_bytes_per_step") is None else f"{s['tie_bytes_per_step'] / 1e6:.3f}"
        ways = "-" if s.get("forward_compression_ratio") is None else \
            f"{s['forward_compression_ratio']:.1f}x / {s['backward_compression_ratio']:.1f}x"
        lines.append(f"| {s['stages']} | {s['setting']} | {s['forward']} | {s['backward']} | {s.get('tie', 'exact')} | "
                     f"{len(s['seeds'])} | {s['eval_loss']:.4f} [{s['eval_loss_min']:.4f}-{s['eval_loss_max']:.4f}] | "
                     f"{gap} | {form} | {s['bytes_per_step'] / 1e6:.3f} | {s['compression_ratio']:.1f}x | {ways} | {tie_mb} | "
                     f"{s['seconds']:.0f} |")
    write_markdown(RESULTS, name, lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_blocks", type=int, default=24)
    p.add_argument("--eval_blocks", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=128)
    add_grid_arguments(p, "real_model_finetune", epochs=3, settings=f"all but {list(STRETCH)}")
    args = p.parse_args(argv)
    model, tokenizer = smollm2.load()
    data = smollm2.stdlib_blocks(tokenizer, args.seq_len, args.train_blocks, args.eval_blocks)
    del model
    keep = ("train_blocks", "eval_blocks", "seq_len", "epochs", "batch_size", "micro_batches", "lr")

    def before() -> float:
        model = smollm2.load()[0]
        return eval_loss(model, DataLoader(data[1], batch_size=8, collate_fn=default_data_collator))

    run_grid(p, args, args.settings or [n for n in settings() if n not in STRETCH], settings(), keep,
             {"train_blocks": len(data[0]), "eval_blocks": len(data[1])}, before,
             lambda name, stages, seed: finetune(name, stages, seed, data, args),
             lambda rows, meta: write(rows, meta, args.name))


def add_grid_arguments(p: argparse.ArgumentParser, name: str, epochs: int, settings: str) -> None:
    """The options every real-model quality benchmark takes: the grid, the optimizer, the file."""
    add_arguments(p, seeds=[0, 1, 2], epochs=epochs, batch_size=4, micro_batches=2, lr=3e-5,
                  merge=(False, "add to the saved rows (same data settings)"))
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--settings", nargs="+", default=None, help="labels (default: " + settings.replace("%", "%%") + ")")  # argparse formats help with %
    p.add_argument("--name", default=name)


def run_grid(parser, args, names: list[str], allowed, keep: tuple[str, ...], sizes: dict, before, run, write_rows,
             before_key: str = "eval_loss_before") -> None:
    """Every (stages, seed, setting) of `args`, each row written as it lands; with `--merge` the
    saved rows of `results/{args.name}.json` stay unless re-run (refused when `keep`'s data
    settings differ from the saved run's). `before()`, the model's figure before fine-tuning, is
    recorded in the results' meta as `before_key`."""
    import platform

    unknown = sorted(set(names) - set(allowed))
    if unknown:
        parser.error(f"--settings {unknown}: allowed {list(allowed)}")
    if "none" not in names and not args.merge:
        parser.error("--settings must include 'none' (every gap is against it), or add to a saved run with --merge")
    rows: list[dict] = []
    path = os.path.join(RESULTS, f"{args.name}.json")
    if args.merge and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if any(saved["meta"]["args"][k] != vars(args)[k] for k in keep):
            raise SystemExit(f"--merge needs the saved settings {({k: saved['meta']['args'][k] for k in keep})}")
        rows = saved["rows"]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    meta = {"args": vars(args), **sizes, before_key: before(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"}
    for stages in args.stages:
        for seed in args.seeds:
            for name in names:
                rows = [r for r in rows if (r["stages"], r["seed"], r["setting"]) != (stages, seed, name)]
                rows.append(run(name, stages, seed))
                write_rows(rows, meta)


if __name__ == "__main__":
    main()
