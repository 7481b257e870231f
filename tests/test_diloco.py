"""DiLoCo outer steps (Plan(dp_compression="diloco")) on torchft: exactness, bytes, stagger, settings."""

import json
import sys

import pytest
import torch
from distributed import run_workers
from safetensors.torch import load_file

from hf_actcomp import Compression, Plan
from hf_actcomp.dp.diloco import ROW, PseudoGradientCodec
from hf_actcomp.dp.fragments import split_fragments
from hf_actcomp.dp.heal_transport import decode_state, encode_state
from hf_actcomp.dp.outer import lighthouse_addresses, require_torchft
from hf_actcomp.plan import DiLoCoConfig


def load(out, name: str, rank: int):
    tensors = load_file(out / f"{name}-rank{rank}.safetensors")
    info_path = out / f"{name}-rank{rank}.json"
    return tensors, (json.loads(info_path.read_text()) if info_path.exists() else None)


def ring(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world


# ----------------------------------------------------------------------------- settings
@pytest.mark.parametrize("params, message", [
    ({"sync_every": 0}, "sync_every=0 must be an integer >= 1"),
    ({"outer_lr": 0}, "outer_lr=0 must be a number > 0"),
    ({"outer_momentum": 1.0}, "outer_momentum=1.0 must be in [0, 1)"),
    ({"outer_momentum": 0.0}, "nesterov=True needs outer_momentum > 0"),
    ({"min_replicas": 3}, "min_replicas=3 must be an integer in 1..data_parallel (2)"),
    ({"compression": {"method": "aqsgd", "bits": 2}}, "needs a stateless codec"),
    ({"compression": {"method": "quantize", "bits": 8, "feedback": "ef"}}, "needs a stateless codec"),
    ({"sync_evry": 4}, "does not take ['sync_evry']. Its settings: compression, error_decay, fragment_sync_delay"),
    ({"fragments": 0}, "fragments=0 must be an integer >= 1"),
    ({"sync_every": 6, "fragments": 4}, "fragments=4 must divide sync_every=6 (one fragment syncs every sync_every / "
                                        "fragments steps): one of [1, 2, 3, 6]"),
    ({"sync_every": 8, "fragments": 4, "fragment_sync_delay": 2}, "fragment_sync_delay=2 must be an integer in 0..1"),
    ({"fragment_sync_delay": -1}, "fragment_sync_delay=-1 must be an integer in 0..31"),
    ({"fragment_update_alpha": 1.5}, "fragment_update_alpha=1.5 must be a number in [0, 1]"),
    ({"error_decay": 0}, "error_decay=0 must be a number in (0, 1] (1: plain error feedback)"),
    ({"error_decay": 1.2}, "error_decay=1.2 must be a number in (0, 1]"),
])
def test_bad_settings_fail_before_any_work(params, message):
    with pytest.raises(ValueError, match="Plan.dp_compression \\(diloco\\)") as err:
        Plan(num_stages=2, data_parallel=2, dp_compression={"method": "diloco", **params})
    assert message in str(err.value)


def test_diloco_needs_replicas_and_round_trips_through_json():
    with pytest.raises(ValueError, match="needs data_parallel >= 2 replicas, got data_parallel=1"):
        Plan(dp_compression="diloco")
    plan = Plan(num_stages=2, data_parallel=2, dp_compression={
        "method": "diloco", "sync_every": 8, "stagger": True, "compression": Compression("hadamard", bits=4)})
    again = Plan.from_json_string(plan.to_json_string())
    assert again.diloco == plan.diloco
    assert plan.diloco.label() == "diloco-H8-hadamard4"
    assert plan.diloco.offset(1, 2) == 4 and DiLoCoConfig(sync_every=8).offset(1, 2) == 0
    streaming = Plan(num_stages=2, data_parallel=2, dp_compression={
        "method": "diloco", "sync_every": 8, "fragments": 4, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5,
        "stagger": True})
    again = Plan.from_json_string(streaming.to_json_string())
    assert again.diloco == streaming.diloco and again.diloco.fragments == 4
    assert streaming.diloco.label() == "diloco-H8-F4-d1-fp32"
    decayed = Plan(num_stages=2, data_parallel=2, dp_compression={
        "method": "diloco", "sync_every": 8, "error_decay": 0.9, "compression": {"method": "quantize", "bits": 8}})
    assert Plan.from_json_string(decayed.to_json_string()).diloco.error_decay == 0.9
    assert decayed.diloco.label() == "diloco-H8-quantize8-ed0.9" and plan.diloco.error_decay == 1.0
    assert streaming.diloco.offset(1, 2) == 1  # stages spread over the 2 steps between two fragment syncs
    assert plan.diloco.fragments == 1 and plan.diloco.fragment_sync_delay == 0  # defaults: DiLoCo as before


def test_fragments_are_contiguous_runs_of_whole_tensors_balanced_by_elements():
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([10, 10, 10, 60, 5, 5])]
    assert [[n for n, _ in f] for f in split_fragments(named, 1)] == [[n for n, _ in named]]
    # 100 elements in 2: the cut nearest to 50 falls after p3 (90) or p2 (30): 30 is nearer
    assert [[n for n, _ in f] for f in split_fragments(named, 2)] == [["p0", "p1", "p2"], ["p3", "p4", "p5"]]
    # in 3 (targets 33.3, 66.7): after p2 (30), then after p3 (90; p4's 95 is farther)
    assert [[n for n, _ in f] for f in split_fragments(named, 3)] == [["p0", "p1", "p2"], ["p3"], ["p4", "p5"]]
    # as many fragments as tensors: one each, however unbalanced
    assert [len(f) for f in split_fragments(named, 6)] == [1] * 6
    with pytest.raises(ValueError, match=r"fragments=7: stage 1 has 6 trainable tensor\(s\).*Use fragments <= 6"):
        split_fragments(named, 7, stage=1)


def test_lighthouses_one_per_stage(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://10.0.0.1:29510, http://10.0.0.1:29511")
    assert lighthouse_addresses(2) == ["http://10.0.0.1:29510", "http://10.0.0.1:29511"]
    with pytest.raises(ValueError, match="names 2 lighthouse\\(s\\); DiLoCo over 3 stages needs one per stage"):
        lighthouse_addresses(3)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    assert lighthouse_addresses(2) is None


def test_missing_torchft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r"pip install 'hf-actcomp\[torchft\]'"):
        require_torchft()


# ----------------------------------------------------------------------------- the pseudo-gradient codec
@pytest.mark.parametrize("method, bits, payload, worst", [
    ("quantize", 8, 3 * ROW + 3 * 4, 0.01),  # 3 rows of 128 int8 and an fp32 scale per group of 128
    # 3 tiles of 128: their 2-bit widths packed in groups of 8 (2 bytes), fp32 scales, 4-bit codes
    ("hadamard", 4, 2 + 3 * 4 + 3 * ROW // 2, 0.15),
])
def test_pseudo_gradient_codec_sizes_and_error_feedback(method, bits, payload, worst):
    numel = 300  # not a multiple of ROW: padded to 3 rows
    codec = PseudoGradientCodec(Compression(method, bits=bits), numel, torch.device("cpu"))
    assert codec.payload_nbytes == payload
    g = torch.Generator().manual_seed(0)
    total_sent = torch.zeros(numel)
    total_true = torch.zeros(numel)
    for _ in range(20):
        x = torch.randn(numel, generator=g)
        sent = codec.encode(x)
        assert sent.dtype == torch.uint8 and sent.numel() == codec.payload_nbytes
        total_sent += codec.decode(sent)
        total_true += x
        # what a payload misses stays small (a codec decoding to zeros would carry all of it)
        assert 0 < codec.error.norm() <= worst * x.norm()
    # error feedback: what was sent over the run equals the sum of the inputs, minus one error buffer
    torch.testing.assert_close(total_sent + codec.error, total_true, rtol=0, atol=1e-4)
    assert codec.decode(codec.encode_nothing()).abs().max() == 0


class _Work:
    def __init__(self, error=None):
        self.error = error

    def wait(self):
        if self.error is not None:
            raise self.error


class _OneReplicaGroup:
    """A process group of one replica whose collectives succeed, fail to start, or fail in wait()."""

    def __init__(self, start_error=None, wait_error=None):
        self.start_error, self.wait_error = start_error, wait_error

    def size(self):
        return 1

    def allgather(self, outputs, inputs, opts):
        if self.start_error is not None:
            raise self.start_error
        outputs[0][0].copy_(inputs[0])
        return _Work(self.wait_error)


class _FailingCodec:
    def __init__(self, fail_in):
        self.fail_in = fail_in

    def encode(self, flat):
        if self.fail_in == "encode":
            raise ValueError("codec bug in encode")
        return flat.clone()

    def decode(self, payload):
        if self.fail_in == "decode":
            raise ValueError("codec bug in decode")
        return payload


@pytest.mark.parametrize("fail_in", ["encode", "decode"])
def test_a_codec_error_raises_instead_of_discarding_the_sync(fail_in):
    """Only a failed collective is a lost peer (the sync discarded, grads kept); a codec's error
    is a bug and reaches the caller."""
    from hf_actcomp.dp.exchange import PseudoGradientExchange

    errors, done = [], []
    grads = [torch.ones(3), torch.ones(2)]

    def exchange(pg, codec):
        return PseudoGradientExchange(grads, pg, codec=codec, participating=True, participants=1,
                                      on_error=errors.append, on_done=lambda *a: done.append(a))

    with pytest.raises(ValueError, match=f"codec bug in {fail_in}"):
        exchange(_OneReplicaGroup(), _FailingCodec(fail_in)).wait()
    assert errors == [] and done == []
    for failure in ({"start_error": RuntimeError("Connection closed by peer")},
                    {"wait_error": TimeoutError("future did not complete within 1s")}):
        exchange(_OneReplicaGroup(**failure), _FailingCodec(None)).wait()
    assert [type(e) for e in errors] == [RuntimeError, TimeoutError] and done == []
    exchange(_OneReplicaGroup(), _FailingCodec(None)).wait()
    assert len(done) == 1 and all(torch.equal(g, torch.ones_like(g)) for g in grads)


def test_heal_transport_keeps_nested_state_with_int_keys():
    state = {"user": {"StreamingDiLoCoFragment_0": {
        "outer_optimizer": {"state": {0: {"momentum_buffer": torch.randn(3)}},
                            "param_groups": [{"lr": 0.7, "nesterov": True, "params": [0], "foreach": None}]},
        "original_parameters": {"a.weight": torch.randn(2, 2)}}}, "torchft": {"step": 3, "batches_committed": 6}}
    again = decode_state(encode_state(state))
    fragment, original = again["user"]["StreamingDiLoCoFragment_0"], state["user"]["StreamingDiLoCoFragment_0"]
    assert torch.equal(fragment["outer_optimizer"]["state"][0]["momentum_buffer"],
                       original["outer_optimizer"]["state"][0]["momentum_buffer"])
    assert fragment["outer_optimizer"]["param_groups"] == original["outer_optimizer"]["param_groups"]
    assert torch.equal(fragment["original_parameters"]["a.weight"], original["original_parameters"]["a.weight"])
    assert again["torchft"] == state["torchft"]
    with pytest.raises(TypeError, match="Cannot send a object"):
        encode_state({"x": object()})


# ----------------------------------------------------------------------------- exactness over processes
@pytest.fixture(scope="module")
def one_stage(tmp_path_factory):
    """The 1-stage x 2-replica runs, in one launch of 2 processes."""
    out = tmp_path_factory.mktemp("diloco_one_stage")
    run_workers("diloco_worker.py", 2, ["one_stage", str(out)], timeout=300)
    return out


@pytest.fixture(scope="module")
def two_d(tmp_path_factory):
    """The 2-stage x 2-replica runs (rank = replica * 2 + stage), in one launch of 4 processes."""
    out = tmp_path_factory.mktemp("diloco_two_d")
    run_workers("diloco_worker.py", 4, ["two_d", str(out)], timeout=300)
    return out


@pytest.mark.parametrize("layout", ["1-stage", "2-stages-zbh1"])
def test_h1_equals_per_step_gradient_averaging(request, layout):
    """H=1, outer_lr=1, no momentum, inner SGD: the same weights as averaging gradients every
    step, and the same bytes; on 2 stages with DiLoCo under zero-bubble H1 (its held-back weight
    gradients in the pseudo-gradient) against averaging under 1F1B."""
    out, world, suffix = ((request.getfixturevalue("one_stage"), 2, "") if layout == "1-stage"
                          else (request.getfixturevalue("two_d"), 4, "-zbh1"))
    for rank in range(world):
        diloco, dp_diloco = load(out, "diloco" + suffix, rank)
        allreduce, dp_allreduce = load(out, "allreduce", rank)
        for name in allreduce:
            torch.testing.assert_close(diloco[name], allreduce[name], rtol=0, atol=1e-6, msg=name)
        assert dp_diloco["bytes_sent"] == dp_allreduce["bytes_sent"] > 0
        assert "call pipe.attach_optimizer(optimizer) once before training" in dp_diloco["unattached_error"]


@pytest.mark.parametrize("compression", ["none", "quantize8", "hadamard4", "topk_quantize2"])
def test_synced_weights_are_the_mean_and_replicas_agree_bit_for_bit(one_stage, compression):
    """H=4, outer_lr=1, no momentum: after each sync every replica holds the last synced weights
    minus the mean of the replicas' pseudo-gradients as their payloads decode (without a codec:
    the mean of the replicas' weights), to 1e-6; the replicas are equal bit for bit. A decoded
    pseudo-gradient is what the replica had to send (its pseudo-gradient plus the error carried
    in) less what it carries out. The bytes are exact: fp32 ring all-reduce, or each payload to
    the other replica."""
    (t0, info), (t1, _) = load(one_stage, f"mean-{compression}", 0), load(one_stage, f"mean-{compression}", 1)
    names = info["names"]

    def flat(t, when) -> torch.Tensor:
        return torch.cat([t[f"{when}.{n}"].reshape(-1) for n in names])

    synced, errors = flat(t0, "start"), [torch.zeros(info["numel"])] * 2
    assert torch.equal(synced, flat(t1, "start"))
    for step in (3, 7):
        for name in names:
            assert torch.equal(t0[f"after{step}.{name}"], t1[f"after{step}.{name}"]), name
        after, before = flat(t0, f"after{step}"), [flat(t, f"before{step}") for t in (t0, t1)]
        assert (before[0] - before[1]).norm() > 0.1  # the replicas had drifted apart
        if compression == "none":
            expected = (before[0] + before[1]) / 2
        else:
            carried = [t[f"error{step}"] for t in (t0, t1)]
            decoded = [synced - b + e - c for b, e, c in zip(before, errors, carried, strict=True)]
            assert all(c.abs().max() > 0 for c in carried)  # the codec lost something, carried over
            expected = synced - (decoded[0] + decoded[1]) / 2
            errors = carried
        torch.testing.assert_close(after, expected, rtol=0, atol=1e-6)
        synced = after
    syncs = 2
    if compression == "none":
        assert info["dp"]["bytes_sent"] == syncs * ring(4 * info["numel"], 2)
    else:
        assert info["dp"]["bytes_sent"] == syncs * info["payload_nbytes"]
        assert info["dp"]["bytes_uncompressed"] == syncs * ring(4 * info["numel"], 2)


def _synced_per_step(info) -> list[int | None]:
    """Per step, the fragment that synced in it (from the per-fragment sync counts), or None."""
    counts, synced = [0] * len(info["fragments"]), []
    for step in info["per_step"]:
        changed = [i for i, (a, b) in enumerate(zip(step["fragment_syncs"], counts, strict=True)) if a != b]
        assert len(changed) <= 1, info["per_step"]
        synced.append(changed[0] if changed else None)
        counts = step["fragment_syncs"]
    return synced


@pytest.mark.parametrize("compression", ["none", "quantize8"])
def test_streaming_fragments_sync_in_turn_to_the_mean(one_stage, compression):
    """Streaming DiLoCo, H=6 in 3 fragments, outer lr 1, no momentum: torchft syncs one fragment
    every H/F = 2 steps, fragment (outer step mod 3), so each every 6 steps. Right after its sync a
    fragment holds its last synced weights minus the mean of the replicas' decoded pseudo-gradients
    (without a codec: the mean of the replicas' weights), to 1e-6, bit-equal on both replicas,
    while the other fragments are untouched by the sync and still differ between the replicas.
    Each sync sends exactly that fragment's bytes."""
    (t0, info), (t1, _) = load(one_stage, f"streaming-{compression}", 0), load(one_stage, f"streaming-{compression}", 1)
    fragments = info["fragments"]
    names = [n for fragment in fragments for n in fragment]  # every trainable tensor in exactly one fragment
    assert len(fragments) == 3 and all(fragments) and sorted(names) == sorted(k[6:] for k in t0 if k.startswith("start."))
    assert _synced_per_step(info) == [None, 0, None, 1, None, 2, None, 0, None, 1, None, 2]  # after steps 2, 4, ..., 12
    assert [s["outer_step"] for s in info["per_step"]] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]

    def flat(t, when, k) -> torch.Tensor:
        return torch.cat([t[f"{when}.{n}"].reshape(-1) for n in fragments[k]])

    synced = [flat(t0, "start", k) for k in range(3)]
    errors = [[torch.zeros(n) for n in info["numel"]] for _ in range(2)]
    sent = 0
    for step, k in enumerate(_synced_per_step(info)):
        for j in range(3):
            before = [flat(t, f"before{step}", j) for t in (t0, t1)]
            after = [flat(t, f"after{step}", j) for t in (t0, t1)]
            if j != k:  # untouched by this step's sync, if any; the replicas have drifted apart
                assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]), (step, j)
                assert (after[0] - after[1]).norm() > 0.01, (step, j)
                continue
            assert torch.equal(after[0], after[1]), (step, k)
            if compression == "none":
                expected = (before[0] + before[1]) / 2
            else:
                carried = [t[f"error{step}.{k}"] for t in (t0, t1)]
                decoded = [synced[k] - b + errors[r][k] - carried[r] for r, b in enumerate(before)]
                expected = synced[k] - (decoded[0] + decoded[1]) / 2
                errors[0][k], errors[1][k] = carried
            torch.testing.assert_close(after[0], expected, rtol=0, atol=1e-6)
            synced[k] = after[0]
        if k is not None:
            sent += ring(4 * info["numel"][k], 2) if compression == "none" else info["payload_nbytes"][k]
        assert info["per_step"][step]["bytes_sent"] == sent, step


def test_streaming_sync_delay_applies_each_sync_a_step_later(one_stage):
    """fragment_sync_delay=1 (H=4, 2 fragments, outer lr 1, no momentum, fragment_update_alpha
    0.5): a fragment's pseudo-gradient is taken and sent after local step 1 of 2 and its outer step
    applied after step 2, while training went on: the synced weights (the anchor, bit-equal on
    both replicas) are the mean of the replicas' weights at the start of the sync, and the weights
    mix them with the local ones: synced + 0.5 (local - synced). Steps that start a sync change no
    weight."""
    (t0, info), (t1, _) = load(one_stage, "delayed", 0), load(one_stage, "delayed", 1)
    fragments = info["fragments"]
    assert _synced_per_step(info) == [None, 0, None, 1, None, 0, None, 1]

    def flat(t, when, k) -> torch.Tensor:
        return torch.cat([t[f"{when}.{n}"].reshape(-1) for n in fragments[k]])

    for step, k in enumerate(_synced_per_step(info)):
        for j in range(2):
            before, after = ([flat(t, f"{when}{step}", j) for t in (t0, t1)] for when in ("before", "after"))
            if j != k:
                assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]), (step, j)
                continue
            anchor = [flat(t, f"anchor{step}", k) for t in (t0, t1)]
            assert torch.equal(anchor[0], anchor[1]), step
            started = [flat(t, f"before{step - 1}", k) for t in (t0, t1)]  # the weights when the sync started
            torch.testing.assert_close(anchor[0], (started[0] + started[1]) / 2, rtol=0, atol=1e-6)
            for r in range(2):
                torch.testing.assert_close(after[r], anchor[0] + 0.5 * (before[r] - anchor[0]), rtol=0, atol=1e-6)
            assert (after[0] - after[1]).norm() > 0.01  # alpha > 0 keeps each replica's delayed steps


def test_streaming_resumes_exactly_with_a_sync_in_flight(one_stage):
    """2 fragments, H=4, fragment_sync_delay=1, int8, Nesterov: the state saved after step 3 (safetensors,
    between fragment 1's sync start and its outer step) loaded into a fresh pipeline, which
    trains steps 4..8: the same weights as the run that saved, bit for bit, on both replicas."""
    info = load(one_stage, "resumed", 0)[1]
    assert {"anchor", "weights", "momentum", "pseudo_gradient", "in_flight", "fragments"} <= set(info["saved_keys"])
    finals = []
    for rank in range(2):
        straight, resumed = load(one_stage, "resumed-straight", rank)[0], load(one_stage, "resumed-resumed", rank)[0]
        for name in straight:
            assert torch.equal(straight[name], resumed[name]), (rank, name)
        finals.append(straight)
    assert any(not torch.equal(finals[0][n], finals[1][n]) for n in finals[0])  # fragment 0 had drifted


def test_two_stages_two_replicas_stagger_with_aqsgd(two_d):
    """2 stages x 2 replicas, AQ-SGD boundaries, int8 pseudo-gradients, stagger: stage 0 syncs
    after steps 4 and 8, stage 1 after 6 and 10; each stage's replicas agree bit for bit right
    after its own syncs and differ in between; the loss falls; AQ-SGD memory is per replica."""
    results = [load(two_d, "two_d", rank) for rank in range(4)]  # rank = replica * 2 + stage
    for stage, synced, unsynced in ((0, (3, 7), (5, 9)), (1, (5, 9), (3, 7))):
        (a, info), (b, _) = results[stage], results[2 + stage]
        names = [k.split(".", 1)[1] for k in a if k.startswith("step0.")]
        for step in synced:
            assert all(torch.equal(a[f"step{step}.{n}"], b[f"step{step}.{n}"]) for n in names), (stage, step)
        for step in unsynced:
            assert not all(torch.equal(a[f"step{step}.{n}"], b[f"step{step}.{n}"]) for n in names), (stage, step)
        assert info["dp"]["bytes_sent"] == 2 * info["payload_nbytes"]
    for replica in range(2):
        info = results[2 * replica][1]
        assert info["sample_range"] == [16 * replica, 16 * (replica + 1)]
        losses = info["losses"]
        assert sum(losses[-4:]) < sum(losses[:4]), losses


def test_two_stages_stream_fragments_with_stagger(two_d):
    """2 stages x 2 replicas, H=4 in 2 fragments, stagger, fp32: stage 0 syncs a fragment after
    steps 2, 4, 6, 8 and stage 1 after 3, 5, 7, 9 (offset H/F/S = 1), fragments 0, 1, 0, 1; each
    stage's replicas agree bit for bit on the fragment just synced and differ on the other; each
    sync sends that fragment's fp32 ring all-reduce."""
    results = [load(two_d, "streaming_two_d", rank) for rank in range(4)]  # rank = replica * 2 + stage
    for stage, expected in ((0, [None, 0, None, 1, None, 0, None, 1, None]),
                            (1, [None, None, 0, None, 1, None, 0, None, 1])):
        (a, info), (b, other) = results[stage], results[2 + stage]
        assert info["fragments"] == other["fragments"] and len(info["fragments"]) == 2
        assert _synced_per_step(info) == _synced_per_step(other) == expected
        sent = 0
        for step, k in enumerate(expected):
            if k is None:
                continue
            for j, names in enumerate(info["fragments"]):
                same = all(torch.equal(a[f"step{step}.{n}"], b[f"step{step}.{n}"]) for n in names)
                assert same == (j == k), (stage, step, j)
            sent += ring(4 * info["numel"][k], 2)
            assert info["per_step"][step]["bytes_sent"] == sent, (stage, step)


# ----------------------------------------------------------------------------- a lost replica
def _launch_replica(tmp_path, replica: int, lighthouse: str, args: list[str], extra_env: dict | None = None):
    """One replica launched on its own: a 1-process job with its own port (REPLICA_GROUP_ID)."""
    import os
    import subprocess

    from distributed import WORKERS, free_port

    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", REPLICA_GROUP_ID=str(replica),
               TORCHFT_LIGHTHOUSE=lighthouse, **(extra_env or {}))
    log = open(tmp_path / f"replica{replica}-launch{len(list(tmp_path.glob(f'replica{replica}-*.log')))}.log",  # noqa: SIM115
               "w")
    return subprocess.Popen([sys.executable, os.path.join(WORKERS, "diloco_worker.py"), "fault", str(tmp_path), *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_lost_replica_does_not_stop_the_other_and_heals_when_it_comes_back(tmp_path, fragments):
    """Two replicas, each its own launch, min_replicas=1. Replica 1 is killed (SIGKILL, by pid) in
    the middle of a sync: the survivor's sync is discarded and the fragment's weights are restored
    exactly to its last sync's; it goes on alone. Replica 1 is started again from scratch: it heals
    from its peer at its first sync, after which both hold the same weights bit for bit after each
    sync they share. With 2 fragments (one syncs every step, H=2), the killed sync is fragment 0's
    second; the fragment not synced at the heal restarts from the peer's synced weights."""
    import os
    import signal
    import time

    from hf_actcomp.dp.outer import start_lighthouse

    server, lighthouse = start_lighthouse(min_replicas=1, host="127.0.0.1")
    stop_file, pid_file = tmp_path / "stop", tmp_path / "pid"
    procs = []
    deadline = time.monotonic() + 150
    args = [str(fragments)]
    try:
        survivor = _launch_replica(tmp_path, 0, lighthouse, [str(stop_file), "6", "400", *args])
        doomed = _launch_replica(tmp_path, 1, lighthouse, [str(stop_file), "6", "400", *args],
                                 {"HF_ACTCOMP_FAULT_AT": f"{1 + fragments}:1:sync",
                                  "HF_ACTCOMP_FAULT_PID_FILE": str(pid_file)})
        procs += [survivor, doomed]
        while not pid_file.exists() and time.monotonic() < deadline and doomed.poll() is None:
            time.sleep(0.1)
        assert pid_file.exists(), (tmp_path / "replica1-launch0.log").read_text()[-3000:]
        os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the process this test started
        doomed.wait(30)
        restarted = _launch_replica(tmp_path, 1, lighthouse, [str(stop_file), "8", "8", *args])  # 4 or 8 syncs
        procs.append(restarted)
        while restarted.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        stop_file.touch()
        while survivor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert restarted.returncode == 0 and survivor.returncode == 0, [
            p.read_text()[-3000:] for p in sorted(tmp_path.glob("*.log"))]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.shutdown()

    def run(replica: int, pid: int) -> dict:
        return json.loads((tmp_path / f"replica{replica}-{pid}.json").read_text())

    def weights_of(record: dict) -> dict:
        return load_file(tmp_path / f"{record['name']}.safetensors")

    kept, names = run(0, survivor.pid)["records"], run(0, survivor.pid)["fragments"]  # names: per fragment
    assert len(names) == fragments
    failed = [i for i, r in enumerate(kept) if not r["committed"]]
    assert failed and failed[0] >= 1, kept  # the sync replica 1 died in
    lost = kept[failed[0]]["fragment"]
    last = [r for r in kept[:failed[0]] if r["fragment"] == lost]  # its last (committed) sync
    assert last, kept
    before, after = weights_of(last[-1]), weights_of(kept[failed[0]])
    assert all(torch.equal(before[n], after[n]) for n in names[lost])  # restored exactly to the last sync
    mine = run(1, restarted.pid)["records"]
    healed = [r for r in mine if r["committed"]]
    alone = [r for r in kept[failed[0] + 1:] if r["committed"] and r["outer_step"] not in {h["outer_step"] for h in healed}]
    assert alone, kept  # it went on alone (here: once its healed peer had finished)
    assert healed and healed[0]["outer_step"] > 1, healed  # it joined at the survivor's step, not at 1
    together = {r["outer_step"]: r for r in kept if r["committed"]}
    pairs = [(together[r["outer_step"]], r) for r in healed if r["outer_step"] in together]
    assert pairs, (kept, healed)
    for ours, theirs in pairs:
        assert ours["fragment"] == theirs["fragment"]
        a, b = weights_of(ours), weights_of(theirs)
        assert all(torch.equal(a[n], b[n]) for n in names[ours["fragment"]]), ours["outer_step"]
    if fragments > 1:  # at the heal, the fragment not synced took the peer's synced weights
        heal = mine[0]
        assert heal["committed"], mine
        other = 1 - heal["fragment"]
        synced = [r for r in kept if r["committed"] and r["fragment"] == other and r["outer_step"] < heal["outer_step"]]
        a, b = weights_of(synced[-1]), weights_of(heal)
        assert all(torch.equal(a[n], b[n]) for n in names[other])


def test_trainer_refuses_a_replica_launch_of_the_wrong_size(tmp_path, monkeypatch):
    """A DiLoCo replica launched on its own (REPLICA_GROUP_ID) has one process per stage."""
    from trainer_cases import training_args

    from hf_actcomp.trainer.actcomp_trainer import check_arguments

    plan = Plan(num_stages=2, data_parallel=2, dp_compression={"method": "diloco"})
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    with pytest.raises(ValueError, match="launched on its own \\(REPLICA_GROUP_ID\\) needs Plan.num_stages=2 "
                                         "processes, but this job has 1"):
        check_arguments(training_args(str(tmp_path)), plan, {})
