"""Peak memory and load time of per-stage loading against a full `from_pretrained`, in one run.

Saves a randomly initialised Llama-style model of about 1.1B parameters (TinyLlama's shape,
bf16, safetensors shards of 500 MB), then measures, each in a fresh process:

- `empty`: a process that imports torch, transformers and hf_actcomp and loads nothing (the
  fixed runtime overhead);
- `full`: `AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16)`;
- `stage s/S`: what one rank of an S-stage pipeline loads, `load_stage_model(dir, plan,
  stage=s, torch_dtype=bfloat16)` (the skeleton on the meta device, this stage's tensors read
  from the shards), then the stage module built from it, for S = 2 and 4.

safetensors memory-maps the shards, so a load reads nothing until a tensor is used: each case
therefore reads every tensor it holds once (a sum over it, as a first forward would) before it
is measured. Peak RSS is the process's `VmHWM` (/proc/self/status: `ru_maxrss` would carry the parent's
peak across fork and exec); load time is the wall time of the load and that first read. The
cases run `--repeats` times in alternating order after one untimed warm-up read of the shards
(so every case sees the page cache warm); the table gives medians and ranges. The goal checked
in the last column: peak RSS <= 1.3 x the stage's bytes + the empty process's peak.

    .venv/bin/python benchmarks/memory.py [--repeats 3] [--workdir /tmp/actcomp-memory]

Writes benchmarks/results/memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHAPE = dict(  # TinyLlama-1.1B's shape
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
STAGES = (2, 4)


def measure(case: str, directory: str, stage: int, num_stages: int) -> dict:
    """Run one case in this process and return its figures (called in a fresh subprocess)."""
    import torch
    import transformers  # noqa: F401  (the empty case imports what the others do)

    import hf_actcomp
    from hf_actcomp.models import get_adapter
    from hf_actcomp.models.split import stage_ranges
    from hf_actcomp.pipeline.loading import load_stage_model

    out: dict = {"case": case, "stage": stage, "num_stages": num_stages}
    start = time.perf_counter()
    if case == "full":
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        out["held_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    elif case == "stage":
        plan = hf_actcomp.Plan(num_stages=num_stages)
        model = load_stage_model(directory, plan, stage=stage, torch_dtype=torch.bfloat16)
        adapter = get_adapter(model)
        r = stage_ranges(adapter, plan)[stage]
        module = adapter.build_stage(r.start, r.stop, first=stage == 0, last=stage == num_stages - 1)
        out["held_bytes"] = sum(p.numel() * p.element_size() for p in module.parameters())
        out["blocks"] = [r.start, r.stop]
    held = model.parameters() if case == "full" else module.parameters() if case == "stage" else []
    for p in held:  # safetensors maps the files: read every held byte once, as a first forward would
        torch.sum(p)
    out["load_s"] = time.perf_counter() - start
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def peak_rss_bytes() -> int:
    """This process image's peak resident set (VmHWM), reset by exec unlike ru_maxrss."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("VmHWM not in /proc/self/status (Linux only)")


def run_case(case: str, directory: str, stage: int = 0, num_stages: int = 1) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", case, "--workdir", directory,
           "--stage", str(stage), "--num-stages", str(num_stages)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def save_model(directory: str) -> int:
    import torch
    import transformers

    config = transformers.LlamaConfig(**SHAPE)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="500MB")
    return sum(p.numel() for p in model.parameters())


def warm_page_cache(directory: str) -> None:
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            while f.read(1 << 24):
                pass


def summarise(runs: list[dict]) -> dict:
    def stats(key: str) -> dict:
        values = [r[key] for r in runs]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {"load_s": stats("load_s"), "peak_rss_bytes": stats("peak_rss_bytes"),
            "held_bytes": runs[0].get("held_bytes", 0), "blocks": runs[0].get("blocks")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/actcomp-memory")
    parser.add_argument("--measure", choices=["empty", "full", "stage", "save"], help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--num-stages", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure == "save":  # in a child, so that the parent stays small
        print(json.dumps({"num_parameters": save_model(args.workdir)}))
        return
    if args.measure:
        print(json.dumps(measure(args.measure, args.workdir, args.stage, args.num_stages)))
        return

    directory = os.path.join(args.workdir, "llama-1b")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    print(f"saving a random {SHAPE['num_hidden_layers']}-layer Llama-style model to {directory} ...", flush=True)
    num_params = run_case("save", directory)["num_parameters"]
    checkpoint_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    warm_page_cache(directory)

    cases = [("empty", 0, 1), ("full", 0, 1)] + [("stage", s, n) for n in STAGES for s in range(n)]
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        order = cases if repeat % 2 == 0 else cases[::-1]
        for case, stage, num_stages in order:
            key = case if case != "stage" else f"stage {stage}/{num_stages}"
            print(f"repeat {repeat + 1}/{args.repeats}: {key}", flush=True)
            runs.setdefault(key, []).append(run_case(case, directory, stage, num_stages))
    summary = {key: summarise(r) for key, r in runs.items()}
    overhead = summary["empty"]["peak_rss_bytes"]["median"]
    for key, s in summary.items():
        if key.startswith("stage"):
            s["goal_bytes"] = 1.3 * s["held_bytes"] + overhead
            s["meets_goal"] = s["peak_rss_bytes"]["median"] <= s["goal_bytes"]
            s["excess_over_held"] = (s["peak_rss_bytes"]["median"] - overhead) / s["held_bytes"]
    result = {
        "model": {"shape": SHAPE, "num_parameters": num_params, "dtype": "bfloat16",
                  "checkpoint_bytes": checkpoint_bytes, "shard_size": "500MB"},
        "repeats": args.repeats,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "cases": summary,
        "runs": runs,
    }
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "memory.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    table = render(result)
    with open(os.path.join(RESULTS, "memory.md"), "w", encoding="utf-8") as f:
        f.write(table)
    print(table)


def render(result: dict) -> str:
    gib = 1 << 30
    m = result["model"]
    lines = [
        f"# Per-stage loading: peak RSS and load time ({m['num_parameters'] / 1e9:.2f}B-parameter Llama-style "
        f"model, {m['dtype']}, {m['checkpoint_bytes'] / gib:.2f} GiB in {m['shard_size']} shards)",
        "",
        f"Each case in a fresh process, {result['repeats']} repeats in alternating order, page cache warm; "
        "median [min-max]. Goal: peak RSS <= 1.3 x held bytes + the empty process's peak.",
        "",
        "| case | blocks | held (GiB) | peak RSS (GiB) | (peak - empty) / held | load (s) | goal met |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for key, s in result["cases"].items():
        rss, load = s["peak_rss_bytes"], s["load_s"]
        blocks = "-" if not s.get("blocks") else f"{s['blocks'][0]}-{s['blocks'][1] - 1}"
        ratio = f"{s['excess_over_held']:.2f}" if "excess_over_held" in s else "-"
        goal = {True: "yes", False: "no"}.get(s.get("meets_goal"), "-")
        lines.append(
            f"| {key} | {blocks} | {s['held_bytes'] / gib:.2f} | {rss['median'] / gib:.2f} "
            f"[{rss['min'] / gib:.2f}-{rss['max'] / gib:.2f}] | {ratio} | {load['median']:.2f} "
            f"[{load['min']:.2f}-{load['max']:.2f}] | {goal} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
