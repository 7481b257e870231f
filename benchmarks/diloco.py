"""DiLoCo against per-step data parallelism on a shaped link: bytes, step time, time to DDP's loss.

Two replicas, each in its own network namespace, joined through a bridge by veths that `tc`
shapes to `--rate` Mbit/s (benchmarks/harness.py's `StarNetwork`). The same small GPT-2 from the same
initialisation trains `--steps` steps on each replica's own shard (contiguous halves of the
offline corpus's training split, a fresh seeded order each epoch), batch `--batch_size` x
`--seq_len` tokens per replica, AdamW at one lr for every method:
- DDP with torch's built-in all-reduce (the peer), PowerSGD rank 4 (torch's hook) and DGC 50x
  (our hook), the hooks of benchmarks/dp_hooks.py;
- DiLoCo (`hf_actcomp.prepare`, one stage, data_parallel=2) at H = 8, 32, 128, each with int8
  and Hadamard-4 pseudo-gradients (outer Nesterov SGD, lr 0.7, momentum 0.9);
- one 2-D run: 2 stages x 2 replicas (4 namespaces), AQ-SGD boundaries and DiLoCo H=32 int8.
Every `--eval_every` steps the clock stops and each replica evaluates its own weights on the
whole held-out split. `--rounds` rounds, each in a different order of the methods (as
dp_hooks.py): median and [min-max]. Needs root (namespaces, tc); every namespace and device it
makes is named after the pid and removed at the end, also on errors.

    sudo .venv/bin/python benchmarks/diloco.py             # all of it: ~37 min on 2 CPUs
    # ablation rows: other outer settings, added to the saved rows (~10 min)
    sudo .venv/bin/python benchmarks/diloco.py --merge --only "DiLoCo H=8 int8" "DiLoCo H=32 int8" \
        "DiLoCo H=128 int8" --outer '{"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": false}'
    # longer runs (one round, here 4x the steps): when does DiLoCo reach DDP's final loss? (~3 min each)
    sudo .venv/bin/python benchmarks/diloco.py --extend 1536 --only "DiLoCo H=32 int8" "DiLoCo H=128 int8"
    .venv/bin/python benchmarks/diloco.py --rewrite        # the .md again from the .json

Writes benchmarks/results/diloco.{json,md} (the .json after every run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from diloco_worker import METHODS, PEER, TWO_D
from harness import add_arguments, median, ratio_spread, round_order, run_workers, shaped_star

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKER = os.path.join(ROOT, "benchmarks", "diloco_worker.py")
ONE_D = [label for label in METHODS if label != TWO_D]


def reached(row: dict, target: float) -> float | None:
    """Training seconds at the first eval point where every replica's loss is <= target."""
    for point in row["evals"]:
        if max(point["losses"]) <= target:
            return point["seconds"]
    return None


def loss_at(row: dict, seconds: float) -> float | None:
    """`row`'s eval loss (the worst replica's) at its last eval point within `seconds` of training."""
    points = [max(p["losses"]) for p in row["evals"] if p["seconds"] <= seconds]
    return points[-1] if points else None


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def summarize(rows: list[dict]) -> list[dict]:
    """Per method: bytes, step time, time to the peer's final eval loss (of the same round) and the
    final eval loss, median and min-max over the rounds."""
    peer = {r["round"]: r for r in rows if r["label"] == PEER}
    peer_final = median([r["final_eval_loss"] for r in peer.values()])
    peer_bytes = median([r["bytes_per_step"] for r in peer.values()])
    peer_times = [reached(r, r["final_eval_loss"]) for r in peer.values()]
    out = []
    labels = [label for label in METHODS if any(r["label"] == label for r in rows)]
    labels += [label for label in dict.fromkeys(r["label"] for r in rows) if label not in METHODS]
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        times = [reached(r, peer[r["round"]]["final_eval_loss"]) if r["round"] in peer
                 else reached(r, peer_final) for r in mine]
        got = [t for t in times if t is not None]
        finals = [r["final_eval_loss"] for r in mine]
        step_ms = [1e3 * r["seconds_per_step"] for r in mine]
        comm_ms = [1e3 * r["per_rank"][0]["comm_seconds"] / r["steps"] for r in mine
                   if r["per_rank"][0]["comm_seconds"] is not None]
        s = dict(label=label, kind=mine[0]["kind"], settings=mine[0]["settings"], rounds=len(mine),
                 workers=mine[0]["workers"], bytes_per_step=median([r["bytes_per_step"] for r in mine]),
                 step_ms=step_ms, comm_ms=comm_ms or None, seconds_to_peer_loss=times,
                 reached_rounds=len(got), final_eval_loss=finals,
                 final_vs_peer_percent=100 * (median(finals) / peer_final - 1),
                 other_cpu_share=max(r["other_cpu_share"] for r in mine))
        s["byte_ratio"] = peer_bytes / s["bytes_per_step"]
        at = [loss_at(peer[r["round"]], r["train_seconds"]) for r in mine if r["round"] in peer]
        s["peer_loss_at_same_seconds"] = at if at and None not in at else None
        if len(got) == len(mine) and all(t is not None for t in peer_times):
            s["speedup_to_peer_loss"] = ratio_spread(peer_times, got)
        if mine[0]["stages"] > 1:
            ranks = [i for r in mine for i in r["per_rank"]]
            n = len(ranks)
            cats = {k: sum(i["categories"][k] for i in ranks) / n for k in ranks[0]["categories"]}
            s["categories"] = cats
            s["boundary_bytes_per_step"] = cats["activations"] + cats["activation_gradients"] + cats["tie"]
            s["byte_ratio"] = peer_bytes / cats["data_parallel"]
        out.append(s)
    return out


def targets(s: dict, peer: dict) -> dict:
    sooner = (s["reached_rounds"] == s["rounds"]
              and median(s["seconds_to_peer_loss"]) < median(peer["seconds_to_peer_loss"]))
    return {"bytes >= 50x fewer": s["byte_ratio"] >= 50, "reaches DDP's loss sooner": sooner,
            "final loss within 1%": abs(s["final_vs_peer_percent"]) <= 1.0}


def extended_lines(extended: list[dict], peer: dict, args) -> list[str]:
    """The longer runs (`--extend`): how many steps and seconds to DDP's final eval loss."""
    target = median(peer["final_eval_loss"])
    lines = ["", f"Longer runs (`--extend`, one round each): the same setting, more steps (more epochs of the same "
             f"data), to see whether the method reaches DDP's final eval loss after {args.steps} steps "
             f"({target:.3f}, median over the rounds; DDP took {median(peer['seconds_to_peer_loss']):.1f} s of "
             "training to get there) when it may train longer. Measured "
             + "; ".join(dict.fromkeys(r.get("measured", "-") for r in extended)) + ".", "",
             "| method | steps | step ms | first eval point at or below DDP's final loss: step, training s | "
             "final eval loss | other CPU |", "|---|---|---|---|---|---|"]
    for r in extended:
        first = next((p for p in r["evals"] if max(p["losses"]) <= target), None)
        got = "not reached" if first is None else f"step {first['step']}, {first['seconds']:.1f} s"
        lines.append(f"| {r['label']} | {r['steps']} | {1e3 * r['seconds_per_step']:.0f} | {got} | "
                     f"{r['final_eval_loss']:.3f} | {100 * r['other_cpu_share']:.0f}% |")
    return lines


def write(rows: list[dict], args, extended: list[dict] | None = None) -> list[dict]:
    summary = summarize(rows)
    extended = extended or []
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "diloco.json"), "w") as f:
        json.dump({"args": vars(args), "summary": summary, "rows": rows, "extended": extended}, f, indent=1)
    if not any(s["label"] == PEER for s in summary):
        return summary
    peer = next(s for s in summary if s["label"] == PEER)
    first = rows[0]
    diloco = [s for s in summary if s["kind"] == "diloco" and "categories" not in s]
    compute_ms = [ms - c for s in diloco for ms, c in zip(s["step_ms"], s["comm_ms"], strict=True)]
    link_ms = 8 * peer["bytes_per_step"] / (args.rate * 1e6) * 1e3
    other = max(s["other_cpu_share"] for s in summary)
    lines = [
        f"GPT-2 style, {args.n_layer} layers x {args.n_embd}, vocabulary 1024 ({first['parameters'] / 1e6:.2f} M "
        f"parameters, {first['param_bytes'] / 1e6:.2f} MB fp32); batch {args.batch_size} x {args.seq_len} tokens per "
        f"replica; {args.steps} steps ({args.steps * args.batch_size} samples per replica, "
        f"{args.steps * args.batch_size * 2 / first['train_rows']:.1f} epochs of the {first['train_rows']}-row training "
        f"split) from the same initialisation. Each replica trains on its own contiguous half of the training split "
        f"(`Pipeline.shard_dataset`'s cut; DDP and the hooks use the same halves), in a fresh seeded order each "
        f"epoch, the same for every method. Inner optimizer for every method: AdamW, lr {args.lr} (constant; the "
        f"best of 5e-4, 1e-3, 2e-3, 3e-3, 1e-2 for one process on the global batch of 16, an lr picked for DDP), "
        "default betas and weight decay. DDP hooks as in dp_hooks.md's loss runs (PowerSGD rank 4 compressing "
        "from step 10; DGC 1% density after 20 warm-up steps from 25%, with its own momentum off since AdamW has "
        f"its own). Measured {getattr(args, 'measured', '-')}"
        + "".join(f"; {m}" for m in getattr(args, "merged", []))
        + ". DiLoCo (unless its row names other outer settings): outer Nesterov SGD, lr 0.7, momentum 0.9; the pseudo-gradient in int8 (`quantize` "
        "8 bits) or Hadamard-4, with error feedback; the last step is a sync step for every H, and the run "
        "asserts that the replicas' weights are bit-equal at the end (as for DDP).",
        "",
        f"Regime: 2 replicas = 2 processes with 1 CPU thread each on this {os.cpu_count()}-CPU machine, each in "
        f"its own network namespace; every veth shaped by `tc tbf` to {args.rate} Mbit/s (the 2-D run: 4 "
        "namespaces on the same star, 4 processes on the 2 CPUs). Step time = training wall-clock / steps "
        "(syncs and the replicas' waits included, evaluation excluded). Time to DDP's loss: the training "
        "seconds at the first eval point (every "
        f"{args.eval_every} steps) where every replica's own eval loss (whole {first['eval_rows']}-row held-out "
        "split) is at or below DDP's final eval loss of the same round; DDP's eval loss after as many training seconds as "
        "the method's whole run took: DDP's (same round) at its last eval point within that time. Final eval loss: "
        "after "
        f"{args.steps} steps (the same samples for every method), the replicas' (equal) loss. {args.rounds} rounds, "
        "round k starting at method k*n/rounds, backwards on odd rounds; median [min-max]. Bytes: what each "
        "worker sends per step, counted: DDP's ring all-reduce of every gradient each step (ring formula, as "
        "dp_hooks.py); the hooks' own counters over the whole run (warm-ups included); DiLoCo's "
        "`pipe.stats()['categories']['data_parallel']['bytes_sent']` over the run / steps (between syncs "
        f"nothing crosses). Other processes (not this benchmark's) used up to {100 * other:.0f}% of the machine's "
        "CPUs during a run (last column: the most over a method's rounds); no run was measured again, so step "
        "times and seconds carry that noise: compare them within a round (the .json has each run's share).",
        "",
        f"Where the time goes: DDP moves {peer['bytes_per_step'] / 1e6:.2f} MB per worker per step, "
        f"{link_ms:.0f} ms at {args.rate} Mbit/s by itself; its step takes {median(peer['step_ms']):.0f} ms while "
        f"the same step's computation (DiLoCo's steps minus its syncs, all runs) takes {median(compute_ms):.0f} ms "
        f"[{min(compute_ms):.0f}-{max(compute_ms):.0f}]: DDP is link-bound here "
        f"(~{100 * (1 - median(compute_ms) / median(peer['step_ms'])):.0f}% of its step is waiting on the link). "
        "Hook / sync ms per step below is the time inside the hook (PowerSGD, DGC: compression and exchange) or "
        "inside DiLoCo's syncs (quorum, pseudo-gradient encode, exchange, decode, outer step), per step of the "
        "run (rank 0).",
        "",
        f"| method | MB/step/worker | byte ratio vs DDP | step ms | hook / sync ms per step | s to DDP's final eval "
        f"loss | speed-up to DDP's loss | final eval loss after {args.steps} steps | vs DDP | DDP's eval loss after "
        "as many training seconds | other CPU, max |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        times = s["seconds_to_peer_loss"]
        if s["reached_rounds"] == s["rounds"]:
            to_loss = spread(times, "{:.1f}")
        elif s["reached_rounds"]:
            to_loss = f"reached in {s['reached_rounds']}/{s['rounds']} rounds: " + ", ".join(
                "-" if t is None else f"{t:.1f}" for t in times)
        else:
            to_loss = "not reached"
        speedup = ("{:.2f}x [{:.2f}-{:.2f}]".format(*s["speedup_to_peer_loss"])
                   if "speedup_to_peer_loss" in s else "-")
        mb = f"{s['bytes_per_step'] / 1e6:.4f}"
        ratio = f"{s['byte_ratio']:.0f}x"
        if "categories" in s:
            mb = (f"{s['boundary_bytes_per_step'] / 1e6:.4f} boundary (activations, activation gradients, tied "
                  f"rows) + {s['categories']['data_parallel'] / 1e6:.4f} data_parallel")
            ratio = f"{s['byte_ratio']:.0f}x (data_parallel only)"
        label = s["label"] + (f" ({s['rounds']} round{'s' if s['rounds'] > 1 else ''})" if "categories" in s else "")
        lines.append("| " + " | ".join([
            label, mb, ratio, spread(s["step_ms"]), spread(s["comm_ms"], "{:.1f}") if s["comm_ms"] else "-",
            to_loss, speedup, spread(s["final_eval_loss"], "{:.3f}"), f"{s['final_vs_peer_percent']:+.1f}%",
            spread(s["peer_loss_at_same_seconds"], "{:.3f}") if s["peer_loss_at_same_seconds"] else "-",
            f"{100 * s['other_cpu_share']:.0f}%",
        ]) + " |")
    lines += ["", "Targets (DiLoCo, one stage): >= 50x fewer bytes than DDP; reaching DDP's final eval loss sooner "
              f"at {args.rate} Mbit/s; final eval loss within 1% of DDP's.", "",
              "| DiLoCo | " + " | ".join(targets(peer, peer)) + " |", "|---|---|---|---|"]
    for s in diloco:
        lines.append(f"| {s['label']} | " + " | ".join("met" if v else "not met" for v in targets(s, peer).values())
                     + " |")
    met = [s["label"] for s in diloco if all(targets(s, peer).values())]
    lines += ["", "All three met by: " + (", ".join(met) if met else "none") + "."]
    if extended:
        lines += extended_lines(extended, peer, args)
    lines.append("")
    if getattr(args, "notes", None):
        for note in args.notes:
            lines += [note, ""]
    with open(os.path.join(RESULTS, "diloco.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, rate=100, steps=384, eval_every=16, rounds=3, batch_size=8, seq_len=64, n_embd=128,
                  n_layer=2, lr=1e-3, timeout=(900, "seconds one run may take"),
                  only=(None, "method labels to run (default: all)"),
                  merge=(False, "add the rows measured now to the saved .json (same settings), replacing same label and round"),
                  rewrite=(False, "only rewrite the .md (and summary) from the .json rows"))
    p.add_argument("--two_d_rounds", type=int, default=3)
    p.add_argument("--outer", default=None,
                   help='DiLoCo\'s outer settings as JSON, e.g. \'{"outer_lr": 1.0, "outer_momentum": 0.0, '
                        '"nesterov": false}\' (default: Nesterov lr 0.7, momentum 0.9); the rows\' labels name them')
    p.add_argument("--extend", type=int, default=None,
                   help="one round of the --only methods for this many steps, added to the saved .json's longer runs")
    p.add_argument("--note", nargs="*", default=None,
                   help="with --rewrite: paragraphs to end the .md with (kept in the .json; none: keep the saved ones)")
    args = p.parse_args(argv)
    if args.rewrite:
        with open(os.path.join(RESULTS, "diloco.json")) as f:
            saved = json.load(f)
        if args.note is not None:
            saved["args"]["notes"] = args.note
        write(saved["rows"], argparse.Namespace(**saved["args"]), saved.get("extended"))
        return
    if args.rounds < 3:
        p.error("--rounds must be at least 3 (median and spread)")
    if os.geteuid() != 0:
        p.error("needs root: network namespaces and tc")

    def stop(signum, frame):  # noqa: ARG001 - SIGTERM / SIGHUP unwind through the cleanup too
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at INFO
    common = [f"--steps={args.extend or args.steps}", f"--eval_every={args.eval_every}", f"--batch_size={args.batch_size}",
              f"--seq_len={args.seq_len}", f"--n_embd={args.n_embd}", f"--n_layer={args.n_layer}",
              f"--lr={args.lr}", f"--timeout={min(args.timeout, 300)}"]
    if args.outer is not None:
        common.append(f"--outer={json.dumps(json.loads(args.outer))}")
    saved = None
    if args.merge or args.extend:
        with open(os.path.join(RESULTS, "diloco.json")) as f:
            saved = json.load(f)
        keep = ("rate", "steps", "eval_every", "batch_size", "seq_len", "n_embd", "n_layer", "lr")
        if any(saved["args"][k] != vars(args)[k] for k in keep):
            raise SystemExit(f"--merge needs the saved settings {({k: saved['args'][k] for k in keep})}")
    one_d = [m for m in ONE_D if not args.only or m in args.only]
    link = f"{args.rate} Mbit/s"
    rows: list[dict] = []
    port = 29500 + (os.getpid() % 200) * 40
    started = time.time()
    with shaped_star(4, args.rate) as net:
        runs = [(k, one_d[i], 2) for k in range(args.rounds) for i in round_order(len(one_d), k, args.rounds)]
        if args.extend:
            runs = [(0, label, 2) for label in one_d]
        elif not args.only or TWO_D in args.only:
            runs += [(k, TWO_D, 4) for k in range(args.two_d_rounds)]
        for n, (k, label, workers) in enumerate(runs):
            row = run_workers(WORKER, workers, link, [*common, f"--method={label}", f"--round={k}"], net,
                              port + n, args.timeout)
            row["position"] = n
            rows.append(row)
            print(f"[{time.time() - started:6.0f} s] run {n + 1}/{len(runs)} round {k} {label}: "
                  f"{1e3 * row['seconds_per_step']:.0f} ms/step, {row['bytes_per_step'] / 1e6:.4f} MB/step, "
                  f"final eval {row['final_eval_loss']:.3f}", flush=True)
            if saved is None:  # what is done so far
                with open(os.path.join(RESULTS, "diloco.json"), "w") as f:
                    json.dump({"args": vars(args), "rows": rows, "partial": True}, f, indent=1)
            else:
                with open(os.path.join(RESULTS, "diloco_merge_partial.json"), "w") as f:
                    json.dump({"args": vars(args), "rows": rows, "partial": True}, f, indent=1)
    measured = f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))}-{time.strftime('%H:%M UTC')}"
    partial = os.path.join(RESULTS, "diloco_merge_partial.json")
    if saved is not None and os.path.exists(partial):
        os.remove(partial)
    if args.extend:
        extended = [r for r in saved.get("extended", []) if r["label"] not in {x["label"] for x in rows}]
        for r in rows:
            r["measured"] = measured
        write(saved["rows"], argparse.Namespace(**saved["args"]), extended + rows)
        return
    if saved is not None:
        new = {(r["label"], r["round"]) for r in rows}
        rows = [r for r in saved["rows"] if (r["label"], r["round"]) not in new] + rows
        what = ", ".join(dict.fromkeys(r["label"] for r in rows if (r["label"], r["round"]) in new))
        args = argparse.Namespace(**{**saved["args"], "measured": saved["args"]["measured"],
                                     "merged": [*saved["args"].get("merged", []), f"{what}: {measured}"]})
    else:
        args.measured = measured
    write(rows, args, saved.get("extended") if saved else None)


if __name__ == "__main__":
    main()
