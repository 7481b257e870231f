"""The compressed tied embedding (`Plan.tie_compression`): both ends of `TiedEmbedding` in one
process, joined by a loopback transport, and its emulation in `simulate()`."""

import json

import pytest
import torch
from torch import nn

import hf_actcomp
from hf_actcomp import Compression, Plan
from hf_actcomp.debug import debug_model
from hf_actcomp.pipeline.mesh import PipelineMesh
from hf_actcomp.pipeline.tie import TiedEmbedding
from hf_actcomp.telemetry import TrafficCounter

VOCAB, HIDDEN = 97, 64

CODECS = {
    "quantize8": Compression("quantize", bits=8),
    "quantize3-stochastic": Compression("quantize", bits=3, rounding="stochastic", seed=5),
    "randk": Compression("randk", ratio=0.25, seed=3),
    "topk": Compression("topk", ratio=0.1),
    "bf16": Compression("bf16"),
    "hadamard4": Compression("hadamard", bits=4, group_size=64),
}


class Loopback:
    """A `Transport` stand-in: what one rank sends to another waits in a queue for its `recv`."""

    def __init__(self, rank: int, queues: dict) -> None:
        self.rank, self.queues = rank, queues

    def send(self, payload: torch.Tensor, dst: int, **_) -> None:
        assert payload.dtype == torch.uint8 and payload.dim() == 1
        self.queues.setdefault(dst, []).append(payload.clone())

    def recv(self, nbytes: int, src: int, device: torch.device, what: str, **_) -> torch.Tensor:
        payload = self.queues[self.rank].pop(0)
        assert payload.numel() == nbytes, f"{what}: {payload.numel()} bytes sent, {nbytes} expected"
        return payload.to(device)


def tie_ends(compression: Compression | None, weight: torch.Tensor | None = None, requires_grad: bool = True):
    """(first stage's end, owner's end) of a 2-stage tie, both starting from the same weight."""
    weight = weight if weight is not None else torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    queues: dict = {}
    ends = []
    for rank in (0, 1):
        param = nn.Parameter(weight.clone(), requires_grad=requires_grad)
        ends.append(TiedEmbedding(param, PipelineMesh((0, 1), rank), Loopback(rank, queues), TrafficCounter(),
                                  compression))
    return ends


def batch_ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(100 + step))


def step(first: TiedEmbedding, owner: TiedEmbedding, ids: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One exchange: rows there, the first stage's gradient `grad` back; returns what the owner
    received (its gradient, which starts at zero)."""
    owner.share_rows(ids)
    first.share_rows(ids)
    first.param.grad = grad.clone()
    owner.param.grad = None
    first.gather_gradient(ids)
    owner.gather_gradient(ids)
    assert first.param.grad is None
    return owner.param.grad


@pytest.mark.parametrize("name", sorted(CODECS))
def test_rows_stay_equal_bytes_are_exact_and_error_feedback_loses_nothing(name):
    compression = CODECS[name]
    first, owner = tie_ends(compression)
    codec = hf_actcomp.feedback.build_codec(compression)
    g = torch.Generator().manual_seed(1)
    true_sum = torch.zeros(VOCAB, HIDDEN)
    sent_sum = torch.zeros(VOCAB, HIDDEN)
    for i in range(25):
        ids = batch_ids(i)
        rows = torch.unique(ids)
        before = (first.counter.bytes_sent, owner.counter.bytes_sent)
        grad = torch.zeros(VOCAB, HIDDEN)
        grad[rows] = torch.randn(rows.numel(), HIDDEN, generator=g)
        received = step(first, owner, ids, grad)
        # What the first stage reads is the owner's mirror, bit for bit, and the whole tables agree.
        assert torch.equal(first.param.detach()[rows], owner.compressor.table[rows])
        assert torch.equal(first.compressor.table, owner.compressor.table)
        # Exact payload sizes, known in advance; the uncompressed size is the fp32 rows.
        nbytes = codec.payload_nbytes((rows.numel(), HIDDEN), torch.float32)
        assert owner.counter.bytes_sent - before[1] == nbytes  # rows
        assert first.counter.bytes_sent - before[0] == nbytes  # gradient rows
        true_sum += grad
        sent_sum += received
        with torch.no_grad():  # the owner's weight moves, as an optimizer step would
            owner.param.add_(torch.randn(VOCAB, HIDDEN, generator=g), alpha=0.01)
    raw = sum(torch.unique(batch_ids(i)).numel() for i in range(25)) * HIDDEN * 4
    assert owner.counter.bytes_uncompressed == first.counter.bytes_uncompressed == raw
    # Error feedback: the owner received everything but what is still in the error table.
    torch.testing.assert_close(sent_sum + first.compressor.error, true_sum, atol=1e-4, rtol=1e-5)
    # Deltas do not accumulate errors: with the weight held still, resending the same rows
    # converges to it (lossy-to-the-end codecs: sparsifiers keep a fraction per step).
    ids = batch_ids(0)
    rows = torch.unique(ids)
    for _ in range(40):
        owner.share_rows(ids)
        first.share_rows(ids)
    err = (first.param.detach()[rows] - owner.param.detach()[rows]).norm() / owner.param.detach()[rows].norm()
    assert err < 1e-2, f"{name}: relative error of the first stage's rows {err:.2e}"


def test_exact_tie_is_unchanged_without_tie_compression():
    first, owner = tie_ends(None)
    assert first.compressor is None and first.state_dict() == {} and owner.state_dict() == {}
    ids = batch_ids(0)
    rows = torch.unique(ids)
    with torch.no_grad():
        owner.param.mul_(2)
    grad = torch.randn(VOCAB, HIDDEN)
    received = step(first, owner, ids, grad)
    assert torch.equal(first.param.detach()[rows], owner.param.detach()[rows])
    assert torch.equal(received[rows], grad[rows]) and not received[~torch.isin(torch.arange(VOCAB), rows)].any()
    for end in (first, owner):
        assert end.counter.bytes_sent == end.counter.bytes_uncompressed == rows.numel() * HIDDEN * 4


def test_frozen_tie_sends_nothing_and_keeps_no_tables():
    first, owner = tie_ends(Compression("quantize", bits=8), requires_grad=False)
    ids = batch_ids(0)
    owner.share_rows(ids)
    first.share_rows(ids)
    first.gather_gradient(ids)
    owner.gather_gradient(ids)
    assert first.counter.bytes_sent == owner.counter.bytes_sent == 0
    assert first.compressor.table is None and owner.compressor.table is None


def test_state_dict_round_trip_resumes_exactly():
    """Resume: fresh ends whose weights were loaded from the owner's (a checkpoint stores the
    tied weight once) and whose tie state is loaded continue exactly as the uninterrupted ends."""
    compression = CODECS["quantize3-stochastic"]
    first, owner = tie_ends(compression)
    g = torch.Generator().manual_seed(2)
    for i in range(4):
        step(first, owner, batch_ids(i), torch.randn(VOCAB, HIDDEN, generator=g))
        with torch.no_grad():
            owner.param.add_(torch.randn(VOCAB, HIDDEN, generator=g), alpha=0.01)
    states = [first.state_dict(), owner.state_dict()]
    assert {"copy", "error", "gradient.codec.calls", "rows.codec.calls"} <= set(states[0])
    assert "mirror" in states[1] and "copy" not in states[1] and "error" not in states[1]
    # Through the JSON-free safetensors path, as checkpoints store it.
    from safetensors.torch import load, save

    states = [load(save({k: v.contiguous() for k, v in s.items()})) for s in states]
    new_first, new_owner = tie_ends(compression, weight=owner.param.detach())
    new_first.load_state_dict(states[0])
    new_owner.load_state_dict(states[1])
    for i in range(4, 8):
        grad = torch.randn(VOCAB, HIDDEN, generator=g)
        received = step(first, owner, batch_ids(i), grad)
        resumed = step(new_first, new_owner, batch_ids(i), grad)
        assert torch.equal(received, resumed)
        assert torch.equal(new_first.param.detach()[torch.unique(batch_ids(i))],
                           first.param.detach()[torch.unique(batch_ids(i))])
        delta = torch.randn(VOCAB, HIDDEN, generator=g)
        with torch.no_grad():
            owner.param.add_(delta, alpha=0.01)
            new_owner.param.add_(delta, alpha=0.01)
    for key, value in first.state_dict().items():
        assert torch.equal(value, new_first.state_dict()[key]), key


def test_plan_validation_and_serialisation():
    with pytest.raises(ValueError, match=r"tie_compression.method='aqsgd' is not valid.*Allowed values: bf16, fp16, "
                                         r"hadamard, hadamard_codebook, hadamard_outliers, hadamard_vq, lowrank, none, quantize, randk, topk, topk_quantize"):
        Plan(tie_compression=Compression("aqsgd", bits=4))
    with pytest.raises(ValueError, match=r"tie_compression.feedback='ef21'.*Allowed values: none, ef"):
        Plan(tie_compression=Compression("quantize", bits=8, feedback="ef21"))
    with pytest.raises(ValueError, match="tie_compression='quantize' must be None"):
        Plan(tie_compression="quantize")
    assert Plan().tie_compression is None
    plan = Plan(tie_compression={"method": "quantize", "bits": 8})
    assert plan.tie_compression == Compression("quantize", bits=8)
    assert Plan.from_json_string(plan.to_json_string()) == plan
    assert Plan.from_yaml_string(plan.to_yaml_string()) == plan
    assert Plan.from_dict(json.loads(Plan().to_json_string())).tie_compression is None


def test_checkpoint_fingerprint_names_the_tie(tmp_path):
    from hf_actcomp.state import compression as checkpoint

    saved = Plan(tie_compression=Compression("quantize", bits=8))
    checkpoint.save_state(tmp_path, 0, {"x": torch.zeros(1)}, {"plan": saved.to_dict()})
    with pytest.raises(ValueError, match="plan.tie_compression"):
        checkpoint.load_state(tmp_path, 0, {"plan": Plan().to_dict()})


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_simulation_with_the_identity_codec_keeps_the_gradients(family):
    """The emulated tie (the first stage reading its own copy, its gradient rows added to the
    weight through the codec) gives the unsplit model's gradients with `none` (OPT: padding_idx)."""
    batch = {"input_ids": torch.randint(0, 200, (4, 10), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"].clone()
    grads = []
    for tie in (None, Compression("none")):
        model = debug_model(family, seed=0)
        sim = hf_actcomp.simulate(model, Plan(num_stages=2, micro_batches=2, tie_compression=tie))
        sim(**batch).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=lambda m, n=name: f"{n}: {m}")


def test_simulation_trains_counts_tie_bytes_and_saves_its_state():
    compression = Compression("quantize", bits=4)
    model = debug_model("gpt2", seed=0)
    plan = Plan(num_stages=2, micro_batches=2, tie_compression=compression)
    sim = hf_actcomp.simulate(model, plan)
    optimizer = torch.optim.SGD(sim.parameters(), lr=0.2)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    data = torch.randint(0, vocab, (8, 12), generator=torch.Generator().manual_seed(0))
    losses, payload = [], 0
    codec = hf_actcomp.feedback.build_codec(compression)
    for i in range(8):
        ids = data[(torch.arange(4) + 4 * i) % 8]
        loss = sim(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        payload += 2 * codec.payload_nbytes((torch.unique(ids).numel(), hidden), torch.float32)
    assert losses[-1] < losses[0]
    tie = sim.stats()["categories"]["tie"]
    assert tie["bytes_sent"] == payload and tie["compression_ratio"] > 4
    state = sim.compression_state_dict()
    assert {"tie.copy", "tie.error"} <= set(state)
    sim.eval()  # evaluation refreshes the copy too (as the pipeline's eval_step), uncounted
    with torch.no_grad():
        sim(input_ids=data[:4], labels=data[:4])
    assert sim.stats()["categories"]["tie"]["bytes_sent"] == payload
    other = hf_actcomp.simulate(debug_model("gpt2", seed=0), plan)
    other.load_compression_state_dict(state)
    assert torch.equal(other.tie.table, state["tie.copy"]) and torch.equal(other.tie.error, state["tie.error"])


def test_estimate_inspect_and_card_show_the_tie_codec(tmp_path, capsys):
    from hf_actcomp import hub
    from hf_actcomp.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4,
                                                      "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 0}))
    plan = Plan(num_stages=2, micro_batches=2, tie_compression=Compression("quantize", bits=8))
    plan.save_pretrained(tmp_path)
    args = ["estimate", "--model", str(tmp_path / "config.json"), "--plan", str(tmp_path), "--batch-size", "4",
            "--seq-len", "512"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = 1000  # 4 x 512 tokens, at most the vocabulary's 1000 distinct ones
    codec = hf_actcomp.feedback.build_codec(plan.tie_compression)
    assert result["tied_embedding_bytes_at_most"] == 2 * codec.payload_nbytes((rows, 64), torch.float32)
    assert result["tied_embedding_bytes_at_most_uncompressed"] == 2 * rows * 64 * 4
    assert main(args) == 0
    kib = result["tied_embedding_bytes_at_most"] / 1024
    assert f"tied embedding rows: at most {kib:.1f} KiB per step (quantize8: rows as deltas" in capsys.readouterr().out
    card = hub.model_card(tmp_path)
    assert "| tied embedding rows | `quantize8` (rows as deltas, gradient rows with error feedback) |" in card.text
    stats = {"bytes_sent": 100, "bytes_uncompressed": 400, "compression_ratio": 4.0, "channels": {},
             "categories": {"tie": {"bytes_sent": 50, "bytes_uncompressed": 200, "compression_ratio": 4.0}}}
    hub.save_results(tmp_path, stats=stats)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tie_compression:" in out and "tied embedding rows (quantize8): 50 bytes (4.00x)" in out
