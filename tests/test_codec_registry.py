"""One registration per codec and per data-parallel hook: a codec of a user's own (tests/toy_codec.py),
registered with `register_codec` and nothing else, works in a Plan, a saved plan, `simulate`, a
2-process `prepare` and a model card; a hook registered with `dp.register_hook` works in a Plan."""

from __future__ import annotations

import json

import pytest
import torch
from distributed import run_workers
from pipeline_cases import simulated_sgd_losses, training_batches
from toy_codec import AbsMaxCodec

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan, dp, hub, simulate
from hf_actcomp.codecs import CODECS, Param, available_codecs, make_codec, register_codec
from hf_actcomp.codecs.packing import packed_nbytes
from hf_actcomp.debug import debug_model
from hf_actcomp.feedback import build_codec
from hf_actcomp.plan import CONFIG_NAME

BUILT_IN = "bf16, fp16, hadamard, hadamard_codebook, hadamard_outliers, hadamard_vq, lowrank, none, quantize, randk, topk, topk_quantize"


@pytest.fixture
def absmax():
    """The toy codec registered for one test, and the built-in registry again afterwards."""
    register_codec(AbsMaxCodec)
    yield AbsMaxCodec
    del CODECS[AbsMaxCodec.name]


def absmax_plan() -> Plan:
    return Plan(num_stages=2, micro_batches=2, forward=Compression("absmax", bits=4),
                backward=Compression("absmax", bits=8))


def test_an_unregistered_codec_is_refused_with_the_way_to_add_it():
    assert "absmax" not in available_codecs()
    with pytest.raises(ValueError) as err:
        Compression("absmax", bits=4)
    assert str(err.value) == (
        f"Compression.method='absmax' is not valid. Allowed values: aqsgd, {BUILT_IN}. A codec of your own must "
        "be registered (hf_actcomp.register_codec) in every process before the plan is built or read.")
    with pytest.raises(ValueError, match="Unknown codec 'absmax'"):
        make_codec("absmax", bits=4)


def test_the_codec_encodes_and_decodes(absmax):
    codec = make_codec("absmax", bits=3)  # M = 3 levels each side of zero
    x = torch.tensor([[-2.0, -1.0, 0.0], [0.5, 2.0, 1.0]])
    payload = codec.encode(x)
    assert payload.numel() == codec.payload_nbytes(x.shape, x.dtype) == 4 + 3  # scale + 6 codes of 3 bits
    # x / s * M = [-3, -1.5, 0, 0.75, 3, 1.5] rounds (half to even) to [-3, -2, 0, 1, 3, 2].
    expected = torch.tensor([[-2.0, -4 / 3, 0.0], [2 / 3, 2.0, 4 / 3]])
    torch.testing.assert_close(make_codec("absmax", bits=3).decode(payload, x.shape, x.dtype), expected)
    assert codec.decode(codec.encode(torch.zeros(5)), (5,), torch.float32).abs().sum() == 0


def test_a_registered_codec_is_a_plan_method(absmax):
    compression = Compression("absmax", bits=4, rounding="stochastic", seed=3)
    assert compression.codec_params() == {"bits": 4}  # the fields it declares, no others
    assert compression.describe() == "absmax4"
    assert compression.feedback == "none" and Compression("absmax", bits=4, feedback="ef").describe() == "absmax4+ef"
    codec = build_codec(compression)
    assert isinstance(codec, AbsMaxCodec) and codec.bits == 4
    # Its own checks, with Compression's messages.
    with pytest.raises(ValueError, match=r"^Compression\(method='absmax'\) needs bits \(allowed: 2..8\)\.$"):
        Compression("absmax")
    with pytest.raises(ValueError, match=r"^Compression.bits=1 is outside the allowed range 2..8\.$"):
        Compression("absmax", bits=1)
    with pytest.raises(ValueError, match=r"^absmax bits=9 is outside the allowed range 2..8\.$"):
        make_codec("absmax", bits=9)
    # A stateless codec: a compressed AQ-SGD warm-up and the tied rows may use it too.
    warm_up = Compression("aqsgd", bits=2, first_visit=Compression("absmax", bits=8))
    assert warm_up.describe() == "aqsgd-quantize2 (warm-up absmax8)"
    assert Plan(tie_compression={"method": "absmax", "bits": 6}).tie_compression.describe() == "absmax6"
    with pytest.raises(ValueError, match=f"Allowed values: absmax, {BUILT_IN}\\."):
        Compression("aqsgd", bits=2, first_visit=Compression("aqsgd", bits=4))
    with pytest.raises(ValueError, match=f"method='zip' is not valid. Allowed values: absmax, aqsgd, {BUILT_IN}\\."):
        Compression("zip")


def test_registration_refuses_what_a_plan_could_not_use(absmax):
    assert register_codec(AbsMaxCodec) is AbsMaxCodec  # the same class again: a no-op

    class Other(AbsMaxCodec):
        pass

    with pytest.raises(ValueError, match="A codec named 'absmax' is already registered"):
        register_codec(Other)

    class Aqsgd(AbsMaxCodec):
        name = "aqsgd"

    with pytest.raises(ValueError, match="name='aqsgd' must be a non-empty string other than aqsgd"):
        register_codec(Aqsgd)

    class Levels(AbsMaxCodec):
        name = "levels"
        params = {"bits": AbsMaxCodec.params["bits"], "levels": Param()}

    with pytest.raises(ValueError, match=r"Levels.params names \['levels'\], which Levels.__init__ does not take"):
        register_codec(Levels)
    with pytest.raises(TypeError, match="expects a Codec subclass"):
        register_codec(int)
    assert "levels" not in CODECS


def test_a_codec_may_only_declare_compression_fields():
    class Width(AbsMaxCodec):
        name = "width"
        params = {"width": Param(integer=True, low=1)}

        def __init__(self, width: int = 1) -> None:
            super().__init__(bits=4)

    register_codec(Width)
    try:
        with pytest.raises(ValueError, match="Codec 'width' declares the field 'width', which Compression does not"):
            Compression("width")
    finally:
        del CODECS["width"]


def test_saved_plan_round_trip(absmax, tmp_path):
    plan = absmax_plan()
    plan.forward = Compression("aqsgd", bits=2, first_visit=Compression("absmax", bits=8))
    plan.memory = MemoryConfig(num_samples=16)
    plan.tie_compression = Compression("absmax", bits=6)
    assert Plan.from_json_string(plan.to_json_string()) == plan
    assert Plan.from_yaml_string(plan.to_yaml_string()) == plan
    plan.save_pretrained(tmp_path)
    data = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert (data["forward"]["first_visit"]["method"], data["forward"]["first_visit"]["bits"]) == ("absmax", 8)
    assert data["backward"]["method"] == "absmax" and data["tie_compression"]["bits"] == 6
    assert Plan.from_pretrained(tmp_path) == plan


def test_model_card(absmax, tmp_path):
    absmax_plan().save_pretrained(tmp_path)
    card = hub.model_card(tmp_path)
    assert "absmax-quantization" in card.data.tags and "absmax" not in card.data.tags
    assert "| forward (activations) | `absmax4` |" in card.text
    assert "| backward (activation gradients) | `absmax8` |" in card.text


def expected_boundary_bytes(model, steps: int, micro_batches: int = 2) -> dict[str, int]:
    """Bytes each direction of boundary 0 sends: one toy payload per micro-batch and step."""
    batch = next(training_batches(model.config.vocab_size, 1))
    numel = batch["input_ids"].numel() // micro_batches * model.config.hidden_size
    return {"boundary0.forward": steps * micro_batches * (4 + packed_nbytes(numel, 4)),
            "boundary0.backward": steps * micro_batches * (4 + numel)}


def simulated_losses(plan: Plan, steps: int) -> tuple[list[float], dict]:
    """The losses of `steps` SGD steps under `simulate`, the training loop the worker runs."""
    sim = simulate(debug_model("gpt2", seed=0), plan)
    return simulated_sgd_losses(sim, steps), sim.stats()


def test_simulate(absmax):
    losses, stats = simulated_losses(absmax_plan(), steps=3)
    expected = expected_boundary_bytes(debug_model("gpt2", seed=0), steps=3)
    for channel, nbytes in expected.items():
        assert stats["channels"][channel]["bytes_sent"] == nbytes
        assert 0 < stats["relative_error"][channel] < 0.5
    assert losses[-1] < losses[0]


def test_two_process_prepare_reads_the_saved_plan_and_matches_simulate(absmax, tmp_path):
    steps = 3
    absmax_plan().save_pretrained(tmp_path / "plan")
    run_workers("codec_registry_worker.py", 2, [str(tmp_path / "plan"), str(tmp_path), str(steps)])
    result = json.loads((tmp_path / "result.json").read_text())
    losses, _ = simulated_losses(absmax_plan(), steps)
    assert result["losses"] == pytest.approx(losses, rel=1e-4)
    expected = expected_boundary_bytes(debug_model("gpt2", seed=0), steps)
    for channel, nbytes in expected.items():
        assert result["stats"]["channels"][channel]["bytes_sent"] == nbytes


class MeanAgain(dp.AllReduceCompressor):
    """A data-parallel hook of a user's own (the exact average under another name)."""

    name = "mean_again"


def test_a_registered_dp_hook_is_a_plan_choice(tmp_path):
    with pytest.raises(ValueError, match="Plan.dp_compression='mean_again' is not valid. Allowed values: allreduce, "):
        Plan(data_parallel=2, dp_compression="mean_again")
    assert dp.register_hook(MeanAgain) is MeanAgain
    try:
        plan = Plan(data_parallel=2, dp_compression={"method": "mean_again"})
        assert plan.dp_hook() == ("mean_again", {})
        plan.save_pretrained(tmp_path)
        assert Plan.from_pretrained(tmp_path) == plan
        assert "mean_again" in hub.model_card(tmp_path).data.tags
        with pytest.raises(ValueError, match="A data-parallel hook named 'topk' is already registered"):
            dp.register_hook(type("TopK", (dp.AllReduceCompressor,), {"name": "topk"}))
        with pytest.raises(TypeError, match="expects a GradientCompressor subclass"):
            dp.register_hook(AbsMaxCodec)
    finally:
        del dp.HOOKS["mean_again"]
    assert dp.available_hooks() == ["allreduce", "dgc", "ef_sign", "marsit", "powersgd", "qsgd", "randk", "topk"]
    assert hf_actcomp.register_codec is register_codec
