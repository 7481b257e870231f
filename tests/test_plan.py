import json
import logging

import pytest

import hf_actcomp
from hf_actcomp import Compression, MemoryConfig, Plan
from hf_actcomp.debug import debug_model
from hf_actcomp.plan import CONFIG_NAME, FORMAT_VERSION


def aqsgd_plan(**kw) -> Plan:
    return Plan(
        num_stages=3,
        micro_batches=4,
        forward=Compression("aqsgd", bits=4, first_visit="direct"),
        backward=Compression("quantize", bits=8, rounding="stochastic"),
        memory=MemoryConfig(store="mmap", dtype="int8", num_samples=100),
        **kw,
    )


def test_json_yaml_and_pretrained_round_trip(tmp_path):
    plan = aqsgd_plan(split_points=[1, 3])
    assert Plan.from_json_string(plan.to_json_string()) == plan
    assert Plan.from_yaml_string(plan.to_yaml_string()) == plan
    path = plan.save_pretrained(tmp_path)
    assert path.endswith(CONFIG_NAME)
    data = json.loads(open(path).read())
    assert data["format_version"] == FORMAT_VERSION
    assert data["forward"]["method"] == "aqsgd"
    assert Plan.from_pretrained(tmp_path) == plan
    (tmp_path / "plan.yaml").write_text(plan.to_yaml_string())
    assert Plan.from_file(tmp_path / "plan.yaml") == plan


def warm_up_plan() -> Plan:
    return Plan(num_stages=2, forward=Compression("aqsgd", bits=2, first_visit=Compression("hadamard", bits=4)),
                backward=Compression("quantize", bits=4), memory=MemoryConfig(num_samples=10))


def test_compressed_warm_up_round_trips(tmp_path):
    plan = warm_up_plan()
    assert Plan.from_json_string(plan.to_json_string()) == plan
    assert Plan.from_yaml_string(plan.to_yaml_string()) == plan
    assert isinstance(Plan.from_yaml_string(plan.to_yaml_string()).forward.first_visit, Compression)
    plan.save_pretrained(tmp_path)
    data = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert data["forward"]["first_visit"]["method"] == "hadamard" and data["forward"]["first_visit"]["bits"] == 4
    assert Plan.from_pretrained(tmp_path) == plan
    (tmp_path / "plan.yaml").write_text(plan.to_yaml_string())
    assert Plan.from_file(tmp_path / "plan.yaml") == plan
    # A hand-written dict (JSON, YAML) needs only the fields it sets.
    short = Compression("aqsgd", bits=2, first_visit={"method": "quantize", "bits": 8})
    assert short.first_visit == Compression("quantize", bits=8)
    data = {"forward": {"method": "aqsgd", "bits": 2, "first_visit": {"method": "quantize", "bits": 8}}}
    assert Plan.from_dict(data).forward == short


def test_compressed_warm_up_unknown_nested_keys_warn(caplog):
    data = warm_up_plan().to_dict()
    data["forward"]["first_visit"]["future_knob"] = 1
    with caplog.at_level(logging.WARNING, logger="hf_actcomp.plan"):
        assert Plan.from_dict(data) == warm_up_plan()
    assert "Compression.first_visit" in caplog.text and "future_knob" in caplog.text


@pytest.mark.parametrize(
    "first_visit, message",
    [
        (Compression("aqsgd", bits=4), "first_visit.method='aqsgd' is not valid: the warm-up codec must be stateless. "
         "Allowed values: bf16, fp16, hadamard, hadamard_codebook, hadamard_outliers, hadamard_vq, lowrank, none, quantize, randk, topk, topk_quantize."),
        (Compression("topk", ratio=0.1, feedback="ef"), "first_visit.feedback='ef' is not valid: the warm-up codec "
         "must be stateless. Allowed values: none."),
        (Compression("quantize", bits=4, feedback="ef21"), "first_visit.feedback='ef21' is not valid"),
        ({"method": "aqsgd", "bits": 2}, "first_visit.method='aqsgd' is not valid"),
        ({"method": "hadamard"}, r"Compression.first_visit: Compression\(method='hadamard'\) needs bits"),
        ({"method": "quantize", "bits": 12}, "first_visit: Compression.bits=12 is outside the allowed range"),
        (4, "first_visit=4 is not valid. Allowed values: full, direct, or a stateless Compression "
         r"\(method: bf16, fp16, hadamard, hadamard_codebook, hadamard_outliers, hadamard_vq, lowrank, none, quantize, randk, topk, topk_quantize; feedback: none\)"),
    ],
)
def test_compressed_warm_up_validation(first_visit, message):
    with pytest.raises(ValueError, match=message):
        Compression("aqsgd", bits=2, first_visit=first_visit)


def test_unknown_keys_from_newer_version_warn(tmp_path, caplog):
    data = aqsgd_plan().to_dict()
    data["format_version"] = FORMAT_VERSION + 1
    data["future_field"] = 1
    data["forward"]["future_knob"] = "x"
    with caplog.at_level(logging.WARNING, logger="hf_actcomp.plan"):
        plan = Plan.from_dict(data)
    assert plan == aqsgd_plan()
    text = caplog.text
    assert "newer" in text and "future_field" in text and "future_knob" in text


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        Plan.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="zip"), "method='zip' is not valid. Allowed values: aqsgd, bf16, fp16, hadamard, hadamard_codebook, hadamard_outliers, hadamard_vq, lowrank, none, quantize, randk, topk, topk_quantize"),
        (dict(method="quantize"), "needs bits"),
        (dict(method="quantize", bits=9), "bits=9 is outside the allowed range 1..8"),
        (dict(method="quantize", bits=0), "bits=0 is outside the allowed range 1..8"),
        (dict(method="topk", ratio=0.0), r"ratio=0.0 is outside the allowed range \(0, 1\]"),
        (dict(method="topk", ratio=1.5), r"ratio=1.5 is outside the allowed range \(0, 1\]"),
        (dict(method="randk"), "needs ratio"),
        (dict(method="quantize", bits=4, rounding="up"), "rounding='up' is not valid. Allowed values: deterministic, stochastic"),
        (dict(method="quantize", bits=4, granularity="row"), "Allowed values: group, channel"),
        (dict(method="quantize", bits=4, group_size=0), "group_size=0"),
        (dict(method="topk", ratio=0.1, feedback="ef3"), "Allowed values: none, ef, ef21"),
        (dict(method="aqsgd", bits=4, feedback="ef"), "cannot be combined with method='aqsgd'"),
        (dict(method="aqsgd", bits=4, first_visit="skip"), "Allowed values: full, direct"),
        (dict(method="aqsgd", inner="randk", ratio=0.1), "Allowed values: quantize, topk, hadamard, hadamard_outliers, hadamard_codebook, hadamard_vq, lowrank"),
    ],
)
def test_compression_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Compression(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_stages=0), "num_stages=0 must be an integer >= 1"),
        (dict(micro_batches=0), "micro_batches=0"),
        (dict(schedule="zb"), "schedule='zb' is not valid. Allowed values: gpipe, 1f1b"),
        (dict(num_stages=4, micro_batches=2), "1f1b' needs micro_batches >= num_stages"),
        (dict(num_stages=3, split_points=[2]), "must have num_stages - 1 = 2 entries"),
        (dict(num_stages=3, split_points=[2, 2]), "strictly increasing"),
        (dict(num_stages=2, split_points=[0]), "positive integers"),
        (dict(backward=Compression("aqsgd", bits=4)), "backward.method='aqsgd' is not supported"),
        (dict(memory={"store": "disk"}), "store='disk' is not valid. Allowed values: device, host, mmap"),
        (dict(memory={"dtype": "int4"}), "Allowed values: fp32, fp16, bf16, int8"),
    ],
)
def test_plan_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Plan(**kwargs)


def test_aqsgd_memory_size_checked_before_training():
    plan = Plan(forward=Compression("aqsgd", bits=4))  # ActCompTrainer fills num_samples later
    with pytest.raises(ValueError, match="needs memory.num_samples"):
        plan.check_memory()
    with pytest.raises(ValueError, match="needs memory.num_samples"):
        hf_actcomp.simulate(debug_model("gpt2"), plan)


def test_gpipe_allows_few_micro_batches():
    assert Plan(num_stages=4, micro_batches=1, schedule="gpipe").micro_batches == 1


def test_stage_ranges_explicit_and_balanced():
    plan = Plan(num_stages=3, micro_batches=3, split_points=[1, 3])
    assert plan.stage_ranges(4) == [range(0, 1), range(1, 3), range(3, 4)]
    with pytest.raises(ValueError, match="must all be < the model's 3 blocks"):
        plan.stage_ranges(3)
    with pytest.raises(ValueError, match="more than the model's 2 blocks"):
        plan.stage_ranges(2)
    balanced = Plan(num_stages=2)
    assert balanced.stage_ranges(4) == [range(0, 2), range(2, 4)]
    # A heavy embedding on the first stage pushes blocks to the second.
    assert balanced.stage_ranges(4, [10] * 4, first_cost=20) == [range(0, 1), range(1, 4)]
    # Costs [1]*6 with a head of 2: the best split has max stage cost 3 and one block last.
    ranges = Plan(num_stages=3, micro_batches=3).stage_ranges(6, [1] * 6, first_cost=0, last_cost=2)
    assert ranges[-1] == range(5, 6)
    assert max(len(r) for r in ranges) == 3 and sum(len(r) for r in ranges) == 6


def test_describe_labels():
    assert Compression("aqsgd", bits=4).describe() == "aqsgd-quantize4"
    assert Compression("topk", ratio=0.1, feedback="ef").describe() == "topk0.1+ef"
    assert Compression().describe() == "none"
    assert Compression("aqsgd", bits=4, first_visit="direct").describe() == "aqsgd-quantize4"
    warm_up = Compression("aqsgd", bits=2, first_visit=Compression("hadamard", bits=4))
    assert warm_up.describe() == "aqsgd-quantize2 (warm-up hadamard4)"
    assert Compression("aqsgd", inner="topk", ratio=0.3, first_visit=Compression("fp16")).describe() == (
        "aqsgd-topk0.3 (warm-up fp16)")
    hadamard = Compression("hadamard", bits=3, group_size=64, rounding="stochastic", seed=2)
    assert hadamard.describe() == "hadamard3"
    assert hadamard.codec_params() == dict(bits=3, group_size=64, rounding="stochastic", seed=2)
    with pytest.raises(ValueError, match=r"Compression\(method='hadamard'\) needs bits"):
        Compression("hadamard")


def test_data_parallel_fields():
    plan = Plan(num_stages=2, data_parallel=3, dp_compression={"method": "dgc", "ratio": 0.001})
    assert plan.world_size == 6 and plan.dp_hook() == ("dgc", {"ratio": 0.001})
    assert Plan.from_json_string(plan.to_json_string()) == plan
    with pytest.raises(ValueError, match="Plan.dp_compression='top-k' is not valid. Allowed values: allreduce, dgc"):
        Plan(dp_compression="top-k")
    with pytest.raises(ValueError, match="Plan.data_parallel=0 must be an integer >= 1"):
        Plan(data_parallel=0)


def test_hadamard_vq_across_several_boundaries_warns():
    """Under one bit a value `hadamard_vq` held on SmolLM2's one boundary (2 stages) and broke on
    three (docs/real_model.md): a plan that sends it across several warns, naming what was measured."""
    import warnings

    vq = Compression("hadamard_vq", levels=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Plan(num_stages=2, forward=Compression("aqsgd", inner="hadamard_vq", levels=64, first_visit=vq), backward=vq)
        Plan(num_stages=4, forward=Compression("hadamard_outliers", bits=4))
    with pytest.warns(UserWarning, match=r"hadamard_vq at 4 stages: on SmolLM2-135M .* \+2.3% .* \+20% in instruction tuning"):
        Plan(num_stages=4, backward=vq)
    with pytest.warns(UserWarning, match="hadamard_vq at 3 stages"):
        Plan(num_stages=3, boundaries=[None, {"forward": vq}])


@pytest.mark.parametrize("one_boundary, measured, two", [
    (Compression("aqsgd", bits=4, refresh_every=2),
     r"AQ-SGD refresh_every > 1 on 3 boundaries: on SmolLM2-135M .* learn nothing \(\+2.5% eval loss",
     "refresh_every > 1 on 2 boundaries"),
    (Compression("aqsgd", inner="lowrank", rank=4, deltas="drift"),
     r"AQ-SGD deltas='drift' on 3 boundaries: on SmolLM2-135M .* never corrected, were measured to cost \+2.8% eval loss",
     "deltas='drift' on 2 boundaries"),
])
def test_one_boundary_aqsgd_options_across_several_boundaries_warn(one_boundary, measured, two):
    """`refresh_every` > 1 (its reused epoch learned nothing) and `deltas="drift"` (the first
    visits' errors, never corrected) held on one boundary of SmolLM2 and broke across three
    (docs/real_model.md): a plan with either on more than one boundary warns, naming the measurement."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Plan(num_stages=2, forward=one_boundary)
        Plan(num_stages=4, forward=Compression("aqsgd", bits=4), boundaries=[None, {"forward": one_boundary}, None])
    with pytest.warns(UserWarning, match=measured):
        Plan(num_stages=4, forward=one_boundary)
    with pytest.warns(UserWarning, match=two):
        Plan(num_stages=3, boundaries=[{"forward": one_boundary}, {"forward": one_boundary}])
