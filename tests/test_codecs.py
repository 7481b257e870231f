"""Codecs: exact payload sizes, error bounds, unbiasedness, exact top-k, shared-seed random-k."""

import math
import re

import pytest
import torch

from hf_actcomp.codecs import available_codecs, make_codec
from hf_actcomp.codecs.packing import (
    digits_per_word,
    pack_bits,
    pack_digits,
    packed_digits_nbytes,
    packed_nbytes,
    unpack_bits,
    unpack_digits,
)
from hf_actcomp.codecs.sparsify import index_width

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = [(3, 5, 7), (2, 16, 32), (1000,), (0, 4)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CODEC_PARAMS = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("quantize", dict(bits=1)),
    ("quantize", dict(bits=3, granularity="channel")),
    ("quantize", dict(bits=4, rounding="stochastic", group_size=32)),
    ("quantize", dict(bits=8)),
    ("topk", dict(ratio=0.1)),
    ("topk", dict(ratio=0.5, value_dtype="fp32")),
    ("randk", dict(ratio=0.3, value_dtype="bf16")),
    ("hadamard", dict(bits=1)),
    ("hadamard", dict(bits=3)),
    ("hadamard", dict(bits=4, rounding="stochastic", group_size=32)),
    ("hadamard", dict(bits=8, group_size=7)),
    ("hadamard_outliers", dict(bits=4)),
    ("hadamard_outliers", dict(bits=3, outliers=0, group_size=8, rounding="stochastic")),
    ("hadamard_outliers", dict(bits=8, outliers=2)),
    ("hadamard_codebook", dict(levels=11)),
    ("hadamard_codebook", dict(levels=3, outliers=0)),
    ("hadamard_codebook", dict(levels=15, outliers=2, tile=7)),
    ("hadamard_vq", dict(levels=16)),
    ("hadamard_vq", dict(levels=128, outliers=2)),
    ("lowrank", dict(rank=1)),
    ("lowrank", dict(rank=8)),
    ("topk_quantize", dict(ratio=0.1)),
    ("topk_quantize", dict(ratio=0.3, bits=5, group_size=7, value_dtype="bf16")),
]


def test_registry_lists_all_codecs():
    assert available_codecs() == ["bf16", "fp16", "hadamard", "hadamard_codebook", "hadamard_outliers", "hadamard_vq", "lowrank", "none",
                                  "quantize", "randk", "topk", "topk_quantize"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, params", CODEC_PARAMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_payload_size_is_exact(device, name, params, shape, dtype):
    encoder, decoder = make_codec(name, **params), make_codec(name, **params)
    x = torch.randn(shape, device=device).to(dtype)
    original = x.clone()
    payload = encoder.encode(x)
    assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.is_contiguous()
    assert payload.numel() == encoder.payload_nbytes(shape, dtype)
    assert payload.device == x.device
    out = decoder.decode(payload, shape, dtype)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert torch.equal(x, original)


def test_explicit_sizes():
    shape = (8, 1024, 768)
    n = 8 * 1024 * 768
    q4 = make_codec("quantize", bits=4)
    assert q4.payload_nbytes(shape, torch.float32) == 4 * n // 128 + n * 4 // 8
    assert q4.payload_nbytes(shape, torch.float32) * 8 / n <= 4.3
    assert make_codec("quantize", bits=3, granularity="channel").payload_nbytes(shape, torch.float32) == 4 * 768 + n * 3 // 8
    assert make_codec("quantize", bits=5).payload_nbytes((10,), torch.float32) == 4 + 2 * 5  # 1 scale, 2 rows of 8 codes
    assert index_width(200) == 1 and index_width(256) == 1 and index_width(257) == 2
    assert index_width(70000) == 3 and index_width(2**32 + 1) == 5
    assert make_codec("topk", ratio=0.1).payload_nbytes((200,), torch.float32) == 20 * (2 + 1)
    assert make_codec("topk", ratio=0.1).payload_nbytes((70000,), torch.float32) == 7000 * (2 + 3)
    assert make_codec("randk", ratio=0.1).payload_nbytes((70000,), torch.float32) == 7000 * 2
    assert make_codec("none").payload_nbytes((3, 4), torch.bfloat16) == 24


def test_none_is_bitwise_exact_and_halves_round():
    x = torch.randn(4, 33) * 100
    codec = make_codec("none")
    assert torch.equal(codec.decode(codec.encode(x), x.shape, x.dtype), x)
    for name, tol in (("fp16", 1e-3), ("bf16", 8e-3)):
        c = make_codec(name)
        out = c.decode(c.encode(x), x.shape, x.dtype)
        assert ((out - x).abs() <= tol * x.abs() + 1e-6).all()
    fp16 = make_codec("fp16")
    big = torch.tensor([1e6, -1e6, 1.0])
    assert fp16.decode(fp16.encode(big), (3,), torch.float32).tolist() == [65504.0, -65504.0, 1.0]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [1, 7, 8, 13, 1000])
def test_pack_unpack_round_trip(bits, count):
    codes = torch.randint(0, 2**bits, (count,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == packed_nbytes(count, bits) == (count if bits == 8 else math.ceil(count / 8) * bits)
    assert torch.equal(unpack_bits(packed, bits, count), codes)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("granularity", ["group", "channel"])
def test_quantize_error_bound(bits, granularity):
    torch.manual_seed(bits)
    x = torch.randn(6, 10, 48) * torch.linspace(0.1, 10, 48)
    codec = make_codec("quantize", bits=bits, granularity=granularity, group_size=64)
    out = codec.decode(codec.encode(x), x.shape, x.dtype)
    levels = 2**bits - 1
    if granularity == "channel":
        scale = x.abs().amax(dim=(0, 1), keepdim=True)
    else:
        flat = x.reshape(-1, 64)
        scale = flat.abs().amax(dim=1, keepdim=True).expand_as(flat).reshape(x.shape)
    assert ((out - x).abs() <= scale / levels * (1 + 1e-5) + 1e-6).all()


def test_quantize_zero_group_and_levels():
    codec = make_codec("quantize", bits=2, group_size=4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, -3.0, -1.0, 1.0, 3.0])
    out = codec.decode(codec.encode(x), x.shape, x.dtype)
    expected = torch.tensor([0.0, 0.0, 0.0, 0.0, -3.0, -1.0, 1.0, 3.0])  # levels -s, -s/3, s/3, s
    assert torch.equal(out[:4], expected[:4])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_stochastic_rounding_is_unbiased_and_resumable():
    torch.manual_seed(0)
    x = torch.randn(256)
    codec = make_codec("quantize", bits=2, rounding="stochastic", seed=3)
    mean = torch.stack([codec.decode(codec.encode(x), x.shape, x.dtype) for _ in range(2000)]).mean(0)
    deterministic = make_codec("quantize", bits=2)
    biased = deterministic.decode(deterministic.encode(x), x.shape, x.dtype)
    assert (mean - x).abs().max() < 0.08 < (biased - x).abs().max()
    a = make_codec("quantize", bits=3, rounding="stochastic", seed=5)
    a.encode(x)
    b = make_codec("quantize", bits=3, rounding="stochastic", seed=5)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.encode(x), b.encode(x))
    assert not torch.equal(a.encode(x), make_codec("quantize", bits=3, rounding="stochastic", seed=6).encode(x))


@pytest.mark.parametrize("n, ratio", [(200_000, 0.01), (200_000, 0.1), (200_000, 0.3), (500, 0.1)])
def test_topk_selects_exactly_the_top_k(n, ratio):
    torch.manual_seed(n)
    x = torch.randn(n)
    codec = make_codec("topk", ratio=ratio, value_dtype="fp32")
    out = codec.decode(codec.encode(x), x.shape, x.dtype)
    k = round(ratio * n)
    expected = torch.topk(x.abs(), k).indices
    assert set(out.nonzero().flatten().tolist()) == set(expected.tolist())
    assert torch.equal(out[expected], x[expected])


def test_topk_fallback_when_the_sample_misleads():
    # Heavy mass in a few spikes: the sampled threshold keeps too few candidates at first.
    x = torch.zeros(100_000)
    x[::1000] = torch.arange(1, 101, dtype=torch.float32)
    x += 1e-3 * torch.randn(100_000)
    codec = make_codec("topk", ratio=0.3, value_dtype="fp32")
    out = codec.decode(codec.encode(x), x.shape, x.dtype)
    expected = torch.topk(x.abs(), 30_000).indices
    assert set(out.nonzero().flatten().tolist()) == set(expected.tolist())


def test_randk_sides_agree_through_shared_seed():
    sender, receiver = make_codec("randk", ratio=0.25, value_dtype="fp32", seed=7), make_codec("randk", ratio=0.25, value_dtype="fp32", seed=7)
    supports = []
    for _ in range(3):
        x = torch.randn(64, 8)
        out = receiver.decode(sender.encode(x), x.shape, x.dtype)
        kept = out != 0
        assert kept.sum() == 128
        assert torch.equal(out[kept], x[kept])
        supports.append(kept)
    assert not torch.equal(supports[0], supports[1])  # a fresh index set per call
    other = make_codec("randk", ratio=0.25, value_dtype="fp32", seed=8)
    x = torch.randn(64, 8)
    assert not torch.equal(other.decode(make_codec("randk", ratio=0.25, value_dtype="fp32", seed=7).encode(x), x.shape, x.dtype), receiver.decode(sender.encode(x), x.shape, x.dtype))


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("zip", {}, "Unknown codec 'zip'. Available codecs: bf16, fp16, hadamard, hadamard_codebook, hadamard_outliers, hadamard_vq, lowrank, none, quantize, randk, topk, topk_quantize"),
        ("hadamard", dict(bits=0), "hadamard bits=0 is outside the allowed range 1..8"),
        ("hadamard", dict(bits=4, boost_fraction=0.5), r"boost_fraction=0.5 is outside the allowed range \[0, 0.5\)"),
        ("hadamard", dict(bits=4, rounding="up"), "rounding='up' is not valid"),
        ("quantize", dict(bits=9), "bits=9 is outside the allowed range 1..8"),
        ("quantize", dict(bits=4, rounding="up"), "rounding='up' is not valid. Allowed values: deterministic, stochastic"),
        ("quantize", dict(bits=4, granularity="row"), "Allowed values: group, channel"),
        ("topk", dict(ratio=0), r"ratio=0 is outside the allowed range \(0, 1\]"),
        ("topk_quantize", dict(ratio=0.02, bits=9), "topk_quantize bits=9 is outside the allowed range 1..8"),
        ("randk", dict(ratio=0.1, value_dtype="int8"), "Allowed values: fp16, bf16, fp32"),
        ("none", dict(bits=4), r"Codec 'none' does not take \['bits'\]"),
    ],
)
def test_bad_codec_arguments(name, params, message):
    with pytest.raises(ValueError, match=message):
        make_codec(name, **params)


@pytest.mark.parametrize("hidden, block", [(64, 64), (96, 32), (768, 256), (7, 1)])
def test_hadamard_rotation_is_orthogonal_and_inverts_exactly(hidden, block):
    from hf_actcomp.codecs.hadamard import hadamard_block

    assert hadamard_block(hidden) == block
    codec = make_codec("hadamard", bits=4, seed=3)
    rotation = codec.rotate(torch.eye(hidden, dtype=torch.float64))
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(hidden, dtype=torch.float64), atol=1e-12, rtol=0)
    x = torch.randn(5, 3, hidden, dtype=torch.float64)
    torch.testing.assert_close(codec.unrotate(codec.rotate(x)), x, atol=1e-12, rtol=0)
    if block > 1:  # random signs: another seed, another rotation
        assert not torch.equal(rotation, make_codec("hadamard", bits=4, seed=4).rotate(torch.eye(hidden, dtype=torch.float64)))


@pytest.mark.parametrize("block", [1, 2, 8, 128, 256])
def test_hadamard_transform_is_the_normalised_sylvester_matrix(block):
    from hf_actcomp.codecs.hadamard import hadamard_transform

    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:  # Sylvester: H_2n = H_2 (x) H_n
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    x = torch.randn(3, 2 * block, dtype=torch.float64)  # two blocks per row, transformed separately
    expected = torch.cat([x[:, :block] @ h, x[:, block:] @ h], dim=1) / block**0.5
    torch.testing.assert_close(hadamard_transform(x, block), expected, atol=1e-12, rtol=0)


def _outlier_activations(tokens: int = 256, hidden: int = 1024) -> torch.Tensor:
    """Gaussian activations whose 8 of 1024 channels are scaled x40, as real LLMs have."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    x[:, torch.randperm(hidden, generator=g)[:8]] *= 40
    return x


def _relative_error(codec, x) -> float:
    out = codec.decode(codec.encode(x), x.shape, x.dtype)
    return float((out - x).norm() / x.norm())


def test_hadamard_beats_plain_quantize_on_outlier_channels_at_the_same_bytes():
    x = _outlier_activations()
    plain = make_codec("quantize", bits=4, group_size=64)
    rotated = make_codec("hadamard", bits=4, group_size=64)
    ratio = rotated.payload_nbytes(x.shape, x.dtype) / plain.payload_nbytes(x.shape, x.dtype)
    assert 1.0 <= ratio < 1.01  # 2 bits of width per 64-element tile
    plain_error, rotated_error = _relative_error(plain, x), _relative_error(rotated, x)
    assert rotated_error < 0.25 * plain_error, (rotated_error, plain_error)
    assert _relative_error(make_codec("quantize", bits=4), x) > 0.4  # the default group of 128


def test_hadamard_sizes_and_widths():
    shape = (8, 1024, 768)
    n = 8 * 1024 * 768
    tiles = n // 64
    codec = make_codec("hadamard", bits=3, group_size=64, boost_fraction=0.25)
    # 1/4 of the tiles at 2 bits, 1/4 at 4: 3 bits per element on average, + width map + scales.
    assert codec.payload_nbytes(shape, torch.float32) == tiles * 2 // 8 + 4 * tiles + n * 3 // 8
    x = torch.randn(4, 64, 96)
    payload = codec.encode(x)
    widths = unpack_bits(payload[: packed_nbytes(4 * 64 * 96 // 64, 2)], 2, 4 * 64 * 96 // 64)
    assert torch.bincount(widths.long(), minlength=3).tolist() == [96, 192, 96]
    # The widest tiles got the extra bit: their scales are the largest.
    scales = payload[packed_nbytes(384, 2):packed_nbytes(384, 2) + 4 * 384].clone().view(torch.float32)
    assert scales[widths == 2].min() >= scales[widths == 0].max()
    # No adaptation at 1 or 8 bits (no narrower or wider width).
    assert make_codec("hadamard", bits=1, group_size=64, boost_fraction=0.25).payload_nbytes(
        (64, 64), torch.float32) == 16 + 4 * 64 + 512
    fixed = make_codec("hadamard", bits=3, group_size=64)  # the default: every tile at 3 bits
    assert torch.bincount(unpack_bits(fixed.encode(x)[:96], 2, 384).long(), minlength=3).tolist() == [0, 384, 0]


def test_hadamard_stochastic_rounding_is_unbiased_and_resumable():
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    codec = make_codec("hadamard", bits=2, rounding="stochastic", group_size=32, seed=3)
    mean = torch.stack([codec.decode(codec.encode(x), x.shape, x.dtype) for _ in range(2000)]).mean(0)
    deterministic = make_codec("hadamard", bits=2, group_size=32)
    biased = deterministic.decode(deterministic.encode(x), x.shape, x.dtype)
    assert (mean - x).abs().max() < 0.1 < (biased - x).abs().max()
    b = make_codec("hadamard", bits=2, rounding="stochastic", group_size=32, seed=3)
    b.load_state_dict(codec.state_dict())
    assert torch.equal(codec.encode(x), b.encode(x))


def _sink_and_outlier_channels(rows=2, tokens=16, hidden=64):
    """A pretrained LLM's residual stream in miniature: an attention-sink token per sequence
    hundreds of times the others' norm, two channels tens of times the rest, a shared offset."""
    torch.manual_seed(0)
    x = torch.randn(rows, tokens, hidden) + 0.5
    x[:, :, 5] += 40.0
    x[:, :, 17] -= 25.0
    x[:, 3] *= 300.0
    return x


def test_hadamard_outliers_payload_layout_is_exact():
    codec = make_codec("hadamard_outliers", bits=4)
    rows, tokens, hidden, k = 2, 16, 64, 4
    # sink index (int32) and token (bf16) per sequence, the channel mean (fp16), k outliers per
    # token (int16 index, bf16 value), one bf16 scale per 64-element tile, 4-bit codes.
    expected = 4 * rows + 2 * rows * hidden + 2 * hidden + 4 * rows * tokens * k + 2 * rows * tokens + \
        rows * tokens * hidden // 2
    assert codec.payload_nbytes((rows, tokens, hidden), torch.float32) == expected == 1992
    assert codec.encode(_sink_and_outlier_channels()).numel() == expected
    # SmolLM2's hidden 576: tiles of 96 (the largest divisor not above group_size 128), never across tokens.
    from hf_actcomp.codecs.hadamard_outliers import tile_size
    assert [tile_size(576, 128), tile_size(576, 64), tile_size(7, 128), tile_size(128, 128)] == [96, 64, 7, 128]


def test_hadamard_outliers_sends_sink_and_outlier_channels_apart():
    x = _sink_and_outlier_channels()
    codec = make_codec("hadamard_outliers", bits=4)
    out = codec.decode(codec.encode(x), x.shape, x.dtype)
    assert torch.equal(out[:, 3], x[:, 3].bfloat16().float())  # the sink, whole in bf16
    rest = torch.cat([out[:, :3], out[:, 4:]], 1) - torch.cat([x[:, :3], x[:, 4:]], 1)
    for channel in (5, 17):  # sent apart: only bf16 and fp16-mean rounding left
        assert rest[..., channel].abs().max() < 0.5
    plain = make_codec("hadamard", bits=4)
    assert _relative_error(codec, x) < 0.1 * _relative_error(plain, x)
    others = torch.cat([x[:, :3], x[:, 4:]], 1)
    assert float(rest.norm() / others.norm()) < 0.02


def test_hadamard_outliers_sends_one_token_messages_as_bf16():
    codec = make_codec("hadamard_outliers", bits=3)
    x = torch.randn(4, 1, 64)  # a generation step: one new token per sequence
    payload = codec.encode(x)
    assert payload.numel() == codec.payload_nbytes(x.shape, x.dtype) == 2 * x.numel()
    assert torch.equal(codec.decode(payload, x.shape, x.dtype), x.bfloat16().float())


def test_digit_packing_round_trips_and_is_dense():
    # 11 levels: 2 codes in 7 bits (121 <= 128), 3.5 bits a code; 13: 7 in 26 bits; 15: one in 4.
    assert [digits_per_word(levels) for levels in (3, 5, 7, 9, 11, 13, 15)] == [
        (5, 8), (3, 7), (6, 17), (5, 16), (2, 7), (7, 26), (1, 4)]
    assert packed_digits_nbytes(1000, 11) == 441 and packed_digits_nbytes(1001, 11) == 441  # 63 x 7 bytes
    generator = torch.Generator().manual_seed(0)
    for levels in (3, 11, 13):
        for count in (1, 6, 7, 1001):
            codes = torch.randint(0, levels, (count,), generator=generator, dtype=torch.uint8)
            packed = pack_digits(codes, levels)
            assert packed.dtype == torch.uint8 and packed.numel() == packed_digits_nbytes(count, levels)
            assert torch.equal(unpack_digits(packed, levels, count), codes)


def test_gaussian_codebook_is_the_lloyd_max_quantizer_of_max_abs_scaled_tiles():
    from hf_actcomp.codecs.hadamard_codebook import gaussian_codebook
    table = torch.tensor(gaussian_codebook(11, 32))
    assert table.numel() == 11 and table[0] == -1 and table[-1] == 1 and table[5] == 0
    assert torch.equal(table, -table.flip(0)) and bool((table.diff() > 0).all())
    # Lloyd-Max: each inner level is the mean of the samples nearest to it (fresh samples).
    x = torch.randn(20000, 32, generator=torch.Generator().manual_seed(1))
    x = (x / x.abs().amax(dim=1, keepdim=True)).reshape(-1)
    nearest = (x.unsqueeze(1) - table).abs().argmin(dim=1)
    for level in range(1, 10):
        assert abs(float(x[nearest == level].mean()) - float(table[level])) < 0.005
    grid = torch.linspace(-1, 1, 11)
    uniform = (x.unsqueeze(1) - grid).abs().min(dim=1).values.square().mean()
    assert (x.unsqueeze(1) - table).abs().min(dim=1).values.square().mean() < 0.9 * uniform  # 0.86 here


def test_hadamard_codebook_payload_layout_is_exact():
    codec = make_codec("hadamard_codebook", levels=11)
    rows, tokens, hidden, k = 2, 16, 64, 3
    n = rows * tokens
    # hadamard_outliers' sink, mean and k outliers per token; then the message's largest scale
    # (fp32), one byte of scale per tile of 32, two 11-level codes per 7 bits.
    expected = 4 * rows + 2 * rows * hidden + 2 * hidden + 4 * n * k + 4 + n * hidden // 32 + n * hidden * 7 // 16
    assert codec.payload_nbytes((rows, tokens, hidden), torch.float32) == expected == 1740
    assert codec.encode(_sink_and_outlier_channels()).numel() == expected
    # SmolLM2's boundary (hidden 576, a micro-batch of 4 x 256 tokens): under 4 bits a value.
    shape = (4, 256, 576)
    assert 8 * codec.payload_nbytes(shape, torch.float32) / math.prod(shape) == pytest.approx(3.9951, abs=1e-4)


def test_hadamard_codebook_sends_outliers_apart_in_fewer_bytes_than_4_bits():
    x = _sink_and_outlier_channels(rows=2, tokens=64, hidden=128)
    codec = make_codec("hadamard_codebook", levels=11)
    out = codec.decode(codec.encode(x), x.shape, x.dtype)
    assert torch.equal(out[:, 3], x[:, 3].bfloat16().float())  # the sink, whole in bf16
    three, four = make_codec("hadamard_outliers", bits=3), make_codec("hadamard_outliers", bits=4)
    nbytes = {c: c.payload_nbytes(x.shape, x.dtype) for c in (codec, three, four)}
    assert nbytes[three] < nbytes[codec] < nbytes[four]
    assert _relative_error(codec, x) < 0.9 * _relative_error(three, x)  # 0.84 here
    assert torch.equal(codec.decode(codec.encode(torch.zeros(2, 8, 64)), (2, 8, 64), torch.float32),
                       torch.zeros(2, 8, 64))


def test_hadamard_codebook_clips_a_lone_extreme_value(monkeypatch):
    import hf_actcomp.codecs.hadamard_codebook as module
    x = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(0))
    fitted = _relative_error(make_codec("hadamard_codebook", levels=5, outliers=0), x)
    monkeypatch.setattr(module, "CLIP_STEPS", (0,))  # max-abs scales only
    assert fitted < 0.95 * _relative_error(make_codec("hadamard_codebook", levels=5, outliers=0), x)


def test_hadamard_codebook_picks_each_tiles_best_scale_and_nearest_levels(monkeypatch):
    """Per tile, the sent scale's squared error is the least of the trial scales' (max-abs alone is
    one of them), and every value decodes to the level nearest it at that scale."""
    import hf_actcomp.codecs.hadamard_codebook as module
    codec = make_codec("hadamard_codebook", levels=7, outliers=0)
    tiles = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    tiles[::3, 5] *= 4  # a lone extreme value in every third tile

    def decoded(c):
        top, scales, codes = c._encode_tiles(tiles.clone())
        parts = {"top_scale": top, "scales": scales, "codes": codes}
        return c._decode_tiles(parts, tiles.numel(), 32), module._scale(module.from_bytes(top, torch.float32, 1),
                                                                          scales.float()).unsqueeze(1)

    fitted, scale = decoded(codec)
    levels = torch.tensor(module.gaussian_codebook(7, 32)) * scale  # (tiles, 7) per tile's scale
    nearest = levels.gather(1, (tiles.unsqueeze(2) - levels.unsqueeze(1)).abs().argmin(dim=2))
    assert ((fitted - tiles).abs() <= (nearest - tiles).abs() + 1e-5).all()
    monkeypatch.setattr(module, "CLIP_STEPS", (0,))
    max_abs, _ = decoded(codec)
    fitted_err, max_abs_err = ((d - tiles).square().sum(dim=1) for d in (fitted, max_abs))
    assert (fitted_err <= max_abs_err * (1 + 1e-5)).all() and (fitted_err < 0.9 * max_abs_err)[::3].float().mean() > 0.5


def test_hadamard_codebook_levels_are_checked_by_name():
    from hf_actcomp import Compression
    with pytest.raises(ValueError, match=r"Compression.levels=12 is not valid. Allowed values: 3, 5, 7, 9, 11, 13, 15\."):
        Compression("hadamard_codebook", levels=12)
    with pytest.raises(ValueError, match=r"needs levels \(allowed: 3, 5, 7, 9, 11, 13, 15\)"):
        Compression("hadamard_codebook")
    with pytest.raises(ValueError, match="hadamard_codebook levels=4 is not valid"):
        make_codec("hadamard_codebook", levels=4)
    assert Compression("hadamard_codebook", levels=11).describe() == "hadamard_codebook11"
    assert Compression("quantize", bits=4).levels is None  # other codecs leave it unset


def test_gaussian_vq_codebook_is_kmeans_of_the_gaussian_and_beats_one_bit_per_value():
    from hf_actcomp.codecs.hadamard_vq import DIM, _nearest, gaussian_vq_codebook
    words = gaussian_vq_codebook(64)
    assert words.shape == (64, DIM) and words.dtype == torch.float32
    assert torch.equal(words, gaussian_vq_codebook(64))  # one table per size, the same each call
    # k-means: each word is (close to) the mean of fresh Gaussian vectors nearest to it.
    x = torch.randn(200_000, DIM, generator=torch.Generator().manual_seed(1))
    nearest = _nearest(x, words)
    means = torch.zeros_like(words).index_add_(0, nearest, x) / torch.bincount(nearest, minlength=64).unsqueeze(1)
    assert (means - words).abs().max() < 0.1  # 0.06 here: 40 Lloyd steps, 3,000 samples a cell
    distortion = {levels: float((x - gaussian_vq_codebook(levels)[_nearest(x, gaussian_vq_codebook(levels))])
                                .square().mean()) for levels in (64, 256)}
    # Per value: 0.75 bits 0.44, 1 bit 0.31, where the best 1-bit scalar code (sign, mean |x|) leaves 1 - 2/pi.
    assert 0.40 < distortion[64] < 0.48 and 0.28 < distortion[256] < 0.9 * (1 - 2 / math.pi)


def test_hadamard_vq_payload_layout_is_exact_and_under_one_bit_a_value():
    codec = make_codec("hadamard_vq", levels=128)
    rows, tokens, hidden = 2, 16, 64
    n = rows * tokens
    # hadamard_outliers' sink (int32 index, bf16 token) and fp16 channel mean, no outlier channels by
    # default; the message's largest scale (fp32), one byte of scale per token, 7 bits per 8 values.
    expected = 4 * rows + 2 * rows * hidden + 2 * hidden + 4 + n + n * hidden // 8 * 7 // 8
    assert codec.payload_nbytes((rows, tokens, hidden), torch.float32) == expected == 652
    assert codec.encode(_sink_and_outlier_channels()).numel() == expected
    # A hidden size that is not a multiple of 8: its last word is padded (13 -> 2 words a token);
    # 36 4-bit words pack 8 at a time into 20 bytes.
    assert make_codec("hadamard_vq", levels=16).payload_nbytes((2, 9, 13), torch.float32) == \
        4 * 2 + 2 * 2 * 13 + 2 * 13 + 4 + 18 + 20
    # SmolLM2's boundary, a micro-batch of 2 x 128 tokens: 64 words are 33.6x fewer bytes than fp32,
    # 128 words 29.7x (the sink and the mean weigh 0.19 bits a value); at 4 x 256 tokens 128 words 33.1x.
    ratio = lambda levels, shape: 4 * math.prod(shape) / make_codec("hadamard_vq", levels=levels).payload_nbytes(  # noqa: E731
        shape, torch.float32)
    assert ratio(64, (2, 128, 576)) == pytest.approx(33.61, abs=0.01)
    assert ratio(128, (2, 128, 576)) == pytest.approx(29.71, abs=0.01)
    assert ratio(128, (4, 256, 576)) == pytest.approx(33.08, abs=0.01)


def test_hadamard_vq_sends_each_group_to_its_nearest_word_at_the_tokens_scale():
    import hf_actcomp.codecs.hadamard_vq as module
    codec = make_codec("hadamard_vq", levels=32)
    tiles = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.1, 3, 40).unsqueeze(1)
    top, scales, codes = codec._encode_tiles(tiles.clone())
    scale = module._scale(module.from_bytes(top, torch.float32, 1), scales.float()).unsqueeze(1)
    rms = tiles.square().mean(dim=1, keepdim=True).sqrt()
    assert ((scale / rms).log2().abs() <= 1 / 32 + 1e-6).all()  # the nearest of the 16-a-octave scales
    decoded = codec._decode_tiles({"top_scale": top, "scales": scales, "codes": codes}, tiles.numel(), 64)
    words = module.gaussian_vq_codebook(32) * scale.reshape(-1, 1, 1)  # (tokens, 32, 8) at each token's scale
    groups = tiles.reshape(40, 8, 8)
    best = (groups.unsqueeze(2) - words.unsqueeze(1)).square().sum(dim=3).min(dim=2).values  # (tokens, 8)
    sent = (decoded.reshape(40, 8, 8) - groups).square().sum(dim=2)
    assert torch.allclose(sent, best, rtol=1e-4, atol=1e-6)


def test_hadamard_vq_keeps_the_sink_and_zeros_and_checks_its_levels():
    from hf_actcomp import Compression
    x = _sink_and_outlier_channels(rows=2, tokens=64, hidden=128)
    codec = make_codec("hadamard_vq", levels=256)
    out = codec.decode(codec.encode(x), x.shape, x.dtype)
    assert torch.equal(out[:, 3], x[:, 3].bfloat16().float())  # the sink, whole in bf16
    assert 0.45 < _relative_error(codec, torch.randn(4, 64, 128)) < 0.62  # 1 bit a value: sqrt(0.31)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(2, 8, 64)), (2, 8, 64), torch.float32),
                       torch.zeros(2, 8, 64))
    with pytest.raises(ValueError, match=r"Compression.levels=100 is not valid. Allowed values: 16, 32, 64, 128, 256\."):
        Compression("hadamard_vq", levels=100)
    with pytest.raises(ValueError, match=r"needs levels \(allowed: 16, 32, 64, 128, 256\)"):
        Compression("hadamard_vq")
    with pytest.raises(ValueError, match="hadamard_vq levels=11 is not valid"):
        make_codec("hadamard_vq", levels=11)
    assert Compression("aqsgd", inner="hadamard_vq", levels=64).describe() == "aqsgd-hadamard_vq64"


def test_hadamard_vq_without_sink_and_mean_sends_only_scales_and_words():
    """`sink_and_mean=False` (for AQ-SGD's deltas): no sink index, sink token nor mean in the
    payload, every token (the sink's too) coded at its own scale; the label says so."""
    from hf_actcomp import Compression
    codec = make_codec("hadamard_vq", levels=128, sink_and_mean=False)
    rows, tokens, hidden = 2, 16, 64
    n = rows * tokens
    assert codec.payload_nbytes((rows, tokens, hidden), torch.float32) == 4 + n + n * hidden // 8 * 7 // 8 == 260
    x = _sink_and_outlier_channels()
    payload = codec.encode(x)
    assert payload.numel() == 260
    out = codec.decode(payload, x.shape, x.dtype)
    assert not torch.equal(out[:, 3], x[:, 3].bfloat16().float())  # the sink is coded, not sent whole
    sink_error = (out[:, 3] - x[:, 3]).norm() / x[:, 3].norm()
    assert 0.3 < sink_error < 0.8  # at its own scale: the codebook's relative error, not swamped
    # SmolLM2's 2 x 128-token micro-batch: 128 words 36.0x fewer bytes than fp32 (29.7x with the sink
    # and the mean apart), 64 words 41.9x.
    ratio = lambda levels: 4 * 2 * 128 * 576 / make_codec(  # noqa: E731
        "hadamard_vq", levels=levels, sink_and_mean=False).payload_nbytes((2, 128, 576), torch.float32)
    assert ratio(128) == pytest.approx(35.99, abs=0.01) and ratio(64) == pytest.approx(41.88, abs=0.01)
    warm_up = Compression("hadamard_vq", levels=256)
    assert Compression("aqsgd", inner="hadamard_vq", levels=128, sink_and_mean=False, first_visit=warm_up).describe() \
        == "aqsgd-hadamard_vq128-nosink (warm-up hadamard_vq256)"
    assert Compression("hadamard_vq", levels=64, sink_and_mean=True).describe() == "hadamard_vq64"
    assert Compression("hadamard_vq", levels=32, outliers=1).describe() == "hadamard_vq32-o1"
    with pytest.raises(ValueError, match=r"Compression.sink_and_mean='no' is not valid. Allowed values: True, False\."):
        Compression("hadamard_vq", levels=64, sink_and_mean="no")


def test_lowrank_sends_two_bf16_factors_and_keeps_a_low_rank_matrix():
    """2 * rank * (rows + hidden) bytes whatever the data (88.6x fewer than fp32 at rank 4 for a
    2 x 128 x 576 micro-batch); a matrix of rank <= `rank` comes back to bf16's rounding, a
    higher-rank one as its best rank-r approximation, a rank-deficient one padded with zeros."""
    codec = make_codec("lowrank", rank=4)
    assert codec.payload_nbytes((2, 128, 576), torch.float32) == 2 * 4 * (256 + 576)
    assert 4 * 2 * 128 * 576 / codec.payload_nbytes((2, 128, 576), torch.float32) == pytest.approx(88.6, abs=0.05)
    torch.manual_seed(0)
    low = (torch.randn(2, 10, 3) @ torch.randn(3, 24))
    out = codec.decode(codec.encode(low), low.shape, low.dtype)
    assert ((out - low).norm() / low.norm()) < 1e-2
    full = torch.randn(40, 24)
    out = codec.decode(codec.encode(full), full.shape, full.dtype)
    u, s, vh = torch.linalg.svd(full, full_matrices=False)
    best = (u[:, :4] * s[:4]) @ vh[:4]
    assert ((out - best).norm() / best.norm()) < 1e-2 and (out - full).norm() > 0.5 * full.norm()
    thin = torch.randn(2, 7)  # rank 2 < 4: two zero factors
    assert codec.encode(thin).numel() == 2 * 4 * (2 + 7)
    torch.testing.assert_close(codec.decode(codec.encode(thin), thin.shape, thin.dtype), thin, atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match=re.escape("lowrank rank=300 is outside the allowed range 1..256")):
        make_codec("lowrank", rank=300)
