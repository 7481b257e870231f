"""Two pipeline stages joined by a slow link: tokens/s of torch.distributed.pipelining vs hf-actcomp.

Each stage runs in its own network namespace; a veth pair joins them and `tc tbf` shapes both
ends to the given rate (plus one unshaped run on 127.0.0.1). For every link, ONE pair of
processes runs every model and method back to back (benchmarks/slow_link_worker.py), so the
ratios compare runs made on the same link in the same minute. Needs root (namespaces, tc);
everything the run creates is named after its pid and removed at the end.

Models: a small-vocabulary GPT-2 (untied), and the same blocks with GPT-2's real vocabulary
(50257) once with `lm_head.weight` tied to `transformer.wte.weight` and once untied, to show
what the tie exchange costs. On every shaped link, the bytes the run counted over the measured
steps are checked against the tx counters of the two veth ends (a warning beyond 5%).

    sudo .venv/bin/python benchmarks/slow_link.py                    # 50, 100, 500 Mbit/s + loopback
    sudo .venv/bin/python benchmarks/slow_link.py --rates 100 --steps 3 --models small

Writes benchmarks/results/slow_link.{json,md} (`--name` another file; `--merge` keeps the saved
rows of links not measured again). Every link runs `--repeats` rounds (at least 3), each in
another order; the tables give the median and the range over the rounds.
Rows measured while other processes used more than 10% of the CPUs are measured again.

"Allowed" speed-up: the best a method could do given its byte ratio and its own compute floor
(its loopback step); see summarize(). "Waiting" is the share of the uncompressed step a stage
spends blocked on its peer (the link, and also pipeline bubbles, which is why it is about a
third even on loopback for the small model).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from harness import (
    LinkedNamespaces,
    add_arguments,
    median,
    ratio_spread,
    run_workers,
    write_markdown,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKER = os.path.join(ROOT, "benchmarks", "slow_link_worker.py")
PEERS = ("torch.distributed.pipelining", "torch.distributed.pipelining + all-reduce of the tied weight")
BASE = "ours, uncompressed"
LINK_TOLERANCE = 0.05  # counted bytes vs the veth counters
HEADER_BYTES = 66  # per packet on the veth: Ethernet 14 + IPv4 20 + TCP 20 + 12 of timestamps
# The convergence run's name of each method's setting (benchmarks/convergence.py).
CONVERGENCE_SETTING = {"ours, uncompressed": "none", "ours, AQ-SGD fw4/bw8": "aqsgd fw4/bw8",
                       "ours, AQ-SGD fw2/bw4": "aqsgd fw2/bw4", "ours, TopK 10% + EF": "topk 10% + EF"}
NO_LEARNING_MARGIN = 1.0  # nats above uncompressed's eval loss: marked "does not learn"


def run_pair(link: str, worker_args: list[str], namespaces: LinkedNamespaces | None, port: int,
             timeout: float) -> list[dict]:
    return run_workers(WORKER, 2, link, worker_args, namespaces, port, timeout)["rows"]


def collapse(r: dict) -> dict:
    """One row from its rounds: median seconds per step and the range, the median round's
    waiting, bytes (the same every round) and the veth window summed over the rounds."""
    rounds = r.setdefault("rounds", [{k: v for k, v in r.items() if k != "rounds"}])  # one-run results files
    seconds = [x["seconds_per_step"] for x in rounds]
    mid = sorted(rounds, key=lambda x: x["seconds_per_step"])[(len(rounds) - 1) // 2]
    r.update(seconds_per_step=median(seconds), seconds_min=min(seconds), seconds_max=max(seconds),
             steps=mid["steps"], bytes_per_step=mid["bytes_per_step"], byte_ratio=mid["byte_ratio"],
             categories=mid["categories"], waiting_fraction=mid["waiting_fraction"],
             rank_bytes_per_step=mid.get("rank_bytes_per_step"),
             other_cpu_share=max(x["other_cpu_share"] for x in rounds),
             attempts=[x.get("attempts", 1) for x in rounds],
             counted_bytes_window=sum(x["counted_bytes_window"] for x in rounds))
    first = rounds[0]  # one-run results files have no tokens_per_step
    tokens = r.get("tokens_per_step") or round(first["tokens_per_s"] * first["seconds_per_step"])
    r["tokens_per_s"] = tokens / r["seconds_per_step"]
    windows = [(x["link_tx_bytes_window"], x["link_tx_packets_window"]) for x in rounds]
    r["link_tx_bytes_window"] = r["link_tx_packets_window"] = None
    if all(b is not None for b, _ in windows):
        r["link_tx_bytes_window"] = sum(b for b, _ in windows)
        r["link_tx_packets_window"] = sum(n for _, n in windows)
    return r


def seconds(r: dict) -> list[float]:
    return [x["seconds_per_step"] for x in r["rounds"]]


def summarize(rows: list[dict]) -> list[dict]:
    """Speed-ups over the peer, the share of the speed-up the byte ratio allows, tied vs untied,
    and counted vs interface bytes. Rows are compared within one link and one model. Every
    ratio is the ratio of the medians over the rounds, with its range (`ratio_spread`).

    Allowed speed-up of a method on a link, with perfect overlap of compute and communication:
    its step cannot take less than the uncompressed step's time divided by the byte ratio (the
    link carries 1/ratio of the bytes), nor less than the same method's step on unshaped
    loopback (its compute and encoding floor). So `allowed = T_base / max(T_base / ratio,
    T_loopback(method))`, and the share is achieved / allowed speed-up over ours-uncompressed.
    """
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        r.setdefault("model", "vocab 1024, untied")  # results written before models were named
        groups.setdefault((r["link"], r["model"]), {})[r["method"]] = collapse(r)
    for (_, model), methods in groups.items():
        loopback = groups.get(("loopback", model), {})
        peer = next((methods[p] for p in PEERS if p in methods), None)
        base = methods.get(BASE)
        t_base = base["seconds_per_step"] if base else None
        t_loop_base = loopback[BASE]["seconds_per_step"] if BASE in loopback else 0.0
        for name, r in methods.items():
            r["speedup_vs_peer"], r["speedup_vs_peer_min"], r["speedup_vs_peer_max"] = (
                ratio_spread(seconds(peer), seconds(r)) if peer else (None, None, None))
            r["speedup_vs_uncompressed"], r["speedup_vs_uncompressed_min"], r["speedup_vs_uncompressed_max"] = (
                ratio_spread(seconds(base), seconds(r)) if base else (None, None, None))
            if base:
                floor = loopback[name]["seconds_per_step"] if name in loopback else 0.0
                r["allowed_speedup"] = max(t_base / max(t_base / r["byte_ratio"], floor), 1.0)
                r["share_of_allowed"] = (r["speedup_vs_uncompressed"] / r["allowed_speedup"]
                                         if r["allowed_speedup"] > 1.01 else None)
                r["link_fraction"] = max(t_base - t_loop_base, 0.0) / t_base
                r["uncompressed_waiting_fraction"] = max(base["waiting_fraction"].values())
            overlap_bound(r, loopback.get(name))
            link = r.get("link_tx_bytes_window")
            r["link_over_counted"] = link / r["counted_bytes_window"] if link else None
            if link:
                payload = link - HEADER_BYTES * r["link_tx_packets_window"]
                r["link_payload_over_counted"] = payload / r["counted_bytes_window"]
                if abs(r["link_payload_over_counted"] - 1) > LINK_TOLERANCE:
                    print(f"WARNING: {r['link']}, {model}, {name}: the veth interfaces carried {payload} bytes "
                          f"of TCP payload ({link} with headers), the run counted {r['counted_bytes_window']} "
                          f"({r['link_payload_over_counted']:.3f}x, more than {100 * LINK_TOLERANCE:.0f}% off)")
    for (link, model), methods in groups.items():
        if not model.endswith(", tied"):
            continue
        untied = groups.get((link, model.replace(", tied", ", untied")), {})
        for name, r in methods.items():
            if name in untied:
                r["untied_seconds_per_step"] = untied[name]["seconds_per_step"]
                r["tied_over_untied"], r["tied_over_untied_min"], r["tied_over_untied_max"] = ratio_spread(
                    seconds(r), seconds(untied[name]))
    return rows


def link_mbit(link: str) -> float | None:
    """The rate of a link label such as `20 Mbit/s` (None for loopback)."""
    return float(link.split()[0]) if link.endswith("Mbit/s") else None


def overlap_bound(r: dict, loopback: dict | None) -> None:
    """Where the step's time goes, against what overlap allows: compute (the same method's step
    on loopback), link (the busier direction's bytes at the link rate: the two directions of a
    full-duplex link run in parallel), and the measured step over max(compute, link). With
    perfect overlap that ratio is 1. Without any overlap the step is about compute plus every
    byte of the step, both directions one after the other, at the link's rate (what the engine
    measured before its receives were posted early)."""
    mbit = link_mbit(r["link"])
    if mbit is None or loopback is None or not r.get("rank_bytes_per_step"):
        return
    r["compute_seconds"] = loopback["seconds_per_step"]
    r["link_seconds"] = max(r["rank_bytes_per_step"]) * 8 / (mbit * 1e6)
    bound = max(r["compute_seconds"], r["link_seconds"])
    r["regime"] = "link-bound" if r["link_seconds"] > r["compute_seconds"] else "compute-bound"
    r["measured_over_bound"] = r["seconds_per_step"] / bound
    r["serial_over_bound"] = (r["compute_seconds"] + r["bytes_per_step"] * 8 / (mbit * 1e6)) / bound


def convergence_losses() -> dict[str, float]:
    """Each method's eval loss in the convergence run (benchmarks/results/convergence.json), so
    that a speed-up is never read without knowing whether the setting learns."""
    path = os.path.join(RESULTS, "convergence.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        by_setting = {r["setting"]: r["eval_loss_uncompressed"] for r in json.load(f)["rows"]}
    return {method: by_setting[setting] for method, setting in CONVERGENCE_SETTING.items() if setting in by_setting}


def _f(value, fmt: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{fmt}}{suffix}"


def table(intro: str, columns: list[str]) -> list[str]:
    """A blank line, the table's introduction, and the header of a markdown table."""
    return ["", intro, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def spread(r: dict, key: str) -> str:
    """`median x [min-max]` of a ratio, or empty."""
    if r.get(key) is None:
        return ""
    return f"{r[key]:.2f}x [{r[key + '_min']:.2f}-{r[key + '_max']:.2f}]"


def _mb(r: dict, category: str) -> str:
    c = r["categories"].get(category)
    return f"{c['bytes_sent_per_step'] / 1e6:.3f}" if c and c["bytes_sent_per_step"] else "0"


def write(rows: list[dict], args) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    models = list(dict.fromkeys(r["model"] for r in rows))
    lines = [
        f"GPT-2 style, {args.layers} layers x hidden {args.hidden}; 2 stages in 2 network namespaces joined by a "
        f"tc-shaped veth pair (or loopback); batch {args.batch_size} x {args.seq_len} tokens in "
        f"{args.micro_batches} micro-batches, 1F1B; 1 CPU thread per stage; each round: mean of {args.steps} steps "
        f"(real-vocabulary models: {args.large_steps}) after {args.warmup} warm-up steps (AQ-SGD's uncompressed "
        "first visits happen in the warm-up). Tokens are uniform over the vocabulary. During the measured steps, "
        "other processes used at most "
        f"{100 * max(r.get('other_cpu_share', 0.0) for r in rows):.0f}% of the machine's CPUs (/proc/stat minus "
        f"the two ranks' own CPU time; a row was measured again, up to {args.retries} times, while above "
        f"{100 * args.max_other_cpu:.0f}%).",
        "",
        "Models:",
        "",
    ]
    for model in models:
        r = next(r for r in rows if r["model"] == model)
        if r.get("tied"):
            lines.append(f"- **{model}**: `lm_head.weight` <-> `transformer.wte.weight` tied "
                         f"(`tie_word_embeddings=True`); the first stage holds the input embedding, the last the "
                         f"head. {r['distinct_tokens_per_batch']:.0f} distinct tokens per batch on average: the "
                         "embedding rows ours exchanges for the tie. torch.distributed.pipelining does not sync a "
                         "weight shared by two stages, so its row adds the all-reduce of the full tied gradient "
                         "(vocab x hidden) that a user has to write by hand.")
        else:
            lines.append(f"- **{model}**: untied (`tie_word_embeddings=False`), no tie traffic.")
    losses = convergence_losses()
    lines += table(
        f"Each (model, method) ran in {args.repeats} rounds per link; round k starts at method k*n/{args.repeats} "
        "of its model and runs backwards on odd rounds, every run from a fresh model with its own warm-up. "
        "s/step and tokens/s: median over the rounds [fastest-slowest]. Speed-ups: ratio of the medians "
        "[the other method's fastest round over this one's slowest, and the reverse]. Eval loss: the same setting "
        "in the from-scratch convergence run (benchmarks/results/convergence.md; uncompressed "
        f"{_f(losses.get(BASE), '.3f')}); a setting {NO_LEARNING_MARGIN:.0f} nat or more above uncompressed is "
        "marked: it does not learn, and its speed-up buys nothing.",
        ["link", "model", "method", "tokens/s", "s/step [min-max]", "MB/step", "byte ratio", "speed-up vs peer",
         "vs ours uncompressed", "allowed by bytes", "share of allowed",
         "uncompressed step: waiting / added by the link", "eval loss, convergence run"])
    for r in rows:
        wait = ("" if r.get("uncompressed_waiting_fraction") is None else
                f"{100 * r['uncompressed_waiting_fraction']:.0f}% / {100 * r['link_fraction']:.0f}%")
        loss = losses.get(r["method"])
        learns = ("" if loss is None or BASE not in losses else
                  " (does not learn)" if loss - losses[BASE] >= NO_LEARNING_MARGIN else "")
        lines.append(
            f"| {r['link']} | {r['model']} | {r['method']} | {r['tokens_per_s']:.0f} | "
            f"{r['seconds_per_step']:.3f} [{r['seconds_min']:.3f}-{r['seconds_max']:.3f}] | "
            f"{r['bytes_per_step'] / 1e6:.2f} | {r['byte_ratio']:.1f}x | {spread(r, 'speedup_vs_peer')} | "
            f"{spread(r, 'speedup_vs_uncompressed')} | {_f(r.get('allowed_speedup'), '.2f', 'x')} | "
            f"{_f(r.get('share_of_allowed') and 100 * r['share_of_allowed'], '.0f', '%')} | {wait} | "
            f"{_f(loss, '.3f')}{learns} |")

    bounded = [r for r in rows if r.get("measured_over_bound") is not None]
    if bounded:
        lines += table(
            "Where the time goes, per step (median round). Compute: the same model and method on loopback "
            "(computing, encoding, and the pipeline's bubbles). Link: the bytes of the busier direction at the "
            "link's rate (the veth pair is full duplex; TCP/IP headers not included). A step cannot be shorter "
            "than max(compute, link); without overlap it would be about compute + all the step's bytes at the "
            "link's rate (arithmetic). Regime: which of compute and link is larger. Waiting: each stage's share of "
            "its step spent blocked on its peer.",
            ["link", "model", "method", "regime", "compute s", "link s", "measured s/step",
             "measured / max(compute, link)", "no overlap: (compute + all bytes) / max", "waiting stage 0 / 1"])
        for r in bounded:
            wait = r.get("waiting_fraction") or {}
            waits = " / ".join(f"{100 * wait[k]:.0f}%" for k in sorted(wait)) if wait else ""
            lines.append(f"| {r['link']} | {r['model']} | {r['method']} | {r['regime']} | "
                         f"{r['compute_seconds']:.3f} | {r['link_seconds']:.3f} | {r['seconds_per_step']:.3f} | "
                         f"{r['measured_over_bound']:.2f}x | {r['serial_over_bound']:.2f}x | {waits} |")

    tied_rows = [r for r in rows if r.get("tied_over_untied") is not None]
    if tied_rows:
        lines += table(
            "Tied vs untied, same real-vocabulary model, same link, same minute. The tie exchange is 2 x "
            "distinct tokens x hidden x 4 bytes per step, lossless, sent before the forward and after the backward "
            "(not overlapped with compute).",
            ["link", "method", "untied s/step (median)", "tied s/step (median)", "tied / untied [range]",
             "tie MB/step"])
        for r in tied_rows:
            lines.append(f"| {r['link']} | {r['method']} | {r['untied_seconds_per_step']:.3f} | "
                         f"{r['seconds_per_step']:.3f} | {spread(r, 'tied_over_untied')} | {_mb(r, 'tie')} |")

    categories = ["activations", "activation_gradients", "tie", "collectives", "data_parallel"]
    link0 = next((r["link"] for r in rows if r["link"] != "loopback"), rows[0]["link"])
    same = all(r["categories"] == s["categories"] for r in rows for s in rows
               if (r["model"], r["method"]) == (s["model"], s["method"]))
    lines += table(
        f"MB per step by category, summed over both ranks (from `pipe.stats(gather=True)['categories']` for ours, "
        f"the tensor sizes for the peer), on {link0}"
        + (" (the same on every link)." if same else "; other links differ, see slow_link.json.")
        + " Collectives (loss broadcast) are counted with the ring formulas.",
        ["model", "method", "activations", "activation gradients", "tie", "collectives", "data parallel", "total"])
    for r in rows:
        if r["link"] == link0:
            lines.append(f"| {r['model']} | {r['method']} | " + " | ".join(_mb(r, c) for c in categories)
                         + f" | {r['bytes_per_step'] / 1e6:.3f} |")

    checked = [r for r in rows if r.get("link_over_counted") is not None]
    if checked:
        lines += table(
            "Counted bytes vs the veth interfaces: the bytes the run counted over the measured steps (sum over "
            "both ranks; for the peer, the tensor sizes), and the tx bytes and packets of both veth ends over the "
            "same window (read in each namespace, as `ip -n NS -s link show DEV`). The interfaces also carry "
            f"Ethernet/IPv4/TCP headers ({HEADER_BYTES} bytes a packet, TCP timestamps on) and TCP "
            "acknowledgements, so the raw tx bytes are a few percent more than the payload; without the headers, "
            "what remains is gloo's message headers and two barriers. A payload more than "
            f"{100 * LINK_TOLERANCE:.0f}% off the counted bytes prints a warning.",
            ["link", "model", "method", "counted MB", "veth tx MB", "veth / counted", "veth packets",
             f"veth tx MB - {HEADER_BYTES} B/packet", "payload / counted"])
        for r in checked:
            payload = r["link_tx_bytes_window"] - HEADER_BYTES * r["link_tx_packets_window"]
            flag = " (off by > 5%)" if abs(r["link_payload_over_counted"] - 1) > LINK_TOLERANCE else ""
            lines.append(f"| {r['link']} | {r['model']} | {r['method']} | {r['counted_bytes_window'] / 1e6:.2f} | "
                         f"{r['link_tx_bytes_window'] / 1e6:.2f} | {r['link_over_counted']:.3f} | "
                         f"{r['link_tx_packets_window']} | {payload / 1e6:.2f} | "
                         f"{r['link_payload_over_counted']:.3f}{flag} |")
    write_markdown(RESULTS, args.name, lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, rates=[50, 100, 500], no_loopback=False,
                  steps=(8, "measured steps of the small model"), large_steps=6, warmup=2, batch_size=16,
                  micro_batches=4, seq_len=128, hidden=256, layers=2, vocab=1024,
                  large_vocab=(50257, "GPT-2's vocabulary"), retries=3, timeout=3600,
                  max_other_cpu=(0.1, "measure a row again when other processes used more than this share of the CPUs"),
                  repeats=(3, "rounds per link, each in another order (at least 3)"),
                  merge=(False, "keep the saved rows of the (link, model) pairs this run does not measure"),
                  summarize_only=(False, "recompute the table from benchmarks/results/slow_link.json without running"))
    p.add_argument("--models", nargs="+", default=["small", "tied", "untied"], choices=["small", "tied", "untied"],
                   help="small: vocab --vocab, untied; tied / untied: vocab --large_vocab with and without "
                        "tie_word_embeddings")
    p.add_argument("--name", default="slow_link", help="results file name in benchmarks/results/ (.json, .md)")
    args = p.parse_args(argv)
    if args.repeats < 3 and not args.summarize_only:
        p.error("--repeats must be at least 3 (median and spread)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the namespaces are removed
    if args.summarize_only:
        with open(os.path.join(RESULTS, f"{args.name}.json")) as f:
            saved = json.load(f)
        vars(args).update({k: v for k, v in saved["args"].items() if k not in ("summarize_only", "name")})
        write(summarize(saved["rows"]), args)
        return
    worker_args = [f"--{k}={getattr(args, k)}" for k in
                   ("steps", "large_steps", "warmup", "batch_size", "micro_batches", "seq_len", "hidden", "layers",
                    "vocab", "large_vocab", "max_other_cpu", "retries", "repeats")]
    worker_args += ["--models", *args.models]
    rows = []
    port = 29600 + os.getpid() % 1000
    if not args.no_loopback:
        rows += run_pair("loopback", worker_args, None, port, args.timeout)
    if args.rates:
        with LinkedNamespaces() as namespaces:
            for i, rate in enumerate(args.rates):
                namespaces.shape(rate)
                rows += run_pair(f"{rate} Mbit/s", worker_args, namespaces, port + 1 + i, args.timeout)
    if args.merge:
        with open(os.path.join(RESULTS, f"{args.name}.json")) as f:
            saved = json.load(f)["rows"]
        measured = {(r["link"], r["model"]) for r in rows}
        rows = [r for r in saved if (r["link"], r["model"]) not in measured] + rows
        rows.sort(key=lambda r: -1 if r["link"] == "loopback" else int(r["link"].split()[0]))  # stable
        args.rates = sorted({int(r["link"].split()[0]) for r in rows if r["link"] != "loopback"})
        args.no_loopback = not any(r["link"] == "loopback" for r in rows)
    write(summarize(rows), args)


if __name__ == "__main__":
    main()
