"""One run of benchmarks/compile.py: `python compile_worker.py --spec JSON --out FILE`.

Builds the spec's model (random init, `seed`), `simulate(model, plan, compile=...)`, and times
`steps` AdamW training steps (forward, backward, clip at 1.0, optimizer step, zero_grad) over a
fixed set of `samples` random-token rows in batches of `batch` (AQ-SGD's sample ids revisit).
Writes each step's wall and CPU seconds, each step's loss, and the graphs dynamo compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import transformers

import hf_actcomp


def batches(vocab: int, samples: int, batch: int, seq_len: int, steps: int):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (samples, seq_len), generator=g)
    for step in range(steps):
        ids = (torch.arange(batch) + step * batch) % samples
        input_ids = data[ids]
        yield {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone(),
               "sample_id": ids}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    spec = json.loads(args.spec)
    torch.set_num_threads(1)
    config = transformers.AutoConfig.for_model(spec["family"], attn_implementation="sdpa", **spec["config"])
    torch.manual_seed(spec["seed"])
    model = transformers.AutoModelForCausalLM.from_config(config)
    plan = hf_actcomp.Plan.from_dict({**spec["plan"], "memory": {**spec["plan"].get("memory", {}),
                                                                  "num_samples": spec["samples"]}})
    kwargs = {"compile": True, "compile_kwargs": spec["compile_kwargs"]} if spec["compile"] else {}
    sim = hf_actcomp.simulate(model, plan, **kwargs)
    optimizer = torch.optim.AdamW(sim.parameters(), lr=1e-3)
    wall, cpu, losses = [], [], []
    for batch in batches(config.vocab_size, spec["samples"], spec["batch"], spec["seq_len"], spec["steps"]):
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = sim(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(sim.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    params = sum(p.numel() for p in model.parameters())
    with open(args.out, "w") as f:
        json.dump({"wall": wall, "cpu": cpu, "losses": losses, "graphs": graphs, "parameters": params,
                   "package": os.path.dirname(hf_actcomp.__file__)}, f)


if __name__ == "__main__":
    main()
