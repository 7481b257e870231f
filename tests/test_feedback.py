"""Sender/receiver state: error feedback accounting, EF21 agreement, AQ-SGD memory identity."""

import json
import re
import warnings

import pytest
import torch

from hf_actcomp import Compression, MemoryConfig, Plan
from hf_actcomp.feedback import (
    AQSGDSender,
    EF21Sender,
    EFSender,
    build_codec,
    build_inference_codec,
    build_receiver,
    build_sender,
)
from hf_actcomp.plan.inference_form import resolve_inference


def pair(compression, memory=None):
    return build_sender(compression, memory, "b"), build_receiver(compression, memory, "b")


def test_error_feedback_accounting_is_exact():
    sender, receiver = pair(Compression("topk", ratio=0.1, feedback="ef", value_dtype="fp32"))
    assert isinstance(sender, EFSender)
    torch.manual_seed(0)
    total_in = torch.zeros(4, 8, 16)
    total_out = torch.zeros(4, 8, 16)
    for _ in range(5):
        x = torch.randn(4, 8, 16)
        payload = sender.encode(x, slot=1)
        out = receiver.decode(payload, x.shape, x.dtype, slot=1)
        total_in += x
        total_out += out
        # Everything accumulated is either delivered or still in the error buffer.
        torch.testing.assert_close(total_out + sender.errors[1], total_in, atol=1e-5, rtol=0)
    assert sender.errors[1].abs().sum() > 0


def topk_by_hand(y, ratio):
    """D(C(y)) of TopK with fp16 values: the round(ratio * n) largest magnitudes, rounded to fp16."""
    flat = y.reshape(-1)
    keep = flat.abs().topk(round(ratio * flat.numel())).indices
    out = torch.zeros_like(flat)
    out[keep] = flat[keep].half().float()
    return out.reshape(y.shape)


def test_error_feedback_state_is_per_slot():
    sender, receiver = pair(Compression("topk", ratio=0.5, feedback="ef"))
    torch.manual_seed(0)
    # Slots 0 and 1 share a shape, so mixing their buffers would not be hidden by a shape reset;
    # slot 2 has its own shape. Visits: 0, 1, 0, 2, 1, 0.
    errors = {}
    for slot in (0, 1, 0, 2, 1, 0):
        x = torch.randn((5, 4) if slot == 2 else (2, 4))
        others = {s: e.clone() for s, e in sender.errors.items() if s != slot}
        corrected = x + errors.get(slot, torch.zeros_like(x))  # e_old = 0 on a slot's first visit
        out = receiver.decode(sender.encode(x, slot=slot), x.shape, x.dtype, slot=slot)
        delivered = topk_by_hand(corrected, 0.5)
        torch.testing.assert_close(out, delivered, atol=0, rtol=0)
        errors[slot] = corrected - delivered  # e_new = (x + e_old) - D(C(x + e_old))
        torch.testing.assert_close(sender.errors[slot], errors[slot], atol=0, rtol=0)
        assert errors[slot].abs().sum() > 0
        assert sender.errors.keys() == errors.keys()
        assert all(torch.equal(sender.errors[s], e) for s, e in others.items())  # other slots untouched


def test_ef21_sender_and_receiver_estimates_agree():
    sender, receiver = pair(Compression("quantize", bits=2, feedback="ef21"))
    assert isinstance(sender, EF21Sender)
    x = torch.randn(3, 5, 32)
    errors = []
    for _ in range(6):  # a constant input: EF21 estimates converge to it
        payload = sender.encode(x)
        out = receiver.decode(payload, x.shape, x.dtype)
        torch.testing.assert_close(out, sender.last_reconstruction, atol=0, rtol=0)
        errors.append(float((out - x).norm() / x.norm()))
    assert errors[-1] < errors[0] / 10


def aqsgd_pair(first_visit="full", inner="quantize", num_samples=8, dtype="fp32"):
    kwargs = {"topk": dict(ratio=0.3), "hadamard_codebook": dict(levels=11),
              "hadamard_vq": dict(levels=64), "hadamard_vq-nosink": dict(levels=64, sink_and_mean=False)
              }.get(inner, dict(bits=4))
    compression = Compression("aqsgd", inner=inner.removesuffix("-nosink"), first_visit=first_visit, **kwargs)
    memory = MemoryConfig(store="host", dtype=dtype, num_samples=num_samples)
    return pair(compression, memory)


@pytest.mark.parametrize("inner", ["quantize", "topk", "hadamard", "hadamard_outliers", "hadamard_codebook", "hadamard_vq",
                                   "hadamard_vq-nosink"])
def test_aqsgd_memories_stay_identical_and_deltas_shrink(inner):
    sender, receiver = aqsgd_pair(inner=inner)
    assert isinstance(sender, AQSGDSender)
    torch.manual_seed(0)
    data = torch.randn(8, 6, 64)
    ids = torch.tensor([3, 0, 6])
    # First visit, policy "full": sent uncompressed, so the reconstruction is exact.
    payload = sender.encode(data[ids], sample_ids=ids)
    assert payload.numel() == 3 * 6 * 64 * 4
    out = receiver.decode(payload, (3, 6, 64), torch.float32, sample_ids=ids)
    assert torch.equal(out, data[ids])
    # Later visits of slowly drifting activations: small payload, error shrinks with each visit.
    errors = []
    for step in range(4):
        x = data[ids] + 0.01 * (step + 1)
        size = receiver.payload_nbytes(x.shape, x.dtype, ids)
        payload = sender.encode(x, sample_ids=ids)
        assert payload.numel() == size < 3 * 6 * 64 * 4 / 2
        out = receiver.decode(payload, x.shape, x.dtype, sample_ids=ids)
        assert torch.equal(sender.mirror.memory.values, receiver.memory.values)
        errors.append(float((out - x).norm() / x.norm()))
    assert errors[-1] < 0.05


def test_aqsgd_deltas_of_activations_with_a_massive_channel():
    """Real LLMs put a massive value (~25,000 in SmolLM2) in one channel of a few tokens. Its
    delta sets the scale of its quantization group, so quantize's levels, none of them zero,
    swamp the small deltas beside it; `hadamard_outliers` sends that channel apart."""
    torch.manual_seed(0)
    base = torch.randn(2, 16, 576)
    base[:, [0, 7], 507] = 25000.0
    mask = torch.ones(576, dtype=torch.bool)
    mask[507] = False
    errors = {}
    for inner in ("quantize", "hadamard_outliers", "hadamard_codebook"):
        sender, receiver = aqsgd_pair(inner=inner, num_samples=2)
        ids = torch.arange(2)
        worst = 0.0
        for step in range(4):  # the first visit exact, then three deltas
            x = base * (1 + 1e-3 * step) + 0.01 * step * torch.randn(2, 16, 576)
            out = receiver.decode(sender.encode(x, sample_ids=ids), x.shape, x.dtype, sample_ids=ids)
            worst = max(worst, float((out - x)[..., mask].norm() / x[..., mask].norm()))
        errors[inner] = worst
    assert errors["quantize"] > 0.1
    assert errors["hadamard_outliers"] < 0.01
    assert errors["hadamard_codebook"] < 0.01


def test_aqsgd_mixed_batch_of_new_and_seen_samples():
    sender, receiver = aqsgd_pair(first_visit="direct")
    x = torch.randn(4, 2, 8)
    first = torch.tensor([0, 1])
    receiver.decode(sender.encode(x[:2], sample_ids=first), (2, 2, 8), torch.float32, sample_ids=first)
    mixed = torch.tensor([1, 5, 0, 7])  # 1 and 0 seen, 5 and 7 new
    expected = receiver.payload_nbytes((4, 2, 8), torch.float32, mixed)
    payload = sender.encode(x, sample_ids=mixed)
    assert payload.numel() == expected
    out = receiver.decode(payload, x.shape, x.dtype, sample_ids=mixed)
    assert torch.equal(out, sender.last_reconstruction)
    assert receiver.memory.is_seen(torch.arange(8)).tolist() == [True, True, False, False, False, True, False, True]


def test_aqsgd_refresh_every_sends_deltas_on_every_kth_revisit_and_reuses_the_memory_between():
    """`refresh_every=2`: a first visit (the warm-up), a revisit that sends nothing and outputs the
    memory as stored, a delta, nothing again. Sizes known before each payload; both memories equal."""
    warm_up = Compression("hadamard", bits=4, group_size=64)
    compression = Compression("aqsgd", bits=2, first_visit=warm_up, refresh_every=2)
    sender, receiver = pair(compression, MemoryConfig(store="host", dtype="fp32", num_samples=4))
    inner = build_codec(Compression("quantize", bits=2))
    torch.manual_seed(0)
    x = torch.randn(2, 6, 64)
    ids = torch.tensor([1, 3])
    sizes, outputs = [], []
    for visit in range(5):
        x_now = x + 0.05 * visit
        size = receiver.payload_nbytes(x_now.shape, x_now.dtype, ids)
        before = receiver.memory.read(ids, "cpu", torch.float32).clone() if visit else None
        payload = sender.encode(x_now, sample_ids=ids)
        assert payload.numel() == size
        out = receiver.decode(payload, x_now.shape, x_now.dtype, sample_ids=ids)
        assert torch.equal(out, sender.last_reconstruction)
        assert torch.equal(sender.mirror.memory.values, receiver.memory.values)
        if visit in (1, 3):  # reused: the memory as stored, unchanged
            assert torch.equal(out, before) and torch.equal(receiver.memory.read(ids, "cpu", torch.float32), before)
        sizes.append(size)
        outputs.append(out)
    shape = (2, 6, 64)
    assert sizes == [build_codec(warm_up).payload_nbytes(shape, torch.float32), 0,
                     inner.payload_nbytes(shape, torch.float32), 0, inner.payload_nbytes(shape, torch.float32)]
    assert receiver.memory.visit_counts(ids).tolist() == [5, 5]
    # The delta corrects the memory toward the activation it was sent for.
    assert float((outputs[2] - (x + 0.1)).norm()) < float((outputs[1] - (x + 0.1)).norm())

    # A batch of a new sample (2), a revisit that reuses (0: its first) and one that refreshes (1:
    # its second): the new one's warm-up and 1's delta cross, in that order; 0 is its memory.
    sender, receiver = pair(compression, MemoryConfig(store="host", dtype="fp32", num_samples=4))
    for visit in (torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([2, 0, 1])):
        x_now = torch.randn(len(visit), 6, 64)
        stored = receiver.memory.read(torch.tensor([0]), "cpu", torch.float32).clone() if len(visit) == 3 else None
        payload = sender.encode(x_now, sample_ids=visit)
        assert payload.numel() == receiver.payload_nbytes(x_now.shape, x_now.dtype, visit)
        out = receiver.decode(payload, x_now.shape, x_now.dtype, sample_ids=visit)
    row = (1, 6, 64)
    assert payload.numel() == build_codec(warm_up).payload_nbytes(row, torch.float32) + inner.payload_nbytes(row, torch.float32)
    assert torch.equal(out[1:2], stored) and torch.equal(out, sender.last_reconstruction)
    assert torch.equal(sender.mirror.memory.values, receiver.memory.values)


def test_aqsgd_visit_counts_survive_a_state_dict_round_trip_and_old_checkpoints_load():
    compression = Compression("aqsgd", bits=4, refresh_every=2)
    memory = MemoryConfig(store="host", dtype="fp32", num_samples=4)
    sender, receiver = pair(compression, memory)
    ids = torch.tensor([0, 2])
    for _ in range(2):
        receiver.decode(sender.encode(torch.randn(2, 3, 8), sample_ids=ids), (2, 3, 8), torch.float32, sample_ids=ids)
    state = receiver.state_dict()
    assert state["memory.visits"].tolist() == [2, 0, 2, 0]
    again = build_receiver(compression, memory, "b")
    again.load_state_dict(state)
    # The third visit is a delta on both (its second revisit); an old checkpoint (no visit
    # counts) reads as one visit per seen sample, so its next revisit reuses the memory.
    assert again.payload_nbytes((2, 3, 8), torch.float32, ids) == receiver.payload_nbytes((2, 3, 8), torch.float32, ids) > 0
    old = build_receiver(compression, memory, "b")
    old.load_state_dict({k: v for k, v in state.items() if k != "memory.visits"})
    assert old.memory.visit_counts(torch.arange(4)).tolist() == [1, 0, 1, 0]
    assert old.payload_nbytes((2, 3, 8), torch.float32, ids) == 0
    bad = build_receiver(compression, memory, "b")
    with pytest.raises(ValueError, match="b.receiver: checkpoint has 3 visit counts for 4 samples"):
        bad.load_state_dict({**state, "memory.visits": torch.zeros(3, dtype=torch.int64)})
    assert not bad.memory.seen.any() and bad.memory.values is None  # nothing touched


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="quantize", bits=4, refresh_every=2),
     "Compression.refresh_every=2 applies to method='aqsgd' only (its per-sample memory is what a revisit reuses), "
     "not to method='quantize'. Allowed value here: 1."),
    (dict(method="aqsgd", bits=4, refresh_every=0),
     "Compression.refresh_every=0 must be a positive integer (1: a delta on every revisit)."),
    (dict(method="aqsgd", bits=4, refresh_every=1.5),
     "Compression.refresh_every=1.5 must be a positive integer (1: a delta on every revisit)."),
])
def test_refresh_every_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Compression(**kwargs)


def test_refresh_every_shows_in_the_label_and_survives_the_plans_json(tmp_path):
    compression = Compression("aqsgd", inner="hadamard_vq", levels=32, refresh_every=2,
                              first_visit=Compression("hadamard_codebook", levels=3, outliers=0))
    assert compression.describe() == "aqsgd-hadamard_vq32 (deltas every 2 revisits) (warm-up hadamard_codebook3)"
    plan = Plan(num_stages=2, forward=compression, memory=MemoryConfig(num_samples=4))
    plan.save_pretrained(tmp_path)
    assert Plan.from_pretrained(tmp_path).forward == compression
    assert Plan.from_yaml_string(plan.to_yaml_string()).forward.refresh_every == 2
    assert Compression("aqsgd", bits=4).refresh_every == 1



def test_aqsgd_drift_deltas_carry_the_senders_change_and_keep_the_first_visits_error():
    """`deltas="drift"`: the first visit crosses coded (4-bit) while the sender records it as it
    was; each revisit sends the change against that record, so a rank-1 change arrives whole
    (lowrank keeps it) and the receiver stays off the activation by the first visit's error, the
    same after every revisit. The mirror stays the receiver's exact copy; the drift record
    survives a state dict round trip, so a resumed sender sends the same bytes."""
    warm_up = Compression("quantize", bits=4)
    compression = Compression("aqsgd", inner="lowrank", rank=1, deltas="drift", first_visit=warm_up)
    memory = MemoryConfig(store="host", dtype="fp32", num_samples=4)
    sender, receiver = pair(compression, memory)
    ids = torch.tensor([1, 3])
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    first = receiver.decode(sender.encode(x, sample_ids=ids), x.shape, x.dtype, sample_ids=ids)
    error = first - x
    assert error.abs().max() > 1e-2  # a 4-bit code: the error is there to keep
    for _ in range(3):
        x = x + 0.1 * torch.randn(1, 1, 16) * torch.linspace(-1, 1, 6).reshape(1, 6, 1)  # a rank-1 change of the batch
        payload = sender.encode(x, sample_ids=ids)
        assert payload.numel() == build_codec(compression).payload_nbytes(x.shape, x.dtype) == 2 * 1 * (12 + 16)
        out = receiver.decode(payload, x.shape, x.dtype, sample_ids=ids)
        torch.testing.assert_close(out - x, error, atol=2e-3, rtol=0)  # bf16 factors: rounding, not drift
        assert torch.equal(out, sender.last_reconstruction)
        assert torch.equal(sender.mirror.memory.values, receiver.memory.values)
    # AQ-SGD's own deltas (the default) correct the first visit's error instead.
    default = Compression("aqsgd", inner="lowrank", rank=1, first_visit=warm_up)
    assert default.deltas == "memory" and "drift" not in default.describe()
    state = sender.state_dict()
    torch.testing.assert_close(state["drift.values"][ids], x, atol=2e-3, rtol=0)  # rank-1 changes arrive whole
    resumed = build_sender(compression, memory, "b")
    resumed.load_state_dict(state)
    step = x + 0.05 * torch.randn(1, 1, 16) * torch.linspace(0, 1, 6).reshape(1, 6, 1)
    assert torch.equal(resumed.encode(step, sample_ids=ids), sender.encode(step, sample_ids=ids))


def test_drift_deltas_start_from_the_receivers_memory_where_the_sender_has_no_record():
    """A plan switched to drift deltas mid-run (the runner adopts AQ-SGD's memory) or a checkpoint
    saved without a record: the first revisit's delta is taken against the receiver's memory, and
    the record starts there; two drift ends hand their record over."""
    from hf_actcomp.boundary import Boundary

    memory = MemoryConfig(store="host", dtype="fp32", num_samples=4)
    ids = torch.tensor([0, 2])
    torch.manual_seed(1)
    x = torch.randn(2, 5, 8)
    old = Boundary("b", Compression("aqsgd", bits=4), memory)
    old.transfer(x, sample_ids=ids)
    stored = old.receiver.memory.read(ids, "cpu", torch.float32)
    drift = Compression("aqsgd", inner="lowrank", rank=8, deltas="drift")
    new = Boundary("b", drift, memory)
    new.adopt_memory(old)
    assert new.sender.drift is not None and not new.sender.drift.seen.any()
    x1 = x + 0.01
    out = new.transfer(x1, sample_ids=ids)
    torch.testing.assert_close(out, x1, atol=2e-2, rtol=0)  # rank 8 of a 5 x 8 matrix per sample: the whole delta
    torch.testing.assert_close(new.sender.drift.read(ids, "cpu", torch.float32), out, atol=1e-6, rtol=0)
    assert not torch.equal(out, stored)
    again = Boundary("b", Compression("aqsgd", inner="lowrank", rank=4, deltas="drift"), memory)
    again.adopt_memory(new)
    assert again.sender.drift is new.sender.drift
    resumed = build_sender(drift, memory, "b")  # a state without the record loads; nothing to start from yet
    resumed.load_state_dict({k: v for k, v in new.sender.state_dict().items() if not k.startswith("drift.")})
    assert not resumed.drift.seen.any() and resumed.mirror.memory.seen[ids].all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="quantize", bits=4, deltas="drift"),
     "Compression.deltas='drift' applies to method='aqsgd' only (the deltas of its per-sample memory), not to "
     "method='quantize'. Allowed value here: 'memory'."),
    (dict(method="aqsgd", bits=4, deltas="exact"), "Compression.deltas='exact' is not valid. Allowed values: memory, drift."),
    (dict(method="aqsgd", inner="lowrank"), "Compression(method='aqsgd') needs rank (allowed: 1..256)."),
    (dict(method="lowrank", rank=0), "Compression.rank=0 is outside the allowed range 1..256."),
])
def test_deltas_and_rank_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Compression(**kwargs)


def test_drift_deltas_show_in_the_label_survive_the_plans_json_and_leave_inference_stateless(tmp_path):
    ternary = Compression("hadamard_codebook", levels=3, outliers=0)
    compression = Compression("aqsgd", inner="lowrank", rank=4, deltas="drift", first_visit=ternary)
    assert compression.describe() == "aqsgd-lowrank4 (drift deltas) (warm-up hadamard_codebook3)"
    plan = Plan(num_stages=2, forward=compression, memory=MemoryConfig(num_samples=4))
    plan.save_pretrained(tmp_path)
    assert Plan.from_pretrained(tmp_path).forward == compression
    assert Plan.from_yaml_string(plan.to_yaml_string()).forward.deltas == "drift"
    # A rank-4 activation is not the activation: inference="auto" sends the stateless default.
    assert resolve_inference(compression) == Compression("hadamard_outliers", bits=6)

WARM_UPS = {
    "hadamard4": Compression("hadamard", bits=4, group_size=64),
    "quantize8": Compression("quantize", bits=8),
    "quantize4-stochastic": Compression("quantize", bits=4, rounding="stochastic", seed=3),
    "randk0.5": Compression("randk", ratio=0.5, value_dtype="fp32", seed=5),  # its decode draws from its stream
}


def warm_up_pair(warm_up, num_samples=8):
    compression = Compression("aqsgd", bits=2, first_visit=warm_up)
    return pair(compression, MemoryConfig(store="host", dtype="fp32", num_samples=num_samples))


@pytest.mark.parametrize("name", ["hadamard4", "quantize8"])
def test_aqsgd_compressed_warm_up_payload_sizes_are_exact(name):
    warm_up = WARM_UPS[name]
    sender, receiver = warm_up_pair(warm_up)
    warm, inner = build_codec(warm_up), build_codec(Compression("quantize", bits=2))
    assert sender.first_codec.name == receiver.first_codec.name == warm_up.method
    torch.manual_seed(0)
    x = torch.randn(4, 6, 64)
    # First visit of every row: the warm-up codec's payload, far below the uncompressed 4 bytes per element.
    first = torch.tensor([0, 2, 4, 6])
    expected = warm.payload_nbytes((4, 6, 64), torch.float32)
    assert expected < x.numel() * 4 / 3
    assert receiver.payload_nbytes(x.shape, x.dtype, first) == expected
    payload = sender.encode(x, sample_ids=first)
    assert payload.numel() == expected
    receiver.decode(payload, x.shape, x.dtype, sample_ids=first)
    # A mixed batch: 2 and 6 seen (2-bit deltas), 1 and 7 new (the warm-up codec), in that order in the payload.
    mixed = torch.tensor([2, 1, 6, 7])
    expected = warm.payload_nbytes((2, 6, 64), torch.float32) + inner.payload_nbytes((2, 6, 64), torch.float32)
    assert receiver.payload_nbytes(x.shape, x.dtype, mixed) == expected
    payload = sender.encode(x + 0.01, sample_ids=mixed)
    assert payload.numel() == expected
    out = receiver.decode(payload, x.shape, x.dtype, sample_ids=mixed)
    assert torch.equal(out, sender.last_reconstruction)


@pytest.mark.parametrize("name", ["hadamard4", "quantize8"])
def test_aqsgd_warm_up_decode_becomes_the_memory_entry(name):
    warm_up = WARM_UPS[name]
    sender, receiver = warm_up_pair(warm_up)
    torch.manual_seed(1)
    x = torch.randn(3, 6, 64)
    ids = torch.tensor([5, 1, 3])
    out = receiver.decode(sender.encode(x, sample_ids=ids), x.shape, x.dtype, sample_ids=ids)
    reference = build_codec(warm_up)  # a fresh codec, the same kernels
    expected = reference.decode(reference.encode(x), x.shape, torch.float32)
    assert torch.equal(out, expected)
    assert not torch.equal(out, x)  # lossy: later deltas correct it
    for memory in (receiver.memory, sender.mirror.memory):
        assert torch.equal(memory.read(ids, torch.device("cpu"), torch.float32), expected)
        assert memory.is_seen(torch.arange(8)).tolist() == [False, True, False, True, False, True, False, False]
    # Revisits of the same activations: the 2-bit deltas correct the warm-up's error.
    errors = [float((out - x).norm() / x.norm())]
    for _ in range(3):
        out = receiver.decode(sender.encode(x, sample_ids=ids), x.shape, x.dtype, sample_ids=ids)
        errors.append(float((out - x).norm() / x.norm()))
    assert errors[-1] < errors[0]


@pytest.mark.parametrize("name", list(WARM_UPS))
def test_aqsgd_warm_up_memories_stay_identical(name):
    sender, receiver = warm_up_pair(WARM_UPS[name], num_samples=10)
    torch.manual_seed(2)
    data = torch.randn(10, 4, 64)
    batches = [[0, 1, 2], [3, 0, 4], [5, 6, 1], [7, 8, 9], [2, 9, 5], [4, 3, 8]]  # new and seen rows mixed
    for step, rows in enumerate(batches):
        ids = torch.tensor(rows)
        x = data[ids] + 0.05 * step
        payload = sender.encode(x, sample_ids=ids)
        assert payload.numel() == receiver.payload_nbytes(x.shape, x.dtype, ids)
        out = receiver.decode(payload, x.shape, x.dtype, sample_ids=ids)
        assert torch.equal(out, sender.last_reconstruction)
        assert torch.equal(sender.mirror.memory.values, receiver.memory.values)
        assert torch.equal(sender.mirror.memory.seen, receiver.memory.seen)
    assert receiver.memory.is_seen(torch.arange(10)).all()


def test_aqsgd_warm_up_counters_survive_a_state_dict_round_trip():
    sender, receiver = warm_up_pair(WARM_UPS["randk0.5"])
    x = torch.randn(2, 3, 64)
    for ids in ([0, 1], [2, 3]):
        ids = torch.tensor(ids)
        receiver.decode(sender.encode(x, sample_ids=ids), x.shape, x.dtype, sample_ids=ids)
    state = sender.state_dict()
    assert state["first_codec.calls"].item() == 2 and state["mirror.first_codec.calls"].item() == 2
    assert receiver.state_dict()["first_codec.calls"].item() == 2
    resumed, resumed_receiver = warm_up_pair(WARM_UPS["randk0.5"])
    resumed.load_state_dict(state)
    resumed_receiver.load_state_dict(receiver.state_dict())
    ids = torch.tensor([4, 1])
    payload = sender.encode(x, sample_ids=ids)
    assert torch.equal(resumed.encode(x, sample_ids=ids), payload)
    out = resumed_receiver.decode(payload, x.shape, x.dtype, sample_ids=ids)
    assert torch.equal(out, receiver.decode(payload, x.shape, x.dtype, sample_ids=ids))
    assert torch.equal(out, sender.last_reconstruction)


def test_aqsgd_rejects_bad_sample_ids_before_touching_memory():
    sender, receiver = aqsgd_pair(num_samples=4)
    with pytest.raises(ValueError, match="sample_id 4 is out of range"):
        sender.encode(torch.randn(2, 3, 4), sample_ids=torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="needs a 'sample_id'"):
        sender.encode(torch.randn(2, 3, 4))
    assert not sender.mirror.memory.seen.any() and sender.mirror.memory.values is None


def test_aqsgd_out_of_step_payload_is_detected():
    sender, receiver = aqsgd_pair()
    ids = torch.tensor([0, 1])
    payload = sender.encode(torch.randn(2, 3, 4), sample_ids=ids)
    receiver.decode(payload, (2, 3, 4), torch.float32, sample_ids=ids)
    with pytest.raises(ValueError, match="out of step"):
        receiver.decode(payload, (2, 3, 4), torch.float32, sample_ids=ids)  # full-size payload, seen samples


def test_state_dict_round_trip_continues_identically():
    compression = Compression("topk", ratio=0.2, feedback="ef")
    a = build_sender(compression)
    x = torch.randn(2, 4, 8)
    a.encode(x)
    b = build_sender(compression)
    b.load_state_dict(a.state_dict())
    y = torch.randn(2, 4, 8)
    assert torch.equal(a.encode(y), b.encode(y))


def test_inference_form_auto_keeps_what_held_on_the_real_model_and_replaces_the_rest():
    auto = "hadamard_outliers6"
    cases = [
        (Compression("aqsgd", bits=2), auto),  # AQ-SGD has no memory for an unseen input
        (Compression("aqsgd", bits=4, first_visit=Compression("hadamard", bits=4)), auto),
        (Compression("hadamard", bits=4), auto),  # +4.6% at 4 stages on SmolLM2
        (Compression("quantize", bits=8), auto),  # +1.22% at 8 stages
        (Compression("topk", ratio=0.3, feedback="ef"), auto),
        (Compression("hadamard", bits=8), "hadamard8"),
        (Compression("hadamard_outliers", bits=6), "hadamard_outliers6"),
        (Compression("bf16"), "bf16"),
        (Compression(), "none"),
    ]
    for compression, expected in cases:
        assert resolve_inference(compression).describe() == expected, compression.describe()
        assert build_inference_codec(compression).name == resolve_inference(compression).method


def test_inference_form_explicit_choices_and_their_warnings():
    assert build_inference_codec(Compression("aqsgd", bits=3, inference="none")).name == "none"
    chosen = Compression("quantize", bits=2, inference={"method": "bf16"})  # a dict from JSON
    assert chosen.inference == Compression("bf16") and build_inference_codec(chosen).name == "bf16"
    plan = Plan(forward=Compression("aqsgd", bits=2, inference=Compression("hadamard_outliers", bits=5, outliers=8)))
    assert Plan.from_dict(json.loads(plan.to_json_string())) == plan  # saved and read with the plan
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # held on the real model: no warning
        assert build_inference_codec(Compression("hadamard", bits=8, inference="direct")).name == "hadamard"
    with pytest.warns(UserWarning, match=r"inference='direct' \(AQ-SGD's inner codec\) = quantize3 was measured "
                                         r"to cost more than 1% .* inference='auto' picks hadamard_outliers6"):
        codec = build_inference_codec(Compression("aqsgd", bits=3, inference="direct"))
    assert (codec.name, codec.bits) == ("quantize", 3)
    with pytest.warns(UserWarning, match=r"Compression.inference = topk0.1 was measured"):
        build_inference_codec(Compression("none", inference=Compression("topk", ratio=0.1)))
    with pytest.warns(UserWarning, match="topk0.1 was measured"):  # feedback dropped at inference
        assert build_inference_codec(Compression("topk", ratio=0.1, feedback="ef", inference="direct")).name == "topk"
    for bad, message in [("exact", "Compression.inference='exact' is not valid. Allowed values: auto, direct, none, "
                                   "or a stateless Compression"),
                         (Compression("aqsgd", bits=2), "inference needs a stateless codec"),
                         (Compression("topk", ratio=0.1, feedback="ef"), "inference needs a stateless codec")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            Compression("quantize", bits=4, inference=bad)


def test_ef21_receiver_output_does_not_alias_its_estimate():
    sender, receiver = pair(Compression("quantize", bits=4, feedback="ef21"))
    x = torch.randn(2, 3, 32)
    out = receiver.decode(sender.encode(x, slot=0), x.shape, x.dtype, slot=0)
    estimate = receiver.estimates[0]
    assert out.data_ptr() != estimate.data_ptr()
    assert sender.last_reconstruction.data_ptr() != sender.mirror.estimates[0].data_ptr()
    before = estimate.clone()
    out.add_(1.0)  # a caller may modify what it was given without touching the shared state
    assert torch.equal(estimate, before)
