"""`simulate(..., compile=True)` against eager: training step time on this CPU, compile time, losses.

Two models, both random init, vocabulary 1024, sequences of 128 tokens, batch 8, dropout 0 (with
dropout, inductor draws its own random masks, so the losses would differ by the masks):

- `gpt2-recipe`: the recipes' `offline-gpt2` (4 layers, hidden 128, 4 heads, tied head);
- `llama-384x6`: a Llama with 6 layers, hidden 384, 6 heads (2 KV heads), MLP 1024, untied head.

The recipes' plan (recipes/configs/plan_aqsgd_fw4_bw8.yaml: 2 stages, 2 micro-batches, AQ-SGD
forward 4 bits, quantize backward 8 bits) over `--samples` random-token rows (an epoch is
samples / batch steps), AdamW, clipping at 1.0, in one process with one CPU thread. Each run is a
fresh process (benchmarks/compile_worker.py); per round and model one eager and one compiled run,
the order alternating between rounds. Steady state: the median step after `--warmup` steps (the
compile and AQ-SGD's first epoch). Compile overhead: the warm-up steps' time beyond as many steady
steps. All runs share one inductor cache, empty at the start: round 0 compiles cold, later rounds
find the compiled kernels cached (what a second run of a training script gets).

    .venv/bin/python benchmarks/compile.py                  # 3 rounds, ~4-6 minutes
    .venv/bin/python benchmarks/compile.py --rewrite        # the .md again from the .json

Writes benchmarks/results/compile.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
import yaml
from harness import (
    add_arguments,
    busy_cpu_seconds,
    loadavg,
    median,
    wait_until_quiet,
    write_markdown,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKER = os.path.join(ROOT, "benchmarks", "compile_worker.py")
PLAN = os.path.join(ROOT, "recipes", "configs", "plan_aqsgd_fw4_bw8.yaml")
VOCAB = 1024
MODELS = {
    "gpt2-recipe": ("gpt2", dict(vocab_size=VOCAB, n_positions=128, n_embd=128, n_layer=4, n_head=4,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                 bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)),
    "llama-384x6": ("llama", dict(vocab_size=VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                  attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
}
VARIANTS = ("eager", "compiled")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, rounds=3, steps=(16, "training steps per run"),
                  warmup=(4, "steps left out of the steady state"), seq_len=128,
                  quiet_wait=(30.0, "the longest such wait, seconds"), timeout=(600.0, "seconds per run"),
                  quiet=(0.5, "before each run, wait until the machine's CPUs were at most this busy over 3 s (0: never)"),
                  rewrite=(False, "rewrite the .md from the saved .json, running nothing"))
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--mode", default=None, help="torch.compile's mode (default: its default)")
    p.add_argument("--name", default="compile")
    return p.parse_args(argv)


def run_one(spec: dict, env: dict, timeout: float) -> dict:
    """One worker process; its results, the wall seconds of the whole process and the share of
    the machine's CPUs that other processes used meanwhile."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        busy, start = busy_cpu_seconds()[0], time.monotonic()
        before = os.times()
        subprocess.run([sys.executable, WORKER, "--spec", json.dumps(spec), "--out", out], env=env,
                       check=True, timeout=timeout)
        after, wall = os.times(), time.monotonic() - start
        own = (after.children_user + after.children_system) - (before.children_user + before.children_system)
        with open(out) as f:
            row = json.load(f)
    row["process_seconds"] = wall
    row["other_cpu_share"] = max(busy_cpu_seconds()[0] - busy - own, 0.0) / (os.cpu_count() * wall)
    return row


def steady(row: dict, warmup: int) -> dict:
    """Milliseconds per step after the warm-up (median, and the CPU time's median); the warm-up
    steps' seconds beyond as many steady steps (the compile, for a compiled run)."""
    step = median(row["wall"][warmup:])
    return {"ms": 1e3 * step, "cpu_ms": 1e3 * median(row["cpu"][warmup:]),
            "first_step_s": row["wall"][0], "overhead_s": sum(row["wall"][:warmup]) - warmup * step,
            "graphs": row["graphs"]}


def spread(values: list[float]) -> list[float]:
    return [median(values), min(values), max(values)]


def summarize(rows: list[dict], warmup: int) -> dict:
    out = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        runs: dict = {}
        for r in rows:
            if r["model"] == model:
                runs.setdefault(r["round"], {})[r["variant"]] = r
        rounds = [runs[k] for k in sorted(runs)]
        s = {v: [steady(r[v], warmup) for r in rounds] for v in VARIANTS}
        diffs = [max(abs(a - b) for a, b in zip(r["eager"]["losses"], r["compiled"]["losses"], strict=True))
                 for r in rounds]
        rel = [max(abs(a - b) / abs(a) for a, b in zip(r["eager"]["losses"], r["compiled"]["losses"], strict=True))
               for r in rounds]
        out[model] = {
            **{f"{v}_ms": spread([x["ms"] for x in s[v]]) for v in VARIANTS},
            **{f"{v}_cpu_ms": spread([x["cpu_ms"] for x in s[v]]) for v in VARIANTS},
            "speedup": spread([e["ms"] / c["ms"] for e, c in zip(s["eager"], s["compiled"], strict=True)]),
            "cpu_speedup": spread([e["cpu_ms"] / c["cpu_ms"] for e, c in zip(s["eager"], s["compiled"], strict=True)]),
            "compile_cold_s": s["compiled"][0]["overhead_s"],
            "compile_warm_s": spread([x["overhead_s"] for x in s["compiled"][1:]]) if len(rounds) > 1 else None,
            "eager_warmup_s": spread([x["overhead_s"] for x in s["eager"]]),
            "graphs": spread([x["graphs"] for x in s["compiled"]]),
            "loss_diff": max(diffs), "loss_rel_diff": max(rel),
            "last_loss": rounds[0]["eager"]["losses"][-1],
            "parameters": rounds[0]["eager"]["parameters"],
            "other_cpu_share": spread([r[v]["other_cpu_share"] for r in rounds for v in VARIANTS]),
            "rounds": [{v: s[v][k] | {"other_cpu_share": rounds[k][v]["other_cpu_share"]} for v in VARIANTS}
                       | {"first": rounds[k]["eager"]["first"]} for k in range(len(rounds))],
        }
    return out


def ms(v: list[float]) -> str:
    return f"{v[0]:.1f} [{v[1]:.1f}-{v[2]:.1f}]"


def times(v: list[float]) -> str:
    return f"{v[0]:.2f}x [{v[1]:.2f}-{v[2]:.2f}]"


def write(results: dict, meta: dict, name: str) -> list[str]:
    a = meta["args"]
    lines = [
        "# `torch.compile` of the stages' blocks: simulate() training steps on this CPU", "",
        f"benchmarks/compile.py: `simulate(model, plan, compile=True)` (backend {a['backend']}, mode "
        f"{a['mode'] or 'default'}) against eager, plan {meta['plan_text']}; batch {a['batch']} x {a['seq_len']} "
        f"tokens over {a['samples']} random-token rows, AdamW, clipping at 1.0, dropout 0; {a['steps']} steps per "
        f"run, the steady state after {a['warmup']} steps; one process per run with 1 CPU thread; {a['rounds']} "
        "rounds, eager first in even rounds, compiled first in odd ones. Median [range] over the rounds; the "
        "speed-up (eager / compiled step time) is taken within each round.", "",
        "| model | parameters | eager ms/step | compiled ms/step | speed-up (wall) | CPU ms/step eager / compiled | "
        "speed-up (CPU) | compile s, cold cache | compile s, warm cache | graphs | max abs (rel) loss difference |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, s in results.items():
        warm = ms(s["compile_warm_s"]) if s["compile_warm_s"] else ""
        lines.append(
            f"| {model} | {s['parameters'] / 1e6:.2f} M | {ms(s['eager_ms'])} | {ms(s['compiled_ms'])} | "
            f"{times(s['speedup'])} | "
            f"{s['eager_cpu_ms'][0]:.1f} / {s['compiled_cpu_ms'][0]:.1f} | {times(s['cpu_speedup'])} | "
            f"{s['compile_cold_s']:.1f} | {warm} | "
            f"{s['graphs'][0]:.0f} | {s['loss_diff']:.1e} ({s['loss_rel_diff']:.1e}) |")
    lines += ["", "Per round, wall / CPU ms per steady step, the compile seconds, and the share of the machine's "
              "CPUs other processes used during the run:", "",
              "| model | round | first | eager | compiled | compile s | other CPU eager / compiled |",
              "|---|---|---|---|---|---|---|"]
    for model, s in results.items():
        for k, r in enumerate(s["rounds"]):
            e, c = r["eager"], r["compiled"]
            lines.append(f"| {model} | {k} | {r['first']} | {e['ms']:.1f} / {e['cpu_ms']:.1f} | {c['ms']:.1f} / "
                         f"{c['cpu_ms']:.1f} | {c['overhead_s']:.1f} | {100 * e['other_cpu_share']:.0f}% / "
                         f"{100 * c['other_cpu_share']:.0f}% |")
    lines += ["", "Compile s: the warm-up steps' time beyond as many steady steps (eager runs: "
              + ", ".join(f"{m} {s['eager_warmup_s'][0]:.2f} s" for m, s in results.items())
              + "); cold: round 0, the inductor cache empty; warm: later rounds, kernels cached on disk (dynamo "
              "still traces). Graphs: what dynamo compiled in a run (the blocks of a model share them). Loss "
              "difference: the largest over the steps of a round, compiled against eager from the same "
              "initialisation and data (the same in every round); AQ-SGD's 4-bit rounding can turn the blocks' "
              "last-bit differences into a different rounding, carried into later steps (with the identity "
              "codec tests/test_compile.py finds at most 5e-7 in a loss). The wall clock counts the other "
              "processes' load on this shared 2-CPU machine; the CPU time (this process's, one thread) does not, "
              "and is the steadier comparison where a round's other-CPU share is high.", "",
              f"Machine: {meta['machine']}. Load (/proc/loadavg, 1/5/15 min) before: {meta['loadavg_before']}; "
              f"after: {meta['loadavg_after']}. Other processes used "
              f"{100 * min(s['other_cpu_share'][1] for s in results.values()):.0f}-"
              f"{100 * max(s['other_cpu_share'][2] for s in results.values()):.0f}% of the {meta['cpus']} CPUs "
              f"during the runs (the machine's busy CPU time minus ours). Wall time of the benchmark: "
              f"{meta['wall_seconds'] / 60:.1f} min."]
    write_markdown(RESULTS, name, lines)
    return lines


def _plan_text(plan: dict) -> str:
    f, b = plan["forward"], plan["backward"]
    return (f"{plan['num_stages']} stages, {plan.get('micro_batches', 1)} micro-batches, {plan.get('schedule')}, "
            f"forward {f['method']} {f.get('bits', '')} bits, backward {b['method']} {b.get('bits', '')} bits")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rewrite:
        with open(os.path.join(RESULTS, f"{args.name}.json")) as f:
            saved = json.load(f)
        write(summarize(saved["rows"], saved["meta"]["args"]["warmup"]), saved["meta"], args.name)
        return
    with open(PLAN, encoding="utf-8") as f:
        plan = yaml.safe_load(f)
    compile_kwargs = {"backend": args.backend, **({"mode": args.mode} if args.mode else {})}
    before, start = loadavg(), time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf_actcomp_inductor_") as cache:
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache)
        for k in range(args.rounds):
            order = VARIANTS if k % 2 == 0 else VARIANTS[::-1]
            for model in args.models:
                family, config = MODELS[model]
                for variant in order:
                    if args.quiet:
                        wait_until_quiet(args.quiet, longest=args.quiet_wait)
                    spec = {"family": family, "config": config, "plan": plan, "seed": 0, "samples": args.samples,
                            "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
                            "compile": variant == "compiled", "compile_kwargs": compile_kwargs}
                    row = run_one(spec, env, args.timeout)
                    rows.append({"model": model, "round": k, "variant": variant, "first": order[0], **row})
                    print(f"round {k} {model} {variant}: {1e3 * median(row['wall'][args.warmup:]):.1f} ms/step, "
                          f"first step {row['wall'][0]:.1f} s, loss {row['losses'][-1]:.4f}", flush=True)
    meta = {"args": vars(args), "plan_text": _plan_text(plan), "loadavg_before": before, "loadavg_after": loadavg(),
            "wall_seconds": time.monotonic() - start, "cpus": os.cpu_count(), "torch": torch.__version__,
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
            "package": rows[0]["package"]}
    results = summarize(rows, args.warmup)
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "summaries": results}, f)
    write(results, meta, args.name)


if __name__ == "__main__":
    main()
