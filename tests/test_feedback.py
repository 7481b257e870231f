"""Sender/receiver state: error feedback accounting, EF21 agreement, AQ-SGD memory identity."""

import pytest
import torch

from hf_actcomp import Compression, MemoryConfig
from hf_actcomp.feedback import (
    AQSGDSender,
    EF21Sender,
    EFSender,
    build_inference_codec,
    build_receiver,
    build_sender,
)


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
    kwargs = dict(bits=4) if inner == "quantize" else dict(ratio=0.3)
    compression = Compression("aqsgd", inner=inner, first_visit=first_visit, **kwargs)
    memory = MemoryConfig(store="host", dtype=dtype, num_samples=num_samples)
    return pair(compression, memory)


@pytest.mark.parametrize("inner", ["quantize", "topk"])
def test_aqsgd_memories_stay_identical_and_deltas_shrink(inner):
    sender, receiver = aqsgd_pair(inner=inner)
    assert isinstance(sender, AQSGDSender)
    torch.manual_seed(0)
    data = torch.randn(8, 6, 16)
    ids = torch.tensor([3, 0, 6])
    # First visit, policy "full": sent uncompressed, so the reconstruction is exact.
    payload = sender.encode(data[ids], sample_ids=ids)
    assert payload.numel() == 3 * 6 * 16 * 4
    out = receiver.decode(payload, (3, 6, 16), torch.float32, sample_ids=ids)
    assert torch.equal(out, data[ids])
    # Later visits of slowly drifting activations: small payload, error shrinks with each visit.
    errors = []
    for step in range(4):
        x = data[ids] + 0.01 * (step + 1)
        size = receiver.payload_nbytes(x.shape, x.dtype, ids)
        payload = sender.encode(x, sample_ids=ids)
        assert payload.numel() == size < 3 * 6 * 16 * 4 / 2
        out = receiver.decode(payload, x.shape, x.dtype, sample_ids=ids)
        assert torch.equal(sender.mirror.memory.values, receiver.memory.values)
        errors.append(float((out - x).norm() / x.norm()))
    assert errors[-1] < 0.05


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


def test_inference_codec_fallbacks():
    assert build_inference_codec(Compression("aqsgd", bits=3)).name == "quantize"
    assert build_inference_codec(Compression("aqsgd", bits=3, inference="none")).name == "none"
    assert build_inference_codec(Compression("topk", ratio=0.1, feedback="ef")).name == "topk"


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
