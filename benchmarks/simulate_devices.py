"""`simulate` training on CUDA against the CPU: the same plan, seed and batches on both devices.

A small random Llama (hf_actcomp.debug) trains `--steps` SGD steps over 16 samples that every
epoch revisits (as AQ-SGD needs) under each plan: uncompressed, AQ-SGD fw4/bw8 and TopK 10% with
error feedback. The losses of each step on both devices, their largest relative difference, and
the final loss. The kernels differ, so bits may not agree; the curves must, to a float tolerance.

    python benchmarks/simulate_devices.py            # writes simulate_cuda.{json,md}; needs CUDA
    python benchmarks/simulate_devices.py --devices cpu cpu --steps 4   # checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import write_markdown  # noqa: E402

from hf_actcomp import Compression, MemoryConfig, Plan, simulate  # noqa: E402
from hf_actcomp.debug import debug_model  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SAMPLES = 16

PLANS = {
    "uncompressed": lambda: Plan(num_stages=2, micro_batches=2),
    "AQ-SGD fw4 / bw8": lambda: Plan(num_stages=2, micro_batches=2, forward=Compression("aqsgd", bits=4),
                                     backward=Compression("quantize", bits=8),
                                     memory=MemoryConfig(num_samples=SAMPLES, dtype="fp32")),
    "TopK 10% + EF / bw8": lambda: Plan(num_stages=2, micro_batches=2,
                                        forward=Compression("topk", ratio=0.1, feedback="ef"),
                                        backward=Compression("quantize", bits=8)),
}


def losses(plan: Plan, device: str, steps: int) -> list[float]:
    """SGD (lr 0.1, clip 1) over batches of 4 of the SAMPLES fixed sequences, on `device`."""
    model = debug_model("llama", seed=0).to(device)
    sim = simulate(model, plan)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, model.config.vocab_size, (SAMPLES, 32), generator=g)
    optimizer = torch.optim.SGD(sim.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        ids = (torch.arange(4) + 4 * step) % SAMPLES
        batch = dict(input_ids=data[ids], attention_mask=torch.ones_like(data[ids]), labels=data[ids], sample_id=ids)
        loss = sim(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(sim.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", nargs=2, default=["cpu", "cuda"], help="the reference and the device compared")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--name", default="simulate_cuda")
    args = p.parse_args(argv)
    reference, other = args.devices
    rows = []
    for label, make in PLANS.items():
        curves = {d: losses(make(), d, args.steps) for d in (reference, other)}
        worst = max(abs(a - b) / abs(a) for a, b in zip(curves[reference], curves[other], strict=True))
        rows.append(dict(plan=label, losses=curves, max_relative_difference=worst))
        print(f"{label}: final {curves[reference][-1]:.5f} ({reference}) vs {curves[other][-1]:.5f} ({other}), "
              f"largest relative difference {worst:.2e}", flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    with open(os.path.join(RESULTS, f"{args.name}.json"), "w") as f:
        json.dump({"devices": args.devices, "gpu": gpu, "steps": args.steps, "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    lines = [f"# simulate() on {other} ({gpu or 'no GPU'}) against {reference}", "",
             f"`benchmarks/simulate_devices.py`: a random 2-block Llama (hf_actcomp.debug), 2 stages x 2 micro-batches, "
             f"{args.steps} SGD steps over {SAMPLES} revisited samples, torch {torch.__version__}; fp32 on both.", "",
             f"| plan | first loss | final loss, {reference} | final loss, {other} | largest relative difference over the run |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        c = r["losses"]
        lines.append(f"| {r['plan']} | {c[reference][0]:.5f} | {c[reference][-1]:.5f} | {c[other][-1]:.5f} | "
                     f"{r['max_relative_difference']:.1e} |")
    write_markdown(RESULTS, args.name, lines)


if __name__ == "__main__":
    main()
