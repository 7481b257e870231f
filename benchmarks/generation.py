"""Generation with the model split in two: tokens/s, bytes per token and agreement with uncompressed greedy.

`Pipeline.generate` on 2 gloo processes (1 CPU thread each), greedy, for the boundary codecs none,
bf16, quantize-8 and Hadamard-4 (plus none with every weight frozen, which skips the tied
embedding's row exchange), on three links:

- loopback (127.0.0.1);
- 100 Mbit/s: two network namespaces joined by a veth pair, `tc tbf` on both ends
  (benchmarks/harness.py's `LinkedNamespaces`);
- 100 Mbit/s with 20 ms round trip: this kernel has no `netem` (CONFIG_NET_SCH_NETEM is not set),
  so the delay is a userspace delay line: each namespace gets a TUN device instead of a veth
  end, and one process here reads every IP packet from one TUN device and writes it into the
  other `--delay_ms` (10) later, in order; `tc tbf` shapes both TUN devices to the rate.
  TCP runs end to end through it, so it sees the real round trip.

The model: the small GPT-2 of benchmarks/finetune_quality.py (4 layers x 128, vocabulary 1024,
tied head), pre-trained uncompressed on CPython's documentation (`corpora`, `pretrain`; the weights
are cached under ~/.cache/hf_actcomp_benchmarks), so that agreement means something. Prompts: the
first 16-32 tokens of held-out documentation blocks; batch 1 and batch 8 (left-padded).

Agreement with uncompressed greedy, in one process with `compressed_inference` (which applies
the same inference codec at the same boundary; the pipeline's own outputs are checked against it):
free-running (the compressed model generates on its own; the share of positions whose token equals
uncompressed greedy's, the first position that differs) and teacher-forced (along uncompressed
greedy's sequence, the share of positions where the compressed model's top-1 equals the
uncompressed model's).

    sudo .venv/bin/python benchmarks/generation.py            # 3 links x 3 rounds, ~15 minutes
    .venv/bin/python benchmarks/generation.py --quick         # a check that it runs (< 1 minute)
    .venv/bin/python benchmarks/generation.py --rewrite       # the .md again from the .json

Needs root for the shaped links (namespaces, TUN, tc); without it only loopback runs. Everything
created is named after the pid and removed at the end. Writes benchmarks/results/generation.{json,md}.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import json
import os
import platform
import queue
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

from harness import LinkedNamespaces, add_arguments, sh, shape_device, write_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WORKER = os.path.join(ROOT, "benchmarks", "generation_worker.py")
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "hf_actcomp_benchmarks")
LOOPBACK = "loopback"

TUNSETIFF, IFF_TUN, IFF_NO_PI, CLONE_NEWNET = 0x400454CA, 0x0001, 0x1000, 0x40000000


# ------------------------------------------------------------------------------------------ links
def delay_line(namespaces: list[str], devices: list[str], delay: float) -> None:
    """Forward IP packets between TUN device 0 (in namespace 0) and TUN device 1 (in namespace 1),
    each `delay` seconds after it was read, in order (one reader and one writer thread per
    direction). Runs until killed."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    fds = []
    for ns, dev in zip(namespaces, devices, strict=True):
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", dev.encode(), IFF_TUN | IFF_NO_PI))
        fds.append(fd)
        os.close(target)
    if libc.setns(home, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns back")

    def read(src: int, line: queue.Queue) -> None:
        while True:
            packet = os.read(src, 65536)
            line.put((time.monotonic() + delay, packet))

    def write(dst: int, line: queue.Queue) -> None:
        while True:
            due, packet = line.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            os.write(dst, packet)

    threads = []
    for src, dst in ((fds[0], fds[1]), (fds[1], fds[0])):
        line: queue.Queue = queue.Queue()
        threads += [threading.Thread(target=read, args=(src, line), daemon=True),
                    threading.Thread(target=write, args=(dst, line), daemon=True)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for t in threads:
        t.join()


class DelayedNamespaces:
    """Two namespaces, each with a TUN device (point to point, 10.234.<x>.1 and .2, ours only)
    shaped by `tc tbf` to `mbit`, joined by `delay_line` with `delay_ms` each way."""

    def __init__(self, mbit: int, delay_ms: float) -> None:
        tag = os.getpid() % 10000
        self.mbit, self.delay_ms = mbit, delay_ms
        self.ns = (f"acGA{tag}", f"acGB{tag}")
        self.dev = (f"tgA{tag}", f"tgB{tag}")
        subnet = 10 + tag % 200
        self.addr = (f"10.234.{subnet}.1", f"10.234.{subnet}.2")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> DelayedNamespaces:
        try:
            for ns, dev in zip(self.ns, self.dev, strict=True):
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "tuntap", "add", "dev", dev, "mode", "tun")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            for ns, dev, addr, peer in zip(self.ns, self.dev, self.addr, self.addr[::-1], strict=True):
                sh("ip", "-n", ns, "addr", "add", f"{addr}/32", "peer", f"{peer}/32", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
                shape_device(ns, dev, self.mbit)
            spec = json.dumps([list(self.ns), list(self.dev), self.delay_ms / 1e3])
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--delay_line", spec],
                                         stdout=subprocess.PIPE, text=True)
            if self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the delay line did not start")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], check=False, stderr=subprocess.DEVNULL)


def link_names(args) -> list[str]:
    return [LOOPBACK, f"{args.rate} Mbit/s", f"{args.rate} Mbit/s + {2 * args.delay_ms:g} ms RTT"]


class ShapedNamespaces(LinkedNamespaces):
    """slow_link.py's veth pair, shaped on entry."""

    def __init__(self, mbit: int) -> None:
        super().__init__()
        self.mbit = mbit

    def __enter__(self) -> ShapedNamespaces:
        super().__enter__()
        try:
            self.shape(self.mbit)
        except BaseException:
            self.__exit__()
            raise
        return self


def open_link(name: str, args):
    """The namespaces of link `name` (a context manager), or None for loopback."""
    if name == LOOPBACK:
        return None
    if "RTT" in name:
        return DelayedNamespaces(args.rate, args.delay_ms)
    return ShapedNamespaces(args.rate)


# ------------------------------------------------------------------------------------------ data
def pretrained(args) -> tuple[dict, dict]:
    """The pre-trained weights (cached by their settings) and the held-out documentation blocks,
    tokenizer facts and eval loss."""
    import torch
    from finetune_quality import corpora, pretrain
    from safetensors.torch import load_file, save_file

    pre_train, pre_eval, _, _, vocab = corpora(args)
    if args.quick:
        pre_train = pre_train.select(range(64))
    key = json.dumps({k: getattr(args, k) for k in ("pretrain_epochs", "pretrain_lr", "batch_size", "seq_len",
                                                    "quick")}, sort_keys=True)
    path = os.path.join(CACHE, f"generation_pretrained_{hashlib.sha1(key.encode()).hexdigest()[:12]}.safetensors")
    if os.path.exists(path):
        weights = load_file(path)
        with open(path + ".json") as f:
            info = json.load(f)
        print(f"pre-trained weights from {path}", flush=True)
    else:
        start = time.perf_counter()
        weights = pretrain((pre_train.with_format("torch"), pre_eval.with_format("torch"), vocab), args)
        from convergence import eval_loss, make_model
        from torch.utils.data import DataLoader
        from transformers import default_data_collator

        model = make_model(vocab, args.seq_len, seed=0)
        model.load_state_dict(weights)
        loss = eval_loss(model.eval(), DataLoader(pre_eval.with_format("torch"), batch_size=32,
                                                  collate_fn=default_data_collator))
        info = dict(settings=json.loads(key), docs_eval_loss=loss, train_blocks=len(pre_train),
                    pretrain_seconds=time.perf_counter() - start)
        os.makedirs(CACHE, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, path)
        with open(path + ".json", "w") as f:
            json.dump(info, f)
    blocks = torch.tensor(pre_eval["input_ids"])
    return weights, dict(info, vocab=vocab, eval_blocks=blocks, pad_token_id=0)


def prompt_set(blocks, count: int, args) -> list[list[int]]:
    """`count` prompts: the first 16-32 tokens (seeded lengths) of held-out documentation blocks."""
    rng = random.Random(args.seed)
    return [blocks[i % len(blocks), :rng.randint(args.prompt_min, args.prompt_max)].tolist() for i in range(count)]


def left_padded(prompts: list[list[int]], pad: int):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


# ------------------------------------------------------------------------------------------ agreement
def agreement(weights: dict, meta: dict, prompts: list[list[int]], timing: dict, args) -> dict:
    """In one process: uncompressed greedy on every prompt (batches of `--agreement_batch`), then
    per codec the free-running and teacher-forced top-1 agreement with it; also every codec's
    greedy output on the timing batches (to check the pipeline's against)."""
    import torch
    from generation_worker import CODECS, build_model, plan_of

    import hf_actcomp
    from hf_actcomp.split_generation import positions_from_mask

    model = build_model(weights, meta)
    n = args.new_tokens
    chunks = [left_padded(prompts[i:i + args.agreement_batch], meta["pad_token_id"])
              for i in range(0, len(prompts), args.agreement_batch)]

    def generate(ids, mask):
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)[:, ids.shape[1]:]

    def top1(ids, mask):
        """Argmax at the positions that predict the n generated tokens, along `ids`."""
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        return logits[:, -n - 1:-1].argmax(-1)

    with torch.no_grad():
        reference = [generate(ids, mask) for ids, mask in chunks]
        full = [(torch.cat([ids, ref], 1), torch.cat([mask, torch.ones_like(ref)], 1))
                for (ids, mask), ref in zip(chunks, reference, strict=True)]
        plain_top1 = [top1(ids, mask) for ids, mask in full]
        result = {"prompts": len(prompts), "new_tokens": n,
                  "plain_teacher_forced_equals_greedy": float(torch.cat(
                      [(t == r).flatten() for t, r in zip(plain_top1, reference, strict=True)]).float().mean()),
                  "codecs": {}}
        for name in CODECS:
            with hf_actcomp.compressed_inference(model, plan_of(name)):
                free = torch.cat([generate(ids, mask) for ids, mask in chunks])
                forced = torch.cat([top1(ids, mask) for ids, mask in full])
                timing_outputs = {str(b): generate(ids, mask).tolist() for b, (ids, mask) in timing.items()}
            ref = torch.cat(reference)
            equal = free == ref
            first = torch.where(equal.all(1), torch.full((len(ref),), n), (~equal).int().argmax(1))
            result["codecs"][name] = dict(
                free_running_equal=float(equal.float().mean()), rows_identical=float(equal.all(1).float().mean()),
                mean_first_difference=float(first.float().mean()),
                teacher_forced_top1=float((forced == torch.cat(plain_top1)).float().mean()),
                timing_outputs=timing_outputs)
            print(f"agreement {name:<11} free-running {100 * result['codecs'][name]['free_running_equal']:5.1f}% "
                  f"first difference {first.float().mean():5.1f}  teacher-forced "
                  f"{100 * result['codecs'][name]['teacher_forced_top1']:5.1f}%", flush=True)
    return result


# ------------------------------------------------------------------------------------------ summary
def spread(values: list[float]) -> dict:
    from harness import median

    return dict(median=median(values), min=min(values), max=max(values))


def step_seconds(row: dict, n: int) -> list[float]:
    """Steady-state seconds of one step in each round: (T(n) - T(1)) / (n - 1)."""
    from generation_worker import call_seconds

    return [(call_seconds(x["full"]) - call_seconds(x["prompt_step"])) / (n - 1) for x in row["rounds"]]


def summarize(rows: list[dict], meta: dict) -> list[dict]:
    """Per (link, batch, variant): ms per steady-state step, tokens/s of the whole call, the
    prompt step (median [min-max] over the rounds); bytes per step by kind (counted; the same every
    round) and on the interface; each stage's compute per step (median round); what the link adds
    over the same variant on loopback, in ms and in round trips; the regime."""
    from generation_worker import call_seconds
    from harness import median

    a = meta["args"]
    n, calls, rate = a["new_tokens"], a["calls"], a["rate"]
    loop = {(r["batch"], r["variant"]): median(step_seconds(r, n)) for r in rows if r["link"] == LOOPBACK}
    out = []
    for r in rows:
        rounds, step = r["rounds"], step_seconds(r, n)
        mid = rounds[sorted(range(len(rounds)), key=lambda i: step[i])[(len(rounds) - 1) // 2]]
        full, prompt = rounds[0]["full"], rounds[0]["prompt_step"]

        def per_step(key: str, rank: int, full=full, prompt=prompt) -> float:
            return (full[key][rank] - prompt[key][rank]) / (n - 1)

        ids = r["ids_bytes_per_step"]
        s = dict(link=r["link"], batch=r["batch"], variant=r["variant"], rtt_ms=1e3 * r["link_rtt_seconds"],
                 rtt_min_ms=1e3 * r["link_rtt_min_seconds"],
                 step_ms=spread([1e3 * v for v in step]),
                 tokens_per_s=spread([r["batch"] * n / call_seconds(x["full"]) for x in rounds]),
                 prompt_ms=spread([1e3 * call_seconds(x["prompt_step"]) for x in rounds]),
                 activation_bytes=per_step("bytes_sent_per_rank", 0),
                 activation_bytes_uncompressed=per_step("bytes_uncompressed_per_rank", 0),
                 ids_bytes=ids, tie_bytes=per_step("bytes_sent_per_rank", 1) - ids,
                 prompt_activation_bytes=prompt["bytes_sent_per_rank"][0],
                 prompt_tie_bytes=prompt["bytes_sent_per_rank"][1] - ids,
                 bytes_same_every_round=all(x["full"]["bytes_sent_per_rank"] == full["bytes_sent_per_rank"]
                                            for x in rounds),
                 other_cpu_share=max(x["full"]["other_cpu_share"] for x in rounds),
                 attempts=[x["full"].get("attempts", 1) for x in rounds])
        s["total_bytes"] = s["activation_bytes"] + s["ids_bytes"] + s["tie_bytes"]
        # each stage's time per step outside transport waits, steady state, in the median round
        s["compute_ms"] = [1e3 * ((mid["full"]["seconds"] - mid["full"]["seconds_waiting_per_rank"][rank])
                                  - (mid["prompt_step"]["seconds"] - mid["prompt_step"]["seconds_waiting_per_rank"][rank]))
                           / (n - 1) for rank in (0, 1)]
        tx = [(x["full"]["link_tx_bytes_window"], x["prompt_step"]["link_tx_bytes_window"]) for x in rounds]
        s["wire_bytes"] = (None if any(None in t for t in tx) else
                           median([(f - p) / calls / (n - 1) for f, p in tx]))
        s["serialise_ms"] = None if s["wire_bytes"] is None else 8 * s["wire_bytes"] / (rate * 1e3)
        base = loop.get((r["batch"], r["variant"]))
        if base is not None and r["link"] != LOOPBACK:
            s["loopback_step_ms"] = 1e3 * base
            s["extra_ms"] = s["step_ms"]["median"] - 1e3 * base
            s["extra_rtts"] = s["extra_ms"] / s["rtt_ms"]
        s["regime"] = regime(s)
        out.append(s)
    return out


def regime(s: dict) -> str:
    """What bounds one step: compute (the link adds less than half the loopback step), else the
    link's bytes (serialising them takes at least half of what the link adds), else its latency."""
    if "extra_ms" not in s or s["extra_ms"] < 0.5 * s["loopback_step_ms"]:
        return "compute-bound"
    if s["serialise_ms"] is not None and s["serialise_ms"] >= 0.5 * s["extra_ms"]:
        return "bytes-bound"
    return "latency-bound"


def fmt(d: dict, digits: int = 1) -> str:
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}-{d['max']:.{digits}f}]"


def write(rows: list[dict], meta: dict) -> None:
    from generation_worker import FROZEN

    summary = summarize(rows, meta)
    a = argparse.Namespace(**meta["args"])
    agree = meta["agreement"]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{a.name}.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1)
    links = list(dict.fromkeys(r["link"] for r in rows))
    shaped = [link for link in links if link != LOOPBACK]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    attempts = [n for s in summary for n in s["attempts"]]
    lines = [
        "# Generation with the model split in two: tokens/s, bytes per token, agreement", "",
        "`benchmarks/generation.py`: `Pipeline.generate`, greedy, on 2 gloo processes (1 CPU thread each; this "
        f"machine has {meta['cpus']} CPUs, shared with other work). Model: GPT-2 style, {meta['layers']} layers x "
        f"{meta['hidden_size']} hidden, vocabulary {meta['vocab']}, head tied to the input embedding "
        f"({meta['parameters'] / 1e6:.2f} M parameters), pre-trained uncompressed for {a.pretrain_epochs} epochs on "
        f"CPython's documentation (held-out loss {meta['docs_eval_loss']:.3f}); blocks 0-1 on stage 0, 2-3 on stage "
        "1: `Plan(num_stages=2, split_points=[2], forward=codec)`; the boundary uses the codec's inference form, "
        "as `Pipeline.generate` does. Codecs: `none`, `bf16`, `quantize` 8 bits, `hadamard` 4 bits (group 128 = "
        f"one token's vector); **{FROZEN}**: codec none with `requires_grad_(False)` on every parameter, which "
        "turns off the tied embedding's row exchange. Prompts: the first "
        f"{a.prompt_min}-{a.prompt_max} tokens of held-out documentation blocks, batch "
        + " and batch ".join(f"{b} ({meta['prompt_tokens'][str(b)]} prompt tokens, left-padded to "
                             f"{meta['prompt_lengths'][str(b)]})" for b in a.batch_sizes)
        + f"; {a.new_tokens} new tokens per row, no EOS (always that many).",
        "",
        "Links: **loopback**; "
        f"**{a.rate} Mbit/s**: two network namespaces joined by a veth pair, `tc tbf` on both ends, no added delay; "
        f"**{a.rate} Mbit/s + {2 * a.delay_ms:g} ms RTT**: the same rate on TUN devices, and since this kernel has "
        f"no `netem` (CONFIG_NET_SCH_NETEM is not set), a userspace delay line that writes every IP packet into the "
        f"other namespace {a.delay_ms:g} ms after reading it (each way; TCP runs end to end through it). RTT: the "
        "gloo ping-pong of one int64 between the two ranks on that link, measured by the run (median / min of "
        f"{a.pings}).",
        "",
        f"Timing: each (link, batch, variant) in {a.repeats} rounds, in alternating order; in each round {a.calls} "
        f"generate calls of {a.new_tokens} new tokens back to back, and {a.calls} of 1 (the prompt step alone). "
        f"T(n): rank 0's seconds per call over calls 2-{a.calls} (from the last token of one call to the last of the "
        f"next, as a loop of calls runs; the first call starts at a barrier). **ms/step** = (T({a.new_tokens}) - "
        f"T(1)) / {a.new_tokens - 1}: one step of the steady state (one new token for every row; prompt excluded). "
        f"**tokens/s** = batch x {a.new_tokens} / T({a.new_tokens}) (the whole call, prompt step included). Median "
        "[min-max] over the rounds. **compute 0 / 1**: each stage's time per step outside the transport's waits "
        "(wall time minus `pipe.stats()['stages'][i]['seconds_waiting']`, steady state, median round; `generate` "
        "does not advance `seconds_step`). The stages run one after the other (stage 1 waits for stage 0's hidden "
        "state, stage 0 for stage 1's token) except for bookkeeping both do at once, so compute 0 + compute 1 is "
        "a bit more than a loopback step. **extra** = ms/step minus the same variant's on loopback; on the delayed "
        "link also in round trips (its median RTT). **serialise**: the step's bytes on the interface (tx counters of both "
        f"ends: payloads, gloo, TCP/IP headers and ACKs) at {a.rate} Mbit/s. **Regime**: compute-bound where the "
        "link adds less than half the loopback step; else bytes-bound where serialising takes at least half of what "
        f"the link adds; else latency-bound. In the windows kept, other processes used at most "
        f"{100 * max(s['other_cpu_share'] for s in summary):.0f}% of the CPUs (a window above "
        f"{100 * a.max_other_cpu:.0f}% was measured again, up to {a.retries} times; {sum(n > 1 for n in attempts)} "
        f"of {len(attempts)} were).",
        "",
        "## Speed", "",
        "| link (RTT median / min) | batch | variant | ms/step | tokens/s | prompt step ms | compute 0 / 1 ms/step "
        "| extra ms/step (RTTs) | serialise ms/step | regime |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for link in links:
        for s in (s for s in summary if s["link"] == link):
            extra = "-" if "extra_ms" not in s else (f"{s['extra_ms']:.2f} ({s['extra_rtts']:.2f})" if "RTT" in link
                                                    else f"{s['extra_ms']:.2f}")
            ser = "-" if s["serialise_ms"] is None else f"{s['serialise_ms']:.3f}"
            lines.append(f"| {link} ({s['rtt_ms']:.2f} / {s['rtt_min_ms']:.2f} ms) | {s['batch']} | {s['variant']} | "
                         f"{fmt(s['step_ms'], 2)} | {fmt(s['tokens_per_s'], 0)} | {fmt(s['prompt_ms'], 1)} | "
                         f"{s['compute_ms'][0]:.2f} / {s['compute_ms'][1]:.2f} | {extra} | {ser} | {s['regime']} |")
    lines += [
        "",
        "## Bytes per step", "",
        "Counted by `pipe.stats()['categories']['inference']` on each rank (what THAT rank sent) and the same on "
        "every link and round" + ("" if all(s["bytes_same_every_round"] for s in summary) else " (NOT: see the JSON)")
        + ". Stage 0 sends the new tokens' hidden states (the codec's payload). Stage 1 sends the chosen ids "
        "and unfinished flags (2 x batch int64) and, in the same message since the head is tied, the embedding "
        "rows of the chosen tokens (one per row, fp32, exact: the first stage's copy is refreshed from the owner "
        "before each forward, as in training). The prompt step sends the prompt's hidden states once, the rows "
        "of the prompt's distinct tokens (a message of their own), and the same ids and rows. On the wire: tx bytes of both interfaces per steady-state step (payloads "
        "plus gloo's and TCP/IP's headers and the ACKs).",
        "",
        "| batch | variant | activations B/step (0->1) | uncompressed | ids (1->0) | tie rows (1->0) | total B/step "
        "| per row | on the wire B/step (" + " / ".join(shaped) + ") | prompt step: activations / tie rows B |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in a.batch_sizes:
        for v in variants:
            cells = [s for s in summary if s["batch"] == b and s["variant"] == v]
            s = cells[0]
            wire = " / ".join("-" if c["wire_bytes"] is None else f"{c['wire_bytes']:.0f}" for c in cells
                              if c["link"] != LOOPBACK)
            lines.append(f"| {b} | {v} | {s['activation_bytes']:.0f} | {s['activation_bytes_uncompressed']:.0f} | "
                         f"{s['ids_bytes']:.0f} | {s['tie_bytes']:.0f} | {s['total_bytes']:.0f} | "
                         f"{s['total_bytes'] / b:.0f} | {wire or '-'} | {s['prompt_activation_bytes']:.0f} / "
                         f"{s['prompt_tie_bytes']:.0f} |")
    lines += [
        "",
        "## Agreement with uncompressed greedy", "",
        f"{agree['prompts']} prompts (batches of {a.agreement_batch}, left-padded), {agree['new_tokens']} new tokens, "
        "in one process through `hf_actcomp.compressed_inference(model, plan)` (the same inference codec at the "
        "same boundary). **Free-running**: the compressed model generates on its own; the share of generated "
        "positions whose token equals uncompressed greedy's at that position, the share of rows equal throughout, "
        f"and the mean index of the first different token ({agree['new_tokens']} where none differs). "
        "**Teacher-forced**: along uncompressed greedy's sequences, the share of the positions that predict a "
        "generated token where the compressed model's top-1 equals the uncompressed model's (the uncompressed "
        "model's teacher-forced top-1 equals its own greedy token at "
        f"{100 * agree['plain_teacher_forced_equals_greedy']:.1f}% of them). **Pipeline = in-process**: the "
        "pipeline's tokens on the timing batches (round 0, every link) equal `compressed_inference`'s "
        f"(for {FROZEN}: codec none's).",
        "",
        "| codec | free-running: tokens equal | rows equal | mean first difference | teacher-forced top-1 | "
        "pipeline = in-process |",
        "|---|---|---|---|---|---|",
    ]
    for name in [*agree["codecs"], FROZEN]:
        c = agree["codecs"][name if name != FROZEN else "none"]
        same = [r["generated"] == c["timing_outputs"][str(r["batch"])] for r in rows
                if r["variant"] == name and "generated" in r]
        verdict = "yes" if same and all(same) else f"NO ({sum(same)} of {len(same)})"
        if name == FROZEN:
            lines.append(f"| {name} | (as none) | | | | {verdict} |")
            continue
        lines.append(f"| {name} | {100 * c['free_running_equal']:.2f}% | {100 * c['rows_identical']:.1f}% | "
                     f"{c['mean_first_difference']:.1f} | {100 * c['teacher_forced_top1']:.2f}% | {verdict} |")
    lines += ["", "## What bounds a token (this CPU)", ""] + findings(summary, meta)
    write_markdown(RESULTS, a.name, lines)


def findings(summary: list[dict], meta: dict) -> list[str]:
    """The regime of each link, what compression changes, and the arithmetic of one step's bytes
    against the link's round trip, with this run's numbers."""
    from generation_worker import FROZEN

    a = argparse.Namespace(**meta["args"])
    hidden, rate = meta["hidden_size"], a.rate
    at = {(s["link"], s["batch"], s["variant"]): s for s in summary}
    links = list(dict.fromkeys(s["link"] for s in summary))
    codecs = [v for v in dict.fromkeys(s["variant"] for s in summary) if v not in ("none", FROZEN)]
    ms = lambda nbytes: 8 * nbytes / (rate * 1e3)  # noqa: E731
    big = a.batch_sizes[-1]
    lines = []
    for link in links:
        cells = [s for s in summary if s["link"] == link]
        regimes = sorted({s["regime"] for s in cells})
        change = [abs(at[(link, b, c)]["step_ms"]["median"] / at[(link, b, "none")]["step_ms"]["median"] - 1)
                  for b in a.batch_sizes for c in codecs if (link, b, c) in at and (link, b, "none") in at]
        text = (f"- **{link}**: {' / '.join(regimes)}. ms/step of none: "
                + ", ".join(f"batch {b} {at[(link, b, 'none')]['step_ms']['median']:.1f}" for b in a.batch_sizes
                            if (link, b, "none") in at) + ".")
        if link == LOOPBACK:
            cost = ", ".join(
                f"{c} {sum(at[(link, b, c)]['compute_ms']) - sum(at[(link, b, 'none')]['compute_ms']):+.2f} ms at "
                f"batch {b}" for c in codecs for b in a.batch_sizes if (link, b, c) in at)
            text += (" A step is the two stages' own work (Python, the logits processors, the small matmuls, "
                     f"encode/decode); the codecs change ms/step by up to {100 * max(change):.0f}%, mostly within "
                     f"the rounds' spread; their compute 0 + 1 per step against none's: {cost}.")
        elif "RTT" not in link:
            extra = [s["extra_ms"] for s in cells if "extra_ms" in s]
            ser = [s["serialise_ms"] for s in cells if s["serialise_ms"] is not None]
            text += (f" The link adds {min(extra):.1f} to {max(extra):.1f} ms per step over loopback (about the "
                     f"rounds' spread); serialising a step's wire bytes takes at most {max(ser):.2f} ms. Compression "
                     f"changes ms/step by at most {100 * max(change):.0f}%: the codecs' own encode/decode, as on "
                     "loopback, not the link.")
        else:
            none = [at[(link, b, "none")] for b in a.batch_sizes]
            frozen = [at[(link, b, FROZEN)] for b in a.batch_sizes if (link, b, FROZEN) in at]
            ser = [s["serialise_ms"] for s in cells if s["serialise_ms"] is not None]
            saved = at[(link, big, "none")]["serialise_ms"] - min(at[(link, big, c)]["serialise_ms"] for c in codecs)
            text += (" The link adds "
                     + ", ".join(f"{s['extra_rtts']:.2f} RTTs ({s['extra_ms']:.1f} ms) at batch {s['batch']}"
                                 for s in none)
                     + " to every step over loopback; serialising a step's wire bytes takes at most "
                     f"{max(ser):.2f} ms, {100 * max(ser) / min(s['step_ms']['median'] for s in cells):.1f}% of a "
                     f"step. **Compression buys nothing here**: no codec changes ms/step by more than "
                     f"{100 * max(change):.0f}% (at batch {big}, the smallest payload saves "
                     f"{saved:.2f} ms of serialisation per step against a "
                     f"{none[0]['rtt_ms']:.0f} ms round trip).")
            if frozen:
                tie_rtts = none[-1]["extra_rtts"] - frozen[-1]["extra_rtts"]
                text += (" With every weight frozen (no tied rows at all) the link adds "
                         + ", ".join(f"{s['extra_rtts']:.2f} RTTs" for s in frozen) + ": ")
                if tie_rtts > 0.5:
                    text += (f"the tied rows cost {tie_rtts:.2f} more round trips per step, as a message of "
                             "their own that gloo sends only once stage 0 has posted its receive, which it can "
                             "do only after the ids are in.")
                else:
                    text += (f"the tied rows, riding with the ids, cost no round trip of their own per step "
                             f"({tie_rtts:+.2f} RTTs). The prompt step still pays one: the prompt's distinct "
                             "rows are a message of their own, which gloo sends only once stage 0's receive, posted as "
                             "the call starts, has reached stage 1 (prompt step "
                             + ", ".join(f"none {n['prompt_ms']['median']:.0f} vs frozen "
                                         f"{f['prompt_ms']['median']:.0f} ms at batch {n['batch']}"
                                         for n, f in zip(none, frozen, strict=True))
                             + "). Before commit 17ce46f the rows of every step went that way too, and a step "
                             "took 2.06 RTTs (1.07 frozen; this file's earlier version).")
        lines.append(text)
    act_ratio = {c: at[(LOOPBACK if (LOOPBACK, a.batch_sizes[-1], c) in at else links[0], a.batch_sizes[-1], c)]
                 for c in ["none", *codecs]}
    lines.append(f"- **Bytes**: at batch {big} the codecs cut the activations per step "
                 + ", ".join(f"{c} {act_ratio[c]['activation_bytes_uncompressed'] / act_ratio[c]['activation_bytes']:.1f}x"
                             for c in codecs)
                 + ", but the step's total only "
                 + ", ".join(f"{act_ratio['none']['total_bytes'] / act_ratio[c]['total_bytes']:.1f}x" for c in codecs)
                 + " (ids and the tied rows are not compressed), and what the interface carries less still (gloo "
                 "and TCP/IP headers and ACKs are a fixed cost per message).")
    agree = meta["agreement"]["codecs"]
    lines.append("- **Quality**: teacher-forced top-1 agreement "
                 + ", ".join(f"{c} {100 * agree[c]['teacher_forced_top1']:.2f}%" for c in codecs if c in agree)
                 + "; free-running, the share of generated tokens equal to uncompressed greedy's "
                 + ", ".join(f"{c} {100 * agree[c]['free_running_equal']:.2f}% (rows equal throughout "
                             f"{100 * agree[c]['rows_identical']:.0f}%)" for c in codecs if c in agree)
                 + ": a single flipped token changes the rest of a greedy continuation.")
    rtt_nominal = 2 * a.delay_ms
    budget = rate * 1e6 * rtt_nominal / 1e3 / 8
    lines += ["", "### The arithmetic", "",
              f"One step's hidden states are hidden x batch x bytes per element: {hidden} x b x 4 B in fp32. At "
              f"{rate} Mbit/s a {rtt_nominal:g} ms round trip is worth {budget / 1e3:.0f} kB of serialisation, so a "
              f"step's bytes would weigh as much as one round trip only at about {budget / (hidden * 4):.0f} rows of "
              f"this model in fp32, or {budget / (4096 * 4):.0f} rows of a hidden-4096 (7B-class) model in fp32 "
              f"({budget / (4096 * 2):.0f} in bf16). Below that, compressing the boundary of one token cannot make "
              "generation on such a link noticeably faster; the prompt step, whose hidden states cross once for the "
              "whole prompt, is where bytes show.", ""]
    for b in a.batch_sizes:
        act = hidden * b * 4
        lines.append(f"- Batch {b}: {hidden} x {b} x 4 = {act} B of fp32 hidden states per step ({act // 2} B in "
                     f"bf16), plus {16 * b} B of ids and up to {act} B of tied rows: {ms(act):.3f} ms of "
                     f"serialisation at {rate} Mbit/s for the activations.")
        for link in links:
            if "RTT" not in link or (link, b, "none") not in at:
                continue
            none = at[(link, b, "none")]
            lines.append(f"  - {link}: none {fmt(none['step_ms'], 2)} ms/step = loopback's "
                         f"{none['loopback_step_ms']:.2f} + {none['extra_ms']:.2f} ms ({none['extra_rtts']:.2f} RTTs); "
                         f"its {none['wire_bytes']:.0f} wire bytes per step take {none['serialise_ms']:.3f} ms. "
                         "Prompt step: " + ", ".join(
                             f"{v} {at[(link, b, v)]['prompt_ms']['median']:.1f} ms "
                             f"({at[(link, b, v)]['prompt_activation_bytes'] / 1e3:.1f} kB of activations)"
                             for v in ["none", *codecs]) + ".")
    return lines


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--delay_line":
        delay_line(*json.loads(argv[1]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, rate=100, new_tokens=64, calls=(4, "generate calls per timed window (back to back)"),
                  repeats=3, pings=20, pretrain_epochs=4, pretrain_lr=2e-3,
                  batch_size=(16, "of pre-training"), seq_len=128,
                  eval_samples=(16, "(corpora(): unused here)"),
                  stdlib_files=(2, "(corpora(): unused here)"), seed=(0, "prompt lengths"),
                  max_other_cpu=0.1, retries=2, timeout=3600,
                  train_samples=(16, "(corpora(): fine-tuning blocks, unused here)"),
                  quiet_wait=(30.0, "seconds at most to wait for a quiet machine before measuring a window again"),
                  quick=(False, "a tiny run that checks the script works (< 1 minute)"),
                  rewrite=(False, "only rewrite the .md (and summary) from the .json"))
    p.add_argument("--delay_ms", type=float, default=10.0, help="one-way delay of the delayed link")
    p.add_argument("--links", nargs="+", default=None, help="a subset of the links (by name)")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt_min", type=int, default=16)
    p.add_argument("--prompt_max", type=int, default=32)
    p.add_argument("--agreement_prompts", type=int, default=64)
    p.add_argument("--agreement_batch", type=int, default=8)
    p.add_argument("--name", default="generation", help="results file name in benchmarks/results/")
    args = p.parse_args(argv)
    if args.rewrite:
        with open(os.path.join(RESULTS, f"{args.name}.json")) as f:
            saved = json.load(f)
        write(saved["rows"], saved["meta"])
        return
    if args.quick:
        args.pretrain_epochs, args.batch_sizes, args.new_tokens, args.calls = 1, [2], 6, 2
        args.agreement_prompts, args.agreement_batch, args.pings, args.retries = 4, 2, 3, 0
        args.name = f"{args.name}_quick"
        args.links = args.links or [LOOPBACK, link_names(args)[2]]  # the delay line, not the plain veth pair
    if args.repeats < 3:
        p.error("--repeats must be at least 3 (median and spread)")
    if args.prompt_max + args.new_tokens > args.seq_len:
        p.error(f"--prompt_max + --new_tokens must fit the model's {args.seq_len} positions")
    links = args.links or link_names(args)
    if os.geteuid() != 0 and links != [LOOPBACK]:
        print("not root: loopback only (namespaces, TUN and tc need root)", flush=True)
        links = [LOOPBACK]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the namespaces are removed
    import torch
    from generation_worker import VARIANTS
    from harness import run_workers
    from safetensors.torch import save_file

    started = time.time()
    weights, info = pretrained(args)
    prompts = prompt_set(info.pop("eval_blocks"), max(args.agreement_prompts, max(args.batch_sizes)), args)
    timing = {b: left_padded(prompts[:b], info["pad_token_id"]) for b in args.batch_sizes}
    hidden = weights["transformer.wte.weight"].shape[1]
    meta = dict(args=vars(args), links=links, cpus=os.cpu_count(), torch=torch.__version__,
                python=platform.python_version(), hidden_size=hidden, vocab=info["vocab"],
                layers=sum(k.endswith(".ln_1.weight") for k in weights),
                parameters=sum(v.numel() for k, v in weights.items() if k != "lm_head.weight"),
                docs_eval_loss=info["docs_eval_loss"], pad_token_id=info["pad_token_id"],
                prompt_lengths={str(b): int(ids.shape[1]) for b, (ids, _) in timing.items()},
                prompt_tokens={str(b): int(mask.sum()) for b, (_, mask) in timing.items()})
    meta["agreement"] = agreement(weights, info | {"seq_len": args.seq_len}, prompts[:args.agreement_prompts],
                                  timing, args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="generation_") as tmp:
        data = os.path.join(tmp, "data.safetensors")
        tensors = {f"weights.{k}": v.contiguous() for k, v in weights.items()}
        for b, (ids, mask) in timing.items():
            tensors[f"prompts{b}.input_ids"], tensors[f"prompts{b}.attention_mask"] = ids, mask
        save_file(tensors, data)
        with open(data + ".json", "w") as f:
            json.dump(dict(batch_sizes=args.batch_sizes, vocab=info["vocab"], seq_len=args.seq_len,
                           pad_token_id=info["pad_token_id"]), f)
        worker_args = [f"--data={data}", "--variants", *VARIANTS]
        worker_args += [f"--{k}={getattr(args, k)}" for k in ("new_tokens", "calls", "repeats", "max_other_cpu",
                                                               "retries", "pings", "quiet_wait")]
        port = 29800 + os.getpid() % 1000
        for i, link in enumerate(links):
            start = time.time()
            net = open_link(link, args)
            if net is None:
                rows += run_workers(WORKER, 2, link, worker_args, None, port + i, args.timeout)["rows"]
            else:
                with net:
                    rows += run_workers(WORKER, 2, link, worker_args, net, port + i, args.timeout)["rows"]
            print(f"{link}: {time.time() - start:.0f} s", flush=True)
    meta["seconds"] = time.time() - started
    write(rows, meta)


if __name__ == "__main__":
    main()
