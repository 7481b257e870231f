"""`simulate(..., compile=True)` and `prepare(..., compile=True)`: each stage's decoder blocks compiled
in place, the same losses and gradients as eager.

Tolerance: losses rtol 1e-5, gradients atol 1e-5 / rtol 1e-4 (as the pipeline's exactness tests). With
the "aot_eager" backend (dynamo's graph capture and AOT autograd, no code generation) the numbers are
the eager ones; with inductor (the default) they differ by the fused kernels' reassociation: measured
on the GPT-2 and Llama debug models over 4 steps, at most 3.3e-7 in a gradient (whose largest entry is
~0.4) and 4.8e-7 in a loss (~5.6). The debug models have no dropout (with dropout, inductor draws its
own random masks). Inductor compiles C++ on a CPU, ~25 s for a block's forward and backward with an
empty cache (~10 s once cached), so it runs once here (GPT-2, in this process); the other cases, the
2-process pipeline included, use "aot_eager".
"""

import json

import pytest
import torch
from distributed import run_workers
from pipeline_cases import NUM_SAMPLES, padded_batch, training_batches
from safetensors.torch import load_file
from torch._dynamo.testing import CompileCounterWithBackend

from hf_actcomp import Plan, simulate
from hf_actcomp.debug import debug_model
from hf_actcomp.models.compile import compile_options

GRAD_TOL = dict(atol=1e-5, rtol=1e-4)
LOSS_TOL = dict(atol=0.0, rtol=1e-5)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no graph of an earlier test's model counts, and no earlier
    test's cache entries count towards dynamo's recompile limit (past it, blocks run eager)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def train(model, compile_kwargs: dict | None, steps: int = 3):
    """Per step the loss and every parameter's gradient of `simulate(model)` (2 stages, 2
    micro-batches, identity codec) under SGD; the first batch is padded (a mask tensor)."""
    sim = simulate(model, Plan(num_stages=2, micro_batches=2), compile=compile_kwargs is not None,
                   compile_kwargs=compile_kwargs)
    optimizer = torch.optim.SGD([p for p in sim.parameters() if p.requires_grad], lr=0.1)
    batches = [padded_batch(model.config.vocab_size), *training_batches(model.config.vocab_size, steps - 1)]
    losses, grads = [], []
    for batch in batches:
        loss = sim(**batch).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in sim.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def assert_same_training(eager, compiled):
    (eager_losses, eager_grads), (losses, grads) = eager, compiled
    torch.testing.assert_close(losses, eager_losses, **LOSS_TOL)
    for step, (ref, got) in enumerate(zip(eager_grads, grads, strict=True)):
        assert set(got) == set(ref) and ref
        for name, grad in got.items():
            torch.testing.assert_close(grad, ref[name], **GRAD_TOL, msg=lambda m, n=f"step {step} {name}": f"{n}: {m}")


MOE_AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


@pytest.mark.parametrize("family, overrides", [("gpt2", {}), ("llama", {}), ("mixtral", MOE_AUX)],
                         ids=["gpt2", "llama", "mixtral-aux"])
def test_simulate_compiled_matches_eager(family, overrides):
    """GPT-2 (tied head), Llama (untied, GQA) and Mixtral with its load-balancing loss (the
    router's recording hook runs inside the blocks)."""
    eager = train(debug_model(family, seed=0, **overrides), None)
    counter = CompileCounterWithBackend("aot_eager")
    model = debug_model(family, seed=0, **overrides)
    compiled = train(model, {"backend": counter})
    assert_same_training(eager, compiled)
    # Compiled, in place (same names), and shared: the 4 blocks share graphs (one per input shape
    # and requires_grad of the input), far fewer than one per block and batch shape.
    blocks = model.get_submodule("transformer.h" if family == "gpt2" else "model.layers")
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert set(dict(model.named_parameters())) == set(dict(debug_model(family, seed=0).named_parameters()))
    if not overrides:
        assert 1 <= counter.frame_count <= 3, counter.frame_count
    else:  # the router's recording hook breaks Mixtral's block into pieces, each shared too: 10 frames
        # measured for 4 blocks x 3 steps (padded, then unpadded batches); one set per block would be more
        assert 4 <= counter.frame_count <= 12 and counter.op_count > 0, (counter.frame_count, counter.op_count)


def test_simulate_inductor_matches_eager():
    """The default backend, once: GPT-2 (tied head), a padded and 2 unpadded batches."""
    eager = train(debug_model("gpt2", seed=0), None)
    counter = CompileCounterWithBackend("inductor")
    compiled = train(debug_model("gpt2", seed=0), {"backend": counter})
    assert counter.frame_count >= 1
    assert_same_training(eager, compiled)


def test_compiled_with_activation_checkpointing_and_lora():
    """transformers' activation checkpointing wraps the layer's forward and is traced into the
    block's graph; PEFT's LoRA layers are inside the blocks: both give eager's numbers."""
    pytest.importorskip("peft")
    from trainer_cases import lora_model

    def build():
        model = debug_model("gpt2", seed=0)
        model.activation_checkpointing_enable()
        return lora_model(model)

    eager = train(build(), None)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = train(build(), {"backend": counter})
    assert counter.frame_count >= 1
    assert_same_training(eager, compiled)
    assert compiled[1][0] and all("lora_" in name for name in compiled[1][0])  # only the adapter trains


def test_pipeline_compiled_matches_eager(tmp_path):
    """2 processes: the first step's gradients of each stage and 3 SGD steps' losses of
    `prepare(..., compile=True)` equal the eager pipeline's (identity codec)."""
    run_workers("compile_worker.py", 2, [str(tmp_path), "llama", "aot_eager"], timeout=240)
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            result = json.load(f)
        assert result["compiled"]["graphs"] >= 1
        torch.testing.assert_close(result["compiled"]["losses"], result["eager"]["losses"], **LOSS_TOL)
        eager, compiled = (load_file(tmp_path / f"{name}-rank{rank}.safetensors") for name in ("eager", "compiled"))
        assert set(eager) == set(compiled) and any(k.startswith("grad.") for k in eager)
        for key, grad in compiled.items():
            torch.testing.assert_close(grad, eager[key], **GRAD_TOL, msg=lambda m, k=f"rank {rank} {key}": f"{k}: {m}")


def test_compile_arguments_are_checked():
    assert compile_options(False, None) is None
    assert compile_options(True, None) == {}
    assert compile_options(True, {"backend": "aot_eager", "mode": None}) == {"backend": "aot_eager", "mode": None}
    with pytest.raises(ValueError, match="compile=False"):
        simulate(debug_model("gpt2"), Plan(num_stages=2), compile_kwargs={"backend": "inductor"})
    with pytest.raises(ValueError, match="unknown torch.compile arguments"):
        simulate(debug_model("gpt2"), Plan(num_stages=2), compile=True, compile_kwargs={"fullgraf": True})
    with pytest.raises(TypeError, match="True or False"):
        simulate(debug_model("gpt2"), Plan(num_stages=2), compile="inductor")



def test_trainer_torch_compile_compiles_the_stages(tmp_path):
    """`TrainingArguments(torch_compile=True)` under ActCompTrainer (one process): the stages'
    blocks are compiled (graphs captured; the model keeps its own modules, not a compiled wrapper)
    and the logged losses equal an eager run's."""
    from torch._dynamo.utils import counters
    from trainer_cases import pad_collator, ragged_dataset, training_args

    from hf_actcomp import ActCompTrainer

    counters.clear()
    runs = []
    for compile_backend in (None, "aot_eager"):
        extra = {"torch_compile": True, "torch_compile_backend": compile_backend} if compile_backend else {}
        args = training_args(str(tmp_path / str(compile_backend)), **extra)
        trainer = ActCompTrainer(model=debug_model("gpt2", seed=0), args=args, plan=Plan(num_stages=2),
                                 train_dataset=ragged_dataset(), data_collator=pad_collator)
        assert counters["stats"]["unique_graphs"] == 0  # nothing compiled before training
        trainer.train()
        runs.append([h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h])
    assert counters["stats"]["unique_graphs"] > 0  # the blocks went through the compiler
    assert type(trainer.model).__name__ == "GPT2LMHeadModel"
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)


def test_fused_quantizers_give_the_eager_payload():
    """`fuse` compiles encode and decode of the deterministic quantizers only; with the aot_eager
    backend (no code generation) the payload and the decoded tensor are eager's bit for bit."""
    from hf_actcomp.codecs import make_codec
    from hf_actcomp.codecs.fused import fuse

    x = torch.randn(2, 8, 256) * torch.linspace(0.1, 40, 256)
    for name, params in [("quantize", dict(bits=4)), ("quantize", dict(bits=8, granularity="channel")),
                         ("hadamard", dict(bits=4))]:
        counter = CompileCounterWithBackend("aot_eager")
        eager, fused = make_codec(name, **params), fuse(make_codec(name, **params), {"backend": counter})
        payload = fused.encode(x)
        assert torch.equal(payload, eager.encode(x)), (name, params)
        assert torch.equal(fused.decode(payload, x.shape, x.dtype), eager.decode(payload, x.shape, x.dtype))
        assert counter.frame_count >= 2, (name, params, counter.frame_count)  # encode and decode compiled
    # hadamard_codebook: only its search for the tiles' scales is compiled.
    counter = CompileCounterWithBackend("aot_eager")
    eager, fused = make_codec("hadamard_codebook", levels=11), fuse(make_codec("hadamard_codebook", levels=11),
                                                                    {"backend": counter})
    assert torch.equal(fused.encode(x), eager.encode(x)) and counter.frame_count == 1
    assert "decode" not in vars(fused) and "encode" not in vars(fused)  # the rest stays eager
    for name, params in [("quantize", dict(bits=4, rounding="stochastic")), ("topk", dict(ratio=0.1)),
                         ("hadamard_outliers", dict(bits=4)), ("none", {})]:
        codec = make_codec(name, **params)
        assert fuse(codec, {}) is codec and not getattr(codec, "fused", False), (name, params)


def test_simulate_compiled_fuses_the_boundary_quantizers():
    """`simulate(compile=True)`: the boundaries' quantizers (AQ-SGD's inner codec and its mirror,
    the backward quantizer, the inference form) are fused; the losses and gradients are eager's."""
    plan = Plan(num_stages=2, micro_batches=2, forward={"method": "aqsgd", "bits": 4},
                backward={"method": "quantize", "bits": 8}, memory={"num_samples": NUM_SAMPLES})

    def run(compile_kwargs):
        model = debug_model("gpt2", seed=0)
        sim = simulate(model, plan, compile=compile_kwargs is not None, compile_kwargs=compile_kwargs)
        losses = []
        for step, batch in enumerate(training_batches(model.config.vocab_size, 3)):
            loss = sim(**batch).loss
            loss.backward()
            losses.append(loss.item())
            if step == 2:
                grads = {n: p.grad.clone() for n, p in sim.named_parameters() if p.grad is not None}
            sim.zero_grad()
        return sim, losses, grads

    _, eager_losses, eager_grads = run(None)
    sim, losses, grads = run({"backend": "aot_eager"})
    forward, backward = sim.boundaries["boundary0.forward"], sim.boundaries["boundary0.backward"]
    for codec in (forward.sender.codec, forward.receiver.codec, backward.sender.codec, backward.receiver.codec):
        assert getattr(codec, "fused", False), codec
    torch.testing.assert_close(losses, eager_losses, **LOSS_TOL)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], **GRAD_TOL)
