"""Data-parallel gradient hooks side by side: bytes, hook time, step time and loss.

The peer is what a user gets without us: DDP with no communication hook (torch's built-in
all-reduce, overlapped with the backward). Every speed-up is against it, on the same link.
For 2 and 4 workers, the same small GPT-2 (2 layers x 256, vocabulary 1024) from the same
initialisation, on disjoint shards of the offline corpus:
(1) step times on loopback and (2) on a star network of network namespaces whose links `tc`
shapes to `--rate` Mbit/s: `--repeats` rounds of `--steps` timed steps per method, each round
in a different order; median and min-max per method;
(3) on loopback, `--loss_steps` training steps per method and the eval loss.
Needs root (namespaces, tc); everything created is named after the pid and removed at the end.

    sudo .venv/bin/python benchmarks/dp_hooks.py                 # 2 and 4 workers, 100 Mbit/s
    .venv/bin/python benchmarks/dp_hooks.py --rewrite            # the .md again from the .json

Writes benchmarks/results/dp_hooks.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from dp_hooks_worker import PEER, TIMED_WARMUP
from harness import StarNetwork, add_arguments, median, ratio_spread, run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKER = os.path.join(ROOT, "benchmarks", "dp_hooks_worker.py")


def summarize(rows: list[dict], args) -> list[dict]:
    """One summary per (workers, method): medians and min-max of the timed rounds, speed-ups
    against the peer (DDP with no hook) on the same link, the loss run's eval loss."""
    out = []
    links = ("loopback", f"{args.rate} Mbit/s")
    for workers in args.workers:
        timed = {link: {r["label"]: r for r in rows if r["workers"] == workers and r["link"] == link} for link in links}
        loss = {r["label"]: r for r in rows if r["workers"] == workers and r["link"] == "loss"}
        for label, shaped in timed[links[1]].items():
            s = dict(workers=workers, label=label, hook=shaped["hook"], timed_params=shaped["params"],
                     byte_ratio=median(shaped["byte_ratio"]), bytes_per_step=median(shaped["bytes_per_step"]))
            hook_seconds = timed["loopback"][label]["hook_seconds_per_step"]
            s["hook_ms_loopback"] = None if None in hook_seconds else 1e3 * median(hook_seconds)
            for key, link in zip(("loopback", "shaped"), links, strict=True):
                mine, peer = timed[link][label]["seconds_per_step"], timed[link][PEER]["seconds_per_step"]
                s[f"step_ms_{key}"] = 1e3 * median(mine)
                s[f"step_ms_{key}_min"], s[f"step_ms_{key}_max"] = 1e3 * min(mine), 1e3 * max(mine)
                s[f"speedup_{key}"], s[f"speedup_{key}_min"], s[f"speedup_{key}_max"] = ratio_spread(peer, mine)
            if label in loss:
                s.update(eval_loss=loss[label]["eval_loss"], loss_run_byte_ratio=loss[label]["byte_ratio"],
                         loss_params=loss[label]["params"])
            out.append(s)
    return out


def write(rows: list[dict], args) -> None:
    summary = summarize(rows, args)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "dp_hooks.json"), "w") as f:
        json.dump({"args": vars(args), "summary": summary, "rows": rows}, f, indent=1)
    timed = [r for r in rows if r["link"] != "loss"]
    other = max(max(r["other_cpu_share"]) for r in timed)
    parameters = rows[0]["parameters"]
    lines = [
        f"GPT-2 style, 2 layers x 256, vocabulary 1024 ({parameters / 1e6:.1f} M parameters); batch "
        f"{args.batch_size} x {args.seq_len} tokens per worker; SGD lr {args.lr} (momentum 0.9; DGC: its own "
        "momentum); 1 CPU thread per worker, on a machine with "
        f"{os.cpu_count()} CPUs. Peer: `{PEER}` (DDP overlaps each bucket's all-reduce with the rest of the "
        "backward); all our hooks, our all-reduce hook included, finish a bucket's communication inside the hook.",
        "",
        f"Step times: {args.repeats} rounds per link, each round {args.steps} timed steps per method after "
        f"{TIMED_WARMUP} warm-up steps; round k runs the methods starting at method k*n/{args.repeats}, backwards "
        "on odd rounds. Shown: median [min-max] over the rounds. Speed-up: the peer's median over the method's "
        "median on the same link [the peer's fastest round over the method's slowest, and the reverse]. "
        f"A round was measured again (up to {getattr(args, 'retries', 0)} times, after the machine went quiet) "
        f"while other processes used more than {100 * getattr(args, 'max_other_cpu', 1.0):.0f}% of the machine's "
        f"CPUs; in the rounds kept they used at most {100 * other:.0f}%. "
        "Byte ratio, MB/step (what each worker sends per step, ring formulas) and hook time come from the "
        "timed runs, in their steady-state configuration (DGC without sparsity warm-up, PowerSGD compressing "
        f"from step 3). Eval loss: one run of {args.loss_steps} steps per method on loopback in the loss "
        "configuration (DGC: 20 warm-up steps from 25% density; PowerSGD: from step 10); its byte ratio "
        "counts those warm-ups.",
        "",
    ]
    if getattr(args, "merged", None):
        lines += ["Measured in parts (same settings): " + "; ".join(args.merged) + ".", ""]
    for workers in args.workers:
        lines += [f"### {workers} workers", "",
                  "| method | byte ratio | MB/step/worker | hook ms/step, loopback | step ms, loopback | speed-up vs "
                  f"DDP, loopback | step ms, {args.rate} Mbit/s | speed-up vs DDP, {args.rate} Mbit/s | eval loss "
                  f"after {args.loss_steps} steps | byte ratio over the loss run |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for s in (s for s in summary if s["workers"] == workers):
            hook_ms = "-" if s["hook_ms_loopback"] is None else f"{s['hook_ms_loopback']:.1f}"
            cells = [s["label"], f"{s['byte_ratio']:.0f}x", f"{s['bytes_per_step'] / 1e6:.3f}", hook_ms]
            for key in ("loopback", "shaped"):
                cells += [f"{s[f'step_ms_{key}']:.0f} [{s[f'step_ms_{key}_min']:.0f}-{s[f'step_ms_{key}_max']:.0f}]",
                          f"{s[f'speedup_{key}']:.2f}x [{s[f'speedup_{key}_min']:.2f}-{s[f'speedup_{key}_max']:.2f}]"]
            cells += [f"{s['eval_loss']:.3f}" if "eval_loss" in s else "-",
                      f"{s['loss_run_byte_ratio']:.0f}x" if "loss_run_byte_ratio" in s else "-"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    with open(os.path.join(RESULTS, "dp_hooks.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, rate=100, steps=8, repeats=3, loss_steps=200, batch_size=8, seq_len=64, lr=0.03,
                  timeout=1800, retries=3,
                  max_other_cpu=(0.1, "measure a timed round again while other processes used more of the CPUs than this"),
                  merge=(False, "replace only the parts measured now in the saved .json (same settings), keep the rest"),
                  rewrite=(False, "only rewrite the .md (and summary) from the .json rows"))
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--skip_loss", action="store_true", help="no loss runs (with --merge: keep the saved ones)")
    args = p.parse_args(argv)
    started = time.gmtime()
    saved_path = os.path.join(RESULTS, "dp_hooks.json")
    if args.rewrite:
        with open(saved_path) as f:
            saved = json.load(f)
        write(saved["rows"], argparse.Namespace(**saved["args"]))
        return
    if args.repeats < 3:
        p.error("--repeats must be at least 3 (median and spread)")
    common = [f"--batch_size={args.batch_size}", f"--seq_len={args.seq_len}", f"--lr={args.lr}"]
    timed = [*common, f"--steps={args.steps}", f"--repeats={args.repeats}", f"--max_other_cpu={args.max_other_cpu}",
             f"--retries={args.retries}"]
    rows = []
    port = 29700 + os.getpid() % 1000
    for i, workers in enumerate(args.workers):
        rows += run_workers(WORKER, workers, "loopback", timed, None, port + 3 * i, args.timeout)
        with StarNetwork(workers, args.rate) as net:
            rows += run_workers(WORKER, workers, f"{args.rate} Mbit/s", timed, net, port + 3 * i + 1, args.timeout)
        if not args.skip_loss:
            rows += run_workers(WORKER, workers, "loss", [*common, f"--loss_steps={args.loss_steps}"], None,
                                port + 3 * i + 2, args.timeout)
    if args.merge:
        with open(saved_path) as f:
            saved = json.load(f)
        keep = ("batch_size", "seq_len", "lr", "steps", "repeats", "rate", "loss_steps", "workers")
        if any(saved["args"][k] != vars(args)[k] for k in keep):
            raise SystemExit(f"--merge needs the saved settings {({k: saved['args'][k] for k in keep})}")
        new = {(r["link"], r["workers"]) for r in rows}
        kept = sorted({(r["link"], r["workers"]) for r in saved["rows"]} - new, key=str)
        rows = [r for r in saved["rows"] if (r["link"], r["workers"]) not in new] + rows
        merged = saved["args"].get("merged", []) + [
            f"{', '.join(f'{link} x {w} workers' for link, w in sorted(new, key=str))}: measured again "
            f"{time.strftime('%Y-%m-%d %H:%M', started)}-{time.strftime('%H:%M UTC', time.gmtime())}, replacing "
            f"the earlier run's rows; kept from the earlier run: "
            f"{', '.join(f'{link} x {w} workers' for link, w in kept) or 'nothing'}"]
        args = argparse.Namespace(**{**vars(args), "merged": merged})
    write(rows, args)


if __name__ == "__main__":
    main()
