"""`topk_quantize`: SparseLoCo's chunked top-k at a few bits, as DiLoCo's pseudo-gradient codec
(exact sizes, which entries it keeps, the error of the kept values, error feedback, settings)."""

import pytest
import torch
from pipeline_cases import padded_batch

from hf_actcomp import Compression, Plan, simulate
from hf_actcomp.codecs import make_codec
from hf_actcomp.debug import debug_model
from hf_actcomp.dp.diloco import PseudoGradientCodec, payload_nbytes


# Bytes = chunks * scale bytes + kept * index bytes + packed(kept, bits), packed(m, b) = ceil(m / 8) * b
# (m for 8 bits), k = round(ratio * chunk length) per chunk (at least 1), indices 1 byte up to 256.
@pytest.mark.parametrize("shape, params, expected", [
    # 7 chunks of 128 keep 3 (2.56), the last of 104 keeps 2 (2.08): 23 kept; fp16 scales
    ((1000,), dict(ratio=0.02, bits=2), 8 * 2 + 23 * 1 + 3 * 2),
    # 1M parameters as DiLoCo's 8192 rows of 128: 24576 kept, 6144 bytes of 2-bit codes
    ((8192, 128), dict(ratio=0.02, bits=2), 16384 + 24576 + 6144),
    # chunks run across rows: 7 of 128 keep 13 (12.8), the last of 104 keeps 10 (10.4): 101 kept
    ((10, 100), dict(ratio=0.1, bits=3), 8 * 2 + 101 * 1 + 13 * 3),
    # SparseLoCo's chunks of 4096: 61 kept (61.44) each, 2-byte indices, fp32 scales
    ((2, 4096), dict(ratio=0.015, bits=2, group_size=4096, value_dtype="fp32"), 2 * 4 + 122 * 2 + 16 * 2),
    # one chunk shorter than group_size: 6 kept of 300 (2-byte indices: 299 > 255), one byte per 8-bit code
    ((300,), dict(ratio=0.02, bits=8, group_size=1000, value_dtype="bf16"), 2 + 6 * 2 + 6),
    ((256,), dict(ratio=0.05, bits=1), 2 * 2 + 12 * 1 + 2 * 1),  # 6 kept (6.4) per chunk, 12 sign bits
    ((5,), dict(ratio=0.02), 2 + 1 + 2),  # at least one kept; 2 bits by default
    ((0, 4), dict(ratio=0.02), 0),
])
def test_payload_sizes_are_exact(shape, params, expected):
    codec = make_codec("topk_quantize", **params)
    assert codec.payload_nbytes(shape, torch.float32) == expected
    payload = codec.encode(torch.randn(shape))
    assert payload.dtype == torch.uint8 and payload.numel() == expected


def test_diloco_payload_of_one_million_parameters():
    """ratio 0.02 at 2 bits: 47104 bytes for 2**20 fp32 parameters (0.36 bits each, 89x), against
    1081344 for int8 and 559104 for Hadamard-4 (docs/data_parallel.md)."""
    n = 1 << 20
    assert payload_nbytes(Compression("topk_quantize", ratio=0.02, bits=2), n) == 47104
    assert payload_nbytes(Compression("quantize", bits=8), n) == n + 4 * 8192
    assert payload_nbytes(Compression("hadamard", bits=4), n) == 8192 // 4 + 4 * 8192 + n // 2
    # chunks of 4096 keep 82 (81.92) with 2-byte indices; fp32 scales cost 2 bytes more per chunk
    assert payload_nbytes(Compression("topk_quantize", ratio=0.02, group_size=4096), n) == 256 * 2 + 20992 * 2 + 5248
    assert payload_nbytes(Compression("topk_quantize", ratio=0.02, value_dtype="fp32"), n) == 63488
    # 300 elements are padded to 3 rows of 128, one chunk each: 3 scales, 9 indices, 9 codes
    codec = PseudoGradientCodec(Compression("topk_quantize", ratio=0.02), 300, torch.device("cpu"))
    assert codec.payload_nbytes == 3 * 2 + 9 + 4


def chunks(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(x.reshape(-1).split(size))


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_keeps_exactly_k_per_chunk_at_the_largest_magnitudes_within_the_bound(bits):
    torch.manual_seed(bits)
    x = torch.randn(10, 100)  # chunks of 128 across rows, and a last one of 104
    codec = make_codec("topk_quantize", ratio=0.1, bits=bits, value_dtype="fp32")
    out = codec.decode(codec.encode(x), x.shape, x.dtype)
    levels = 2**bits - 1
    for chunk, decoded in zip(chunks(x, 128), chunks(out, 128), strict=True):
        k = round(0.1 * chunk.numel())
        expected = torch.topk(chunk.abs(), k).indices
        assert set(decoded.nonzero().flatten().tolist()) == set(expected.tolist())
        kept, sent = chunk[expected], decoded[expected]
        s = kept.abs().max()
        assert torch.equal(sent.sign(), kept.sign())
        assert (sent - kept).abs().max() <= s / levels * (1 + 1e-6)
        if bits == 2:  # the four levels of max-abs 2-bit codes
            distance = (sent.abs().unsqueeze(1) - torch.stack([s / 3, s])).abs().amin(dim=1)
            assert distance.max() <= 1e-6 * s


def test_fp16_scales_and_zeros():
    codec = make_codec("topk_quantize", ratio=0.05, bits=2)
    x = torch.randn(4, 128) * 1e3
    out = codec.decode(codec.encode(x), x.shape, x.dtype)
    for chunk, decoded in zip(chunks(x, 128), chunks(out, 128), strict=True):
        kept = decoded != 0
        assert kept.sum() == 6
        s = chunk.abs().max()  # sent in fp16: relative error below 2**-11
        assert (decoded[kept] - chunk[kept]).abs().max() <= s / 3 * (1 + 1e-3)
    assert codec.decode(codec.encode(torch.zeros(300)), (300,), torch.float32).abs().max() == 0
    huge = torch.full((8,), 1e6)  # beyond fp16: clamped to its largest value, the rest carried by feedback
    torch.testing.assert_close(codec.decode(codec.encode(huge), huge.shape, huge.dtype).max(), torch.tensor(65504.0))


def test_error_feedback_carries_what_was_not_sent():
    """One encode: error out = input + error in - decoded. A constant pseudo-gradient over many
    syncs: the decoded payloads sum to the inputs' sum less the error buffer, whose norm stays
    bounded while the sum grows, so the part not yet sent shrinks relative to what was."""
    n = 1000  # padded to 8 rows of 128
    codec = PseudoGradientCodec(Compression("topk_quantize", ratio=0.02, bits=2), n, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    error_in = torch.randn(n, generator=g)
    codec.error = error_in.clone()
    x = torch.randn(n, generator=g)
    decoded = codec.decode(codec.encode(x))
    assert (decoded != 0).sum() == 8 * 3  # 3 of each row of 128 (the last one's 24 padding zeros never kept)
    torch.testing.assert_close(codec.error, x + error_in - decoded, rtol=0, atol=1e-6)

    codec = PseudoGradientCodec(Compression("topk_quantize", ratio=0.02, bits=2), n, torch.device("cpu"))
    sent, norms = torch.zeros(n), {}
    for sync in range(1, 401):
        sent += codec.decode(codec.encode(x))
        if sync in (200, 400):
            torch.testing.assert_close(sent + codec.error, sync * x, rtol=0, atol=1e-3)
            norms[sync] = codec.error.norm()
            assert (sync * x - sent).norm() <= norms[sync] * (1 + 1e-4)
    assert norms[400] <= 1.1 * norms[200]  # bounded: the inputs' sum doubled, the error did not grow
    assert (400 * x - sent).norm() < 0.05 * (400 * x).norm()


def test_decayed_error_feedback_multiplies_the_residue_first():
    """error_decay (SparseLoCo's buffer): the payload encodes x + decay * error; the residue kept
    is that target minus the decoded payload. A residue that is never sent fades as decay^k;
    with decay 1 (the default) it is kept whole, as before."""
    n = 1000
    compression = Compression("topk_quantize", ratio=0.02, bits=2)
    codec = PseudoGradientCodec(compression, n, torch.device("cpu"), error_decay=0.5)
    plain = PseudoGradientCodec(compression, n, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    error_in, x = torch.randn(n, generator=g), torch.randn(n, generator=g)
    codec.error, plain.error = error_in.clone(), 0.5 * error_in
    decoded = codec.decode(codec.encode(x))
    assert torch.equal(decoded, plain.decode(plain.encode(x)))  # the same target, the same payload
    torch.testing.assert_close(codec.error, x + 0.5 * error_in - decoded, rtol=0, atol=1e-6)
    # One row of residues 0.001 .. 0.128 and nothing new: each sync sends the row's top 3, so
    # after 4 syncs the 100 smallest were never sent and are decay^4 of what they were.
    start = torch.zeros(n)
    start[:128] = 1e-3 * torch.arange(1, 129)
    codec.error = start.clone()
    for _ in range(4):
        codec.encode(torch.zeros(n))
    torch.testing.assert_close(codec.error[:100], 0.5 ** 4 * start[:100], rtol=1e-6, atol=0)
    assert not codec.error[128:].any()


def test_diloco_plan_round_trips_through_json():
    plan = Plan(num_stages=2, data_parallel=2, dp_compression={
        "method": "diloco", "sync_every": 8, "compression": {"method": "topk_quantize", "ratio": 0.02, "bits": 2}})
    again = Plan.from_json_string(plan.to_json_string())
    assert again.diloco == plan.diloco
    assert again.diloco.compression.codec_params() == {"ratio": 0.02, "bits": 2, "group_size": 128,
                                                       "value_dtype": "fp16"}
    assert plan.diloco.label() == "diloco-H8-topk_quantize0.02-2bit"
    assert Compression("topk_quantize", ratio=0.01).describe() == "topk_quantize0.01-2bit"  # the default bits


@pytest.mark.parametrize("params, message", [
    ({"ratio": 0}, r"Compression.ratio=0 is outside the allowed range \(0, 1\]"),
    ({"ratio": 1.5, "bits": 2}, r"Compression.ratio=1.5 is outside the allowed range \(0, 1\]"),
    ({"ratio": 0.02, "bits": 9}, "Compression.bits=9 is outside the allowed range 1..8"),
    ({"ratio": 0.02, "bits": 0}, "Compression.bits=0 is outside the allowed range 1..8"),
    ({"bits": 2}, r"Compression\(method='topk_quantize'\) needs ratio \(allowed: \(0, 1\]\)"),
    ({"ratio": 0.02, "value_dtype": "int8"}, "Compression.value_dtype='int8' is not valid. Allowed values: fp16, bf16, fp32"),
    ({"ratio": 0.02, "feedback": "ef"}, "needs a stateless codec"),
])
def test_bad_settings_fail_before_any_work(params, message):
    with pytest.raises(ValueError, match=r"Plan.dp_compression \(diloco\)") as err:
        Plan(num_stages=2, data_parallel=2,
             dp_compression={"method": "diloco", "compression": {"method": "topk_quantize", **params}})
    assert err.match(message)
    with pytest.raises(ValueError, match="topk_quantize bits=9 is outside the allowed range 1..8"):
        make_codec("topk_quantize", ratio=0.02, bits=9)


def test_a_pipeline_boundary_takes_it_too():
    """A registered codec: the forward boundary of a simulated 2-stage pipeline, with error
    feedback, counting exactly its payload bytes."""
    model = debug_model("gpt2", seed=0)
    plan = Plan(num_stages=2, micro_batches=2, forward=Compression("topk_quantize", ratio=0.25, bits=4, feedback="ef"))
    sim = simulate(model, plan)
    sim(**padded_batch(model.config.vocab_size)).loss.backward()
    channel = sim.stats()["channels"]["boundary0.forward"]
    shape = (2, 12, model.config.hidden_size)  # a micro-batch of 2 rows of 12 tokens
    assert channel["messages"] == 2
    assert channel["bytes_sent"] == 2 * make_codec("topk_quantize", ratio=0.25, bits=4).payload_nbytes(shape, torch.float32)
