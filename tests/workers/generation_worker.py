"""Worker of the generation tests: `python generation_worker.py OUT_DIR FAMILY [FAMILY ...]`.

Each rank computes `model.generate` on the unsplit model first (prepare frees the other stages),
then `Pipeline.generate` on the split one, and writes both, and the bytes counted, per family.
"""

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import hf_actcomp
from hf_actcomp import Compression, Plan
from hf_actcomp.debug import debug_model
from hf_actcomp.pipeline import split_generator as generate


def left_padded_prompts(model, lengths=(9, 5, 2), seed=1):
    """A batch of prompts of different lengths, left-padded."""
    g = torch.Generator().manual_seed(seed)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, model.config.vocab_size - 1, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def build(family: str):
    """The debug model of `family`; `mixtral-aux`: Mixtral with its router's load-balancing loss on."""
    if family == "mixtral-aux":
        return debug_model("mixtral", seed=0, output_router_logits=True, router_aux_loss_coef=0.5).eval()
    return debug_model(family, seed=0).eval()


@contextlib.contextmanager
def spying_on_logits():
    """The raw last-position logits the last stage picks each token from (empty on other stages)."""
    seen = []
    original = generate.next_tokens

    def spy(config, processors, input_ids, logits):
        seen.append(logits.detach().clone())
        return original(config, processors, input_ids, logits)

    generate.next_tokens = spy
    try:
        yield seen
    finally:
        generate.next_tokens = original


def logits_difference(got: list, reference: tuple) -> dict | None:
    """Largest absolute difference of the step logits, and the largest reference logit."""
    if not got:
        return None
    assert len(got) == len(reference), (len(got), len(reference))
    return {"max_diff": max(float((g - r).abs().max()) for g, r in zip(got, reference, strict=True)),
            "scale": max(float(r.abs().max()) for r in reference), "steps": len(got)}


def hung(out_dir: str) -> None:
    """The last stage stays alive but never generates: the first stage's wait for the next token
    ids fails with PeerTimeoutError after the timeout."""
    model = build("llama")
    ids, mask = left_padded_prompts(model)
    pipe = hf_actcomp.prepare(model, Plan(num_stages=2), timeout=2)
    done = os.path.join(out_dir, "hung.json")
    if dist.get_rank() == 0:
        start = time.perf_counter()
        try:
            pipe.generate(ids, attention_mask=mask, max_new_tokens=4)
            report = {"error": None}
        except hf_actcomp.PeerTimeoutError as err:
            report = {"error": str(err), "seconds": time.perf_counter() - start}
        with open(done, "w") as f:
            json.dump(report, f)
        os._exit(0)  # the abandoned receive goes with the process
    deadline = time.monotonic() + 60  # alive, never sending, until rank 0 has reported
    while time.monotonic() < deadline and not os.path.exists(done):
        time.sleep(0.2)
    time.sleep(0.5)
    os._exit(0)


def main() -> None:
    out_dir, *families = sys.argv[1:]
    dist.init_process_group("gloo")
    if families == ["hung"]:
        hung(out_dir)
    results = {}
    try:
        for family in families:
            if family.startswith("loaded:"):  # a checkpoint by path: each rank loads only its stage
                path = family.split(":", 1)[1]
                pipe = hf_actcomp.prepare(path, Plan(num_stages=dist.get_world_size()), timeout=60)
                ids, mask = left_padded_prompts(pipe.model)
                held = {n: p.numel() for n, p in pipe.model.named_parameters() if p.device.type != "meta"}
                blocks = pipe.ranges[pipe.stage_index]
                results["loaded"] = {
                    "got": pipe.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False).tolist(),
                    "held": held, "blocks": [blocks.start, blocks.stop]}
                continue
            model = build(family)
            ids, mask = left_padded_prompts(model)
            settings = {"greedy": {"do_sample": False}, "sampled": {"do_sample": True, "temperature": 0.7,
                                                                    "top_k": 50, "top_p": 0.9}}
            stages = dist.get_world_size()
            int8 = Plan(num_stages=stages, forward=Compression("quantize", bits=8))
            expected = {}
            # transformers' own generate computes the load-balancing loss at each step and fails on
            # left padding with it on; the tokens do not depend on it: the reference runs without.
            router_logits = getattr(model.config, "output_router_logits", False)
            if router_logits:
                model.config.output_router_logits = False
            for name, kwargs in settings.items():
                torch.manual_seed(123)
                expected[name] = model.generate(ids, attention_mask=mask, max_new_tokens=8, **kwargs).tolist()
            with hf_actcomp.compressed_inference(model, int8) as inference:  # in one process, same codec
                expected["int8"] = inference.generate(ids, attention_mask=mask, max_new_tokens=8,
                                                      do_sample=False).tolist()
            with torch.no_grad():  # the raw logits of each greedy step
                reference = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                           output_logits=True, return_dict_in_generate=True).logits
            if router_logits:
                model.config.output_router_logits = True
            got = {}
            pipe = hf_actcomp.prepare(model, Plan(num_stages=stages), timeout=60)
            for name, kwargs in settings.items():
                torch.manual_seed(123)  # only the last stage draws
                with spying_on_logits() as logits:
                    got[name] = pipe.generate(ids, attention_mask=mask, max_new_tokens=8, **kwargs).tolist()
                if name == "greedy":
                    greedy_logits = logits
            inference_bytes = pipe.stats()["categories"].get("inference", {}).get("bytes_sent", 0)
            side_bytes = pipe.links["forward_out"].side_bytes if "forward_out" in pipe.links else 0
            compressed = hf_actcomp.prepare(build(family), int8, timeout=60)
            got["int8"] = compressed.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False).tolist()
            results[family] = {"expected": expected, "got": got, "inference_bytes": inference_bytes,
                               "side_bytes": side_bytes, "router": pipe.router is not None,
                               "hidden_size": model.config.hidden_size,
                               "tied": bool(compressed.tie is not None),
                               "logits": logits_difference(greedy_logits, reference)}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{int(os.environ['RANK'])}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
