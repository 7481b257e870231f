"""The multi-process pipeline (gloo, tiny models): exactness, agreement with simulate(), state
and failure handling. Each test launches its own worker processes with a timeout."""

import contextlib
import copy
import itertools
import json

import pytest
import torch
from distributed import run_workers
from pipeline_cases import (
    COMPRESSED_PLANS,
    EXACT_CASES,
    check_stage_grads,
    exact_runs,
    padded_batch,
    reference_loss,
    simulated_sgd_losses,
    tie_partners,
    training_batches,
)
from safetensors.torch import load_file

from hf_actcomp import Compression, simulate
from hf_actcomp.debug import debug_model
from hf_actcomp.feedback import build_codec
from hf_actcomp.pipeline import stage_actions
from hf_actcomp.pipeline.schedule import fused, step_length


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_identity_codec_matches_unsplit_model(tmp_path, num_stages):
    """Every family under 1F1B and zero-bubble H1 on 2 and 3 stages (GPipe too for a tied, an
    untied and the MoE model), zbh1 on 4 stages for those three; padding and tied embeddings:
    loss and every parameter's gradient on every stage equal the unsplit model's, and so does
    eval_step's loss. eval_step's bytes, router statistics included, all count as `evaluation`."""
    run_workers("pipeline_worker.py", num_stages, ["exact", str(tmp_path), str(num_stages)], timeout=400)
    runs = exact_runs(num_stages)
    for case in dict.fromkeys(case for case, _ in runs):
        family, overrides = EXACT_CASES[case]
        reference = debug_model(family, seed=0, **overrides)
        batch = padded_batch(reference.config.vocab_size)
        loss = reference_loss(reference, batch, micro_batches=num_stages)
        loss.backward()
        ref_grads = dict(reference.named_parameters(remove_duplicate=False))
        partners = tie_partners(reference)
        for schedule in (s for c, s in runs if c == case):
            seen = set()
            for rank in range(num_stages):
                got = load_file(tmp_path / f"{case}-{schedule}-rank{rank}.safetensors")
                torch.testing.assert_close(got["loss"][0], loss.detach(), atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(got["eval_loss"][0], loss.detach(), atol=1e-6, rtol=1e-6)
                assert int(got["eval_step_router_bytes"][0]) == 0
                assert int(got["eval_step_evaluation_bytes"][0]) == eval_bytes(reference, batch, rank, num_stages)
                check_stage_grads(got, ref_grads, partners, f"{case}/{schedule}", seen)
            assert seen == set(ref_grads), f"{case}: parameters missing on every stage: {set(ref_grads) - seen}"


def eval_bytes(model, batch, rank: int, num_stages: int) -> int:
    """What eval_step sends from `rank` with the identity codec: fp32 activations (and, with
    router logits, 2E+1 floats of statistics per micro-batch) forward; the tied embedding's
    owner (the last stage) sends the batch's distinct rows."""
    hidden = model.config.hidden_size
    if rank == num_stages - 1:
        return torch.unique(batch["input_ids"]).numel() * hidden * 4 if tie_partners(model) else 0
    side = 2 * model.config.num_local_experts + 1 if getattr(model.config, "output_router_logits", False) else 0
    return batch["input_ids"].numel() * hidden * 4 + num_stages * side * 4  # micro_batches = num_stages


@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_accumulated_steps_and_adamw_match_unsplit_model_with_tied_embeddings(tmp_path, family, num_stages):
    """k train_steps without zero_grad equal k backward passes of the unsplit model, for every
    parameter (the tied embedding's gradient is 2x, not 3x, after two steps); so do two steps
    under zbh1 with num_items_in_batch (weight gradients deferred, then accumulated); after AdamW steps
    with clipping, every stage's weights equal the unsplit model's and the first stage's rows of
    the tied embedding equal the owner's. The tie moves rows, not the vocab x hidden table."""
    run_workers("pipeline_worker.py", num_stages, ["accumulate", str(tmp_path), family], timeout=300)
    for k in (1, 2, 3):
        reference = debug_model(family, seed=0)
        for step in range(k):
            batch = padded_batch(reference.config.vocab_size, seed=step)
            reference(**{kk: v for kk, v in batch.items() if kk != "sample_id"}).loss.backward()
        ref_grads = dict(reference.named_parameters(remove_duplicate=False))
        partners = tie_partners(reference)
        assert partners, f"{family}: the debug model should tie its embeddings"
        seen = set()
        tie_bytes = 0
        for rank in range(num_stages):
            got = load_file(tmp_path / f"{family}-k{k}-rank{rank}.safetensors")
            check_stage_grads(got, ref_grads, partners, f"{family}/k={k}", seen)
            tie_bytes += int(got["tie_bytes"][0])
        assert seen == set(ref_grads)
        rows = sum(torch.unique(padded_batch(reference.config.vocab_size, seed=s)["input_ids"]).numel()
                   for s in range(k))
        hidden = reference.config.hidden_size
        assert tie_bytes == 2 * rows * hidden * 4  # rows there, gradient rows back, fp32

    # num_items_in_batch over two accumulated steps: the loss and gradients of the model given it.
    reference = debug_model(family, seed=0)
    batches = [padded_batch(reference.config.vocab_size, seed=step) for step in range(2)]
    num_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    losses = []
    for b in batches:
        loss = reference(**{kk: v for kk, v in b.items() if kk != "sample_id"}, num_items_in_batch=num_items).loss
        loss.backward()
        losses.append(loss.detach())
    seen = set()
    for rank in range(num_stages):
        got = load_file(tmp_path / f"{family}-items-rank{rank}.safetensors")
        torch.testing.assert_close(got["losses"], torch.stack(losses), atol=1e-6, rtol=1e-5)
        check_stage_grads(got, dict(reference.named_parameters(remove_duplicate=False)), partners,
                          f"{family}/num_items", seen)
    assert seen == set(ref_grads)

    reference = debug_model(family, seed=0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        optimizer.zero_grad()
        batch = padded_batch(reference.config.vocab_size, seed=10 + step)
        reference(**{kk: v for kk, v in batch.items() if kk != "sample_id"}).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
    params = dict(reference.named_parameters(remove_duplicate=False))
    # Adam divides by sqrt(v): where a gradient is ~0, float32 summation-order noise (micro-batches,
    # stages) moves the update by a few 1e-5 after 3 steps of lr=1e-2; a wrong tie moves it by ~lr.
    close = dict(atol=1e-4, rtol=1e-3)
    eval_rows = torch.unique(padded_batch(reference.config.vocab_size, seed=0)["input_ids"])
    for rank in range(num_stages):
        got = load_file(tmp_path / f"{family}-adamw-rank{rank}.safetensors")
        for key, value in got.items():
            name = key[len("param."):]
            if rank == 0 and name in partners:  # the first stage's copy: current on the rows it reads
                torch.testing.assert_close(value[eval_rows], params[name].detach()[eval_rows], **close)
                last = load_file(tmp_path / f"{family}-adamw-rank{num_stages - 1}.safetensors")
                assert torch.equal(value[eval_rows], last[f"param.{partners[name]}"][eval_rows])
            else:
                torch.testing.assert_close(value, params[name].detach(), **close, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("plan_name, schedule", [("aqsgd", "1f1b"), ("topk_ef", "zbh1"), ("aqsgd", "zbh1"),
                                                ("aqsgd_refresh", "1f1b"), ("aqsgd_drift", "1f1b")])
def test_compressed_run_matches_simulation(tmp_path, plan_name, schedule):
    """Same plan, seed and batches: the 2-process run gives simulate()'s losses; sender and
    receiver AQ-SGD memories stay identical after every step (zbh1 too: its input gradients
    run in 1F1B's micro-batch order, so error feedback sees the same sequence). `aqsgd_refresh`:
    revisits that reuse the memory send no message at all, and the ranks stay in step.
    `aqsgd_drift`: the sender's drift record stays on its rank, and the payloads are the first
    visits' 4-bit codes, then rank-2 factors."""
    steps = 10 if plan_name == "aqsgd_refresh" else 6
    run_workers("pipeline_worker.py", 2, ["compressed", str(tmp_path), plan_name, str(steps), schedule])
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result == json.loads((tmp_path / "rank1.json").read_text()) | {"stats": result["stats"]}

    model = debug_model("gpt2", seed=0)
    sim = simulate(model, COMPRESSED_PLANS[plan_name]("1f1b"))
    expected = simulated_sgd_losses(sim, steps)
    assert result["losses"] == pytest.approx(expected, rel=1e-4)
    assert result["losses"][-1] < result["losses"][0]
    sim.eval()  # evaluation: the stateless inference codec on both sides
    with torch.no_grad():
        assert result["eval_loss"] == pytest.approx(sim(**padded_batch(model.config.vocab_size)).loss.item(), rel=1e-4)

    if plan_name.startswith("aqsgd"):
        for sums in result["checksums"]:
            assert sums["boundary0.sender"] == sums["boundary0.receiver"] != 0.0
            if plan_name == "aqsgd":
                assert sums["tie.copy"] == sums["tie.mirror"] != 0.0  # what the first stage holds, on both ends
    if plan_name == "aqsgd_refresh":  # 4 steps of first visits (fp32), 4 reusing, 2 of 4-bit deltas
        hidden, rows = model.config.hidden_size, (2, 16, model.config.hidden_size)
        deltas = 2 * 2 * build_codec(Compression("quantize", bits=4)).payload_nbytes(rows, torch.float32)
        assert result["stats"]["channels"]["boundary0.forward"]["bytes_sent"] == 4 * 4 * 16 * hidden * 4 + deltas
    if plan_name == "aqsgd_drift":  # 4 steps of 4-bit first visits, 2 of rank-2 factors, 2 micro-batches each
        rows = (2, 16, model.config.hidden_size)
        first = build_codec(Compression("quantize", bits=4)).payload_nbytes(rows, torch.float32)
        assert result["stats"]["channels"]["boundary0.forward"]["bytes_sent"] == 4 * 2 * first + 2 * 2 * 2 * 2 * (32 + rows[2])
    stats, sim_stats = result["stats"], sim.stats()
    for channel in ("boundary0.forward", "boundary0.backward"):
        assert stats["channels"][channel]["bytes_sent"] == sim_stats["channels"][channel]["bytes_sent"]
        assert stats["relative_error"][channel] == pytest.approx(sim_stats["relative_error"][channel], rel=1e-3)
    categories = stats["categories"]
    boundary = [categories["activations"], categories["activation_gradients"]]
    assert sum(c["bytes_uncompressed"] for c in boundary) / sum(c["bytes_sent"] for c in boundary) > 2
    # Every byte between the ranks is counted: rows of the tied embedding there and back (fp32, or
    # the plan's tie codec), per step the loss broadcast (4 bytes) and the clip-norm all-reduce (4
    # bytes from each rank).
    hidden = model.config.hidden_size
    rows = [torch.unique(b["input_ids"]).numel() for b in training_batches(model.config.vocab_size, steps)]
    tie = COMPRESSED_PLANS[plan_name]("1f1b").tie_compression
    tie_bytes = sum(2 * (build_codec(tie).payload_nbytes((r, hidden), torch.float32) if tie else r * hidden * 4)
                    for r in rows)
    assert categories["tie"]["bytes_sent"] == tie_bytes
    assert categories["tie"]["bytes_uncompressed"] == 2 * sum(rows) * hidden * 4
    assert sim_stats["categories"].get("tie", categories["tie"])["bytes_sent"] == tie_bytes
    assert categories["collectives"]["bytes_sent"] == steps * (4 + 2 * 4)
    assert stats["bytes_sent"] == sum(c["bytes_sent"] for c in categories.values())
    assert stats["compression_ratio"] == pytest.approx(
        sum(c["bytes_uncompressed"] for c in categories.values()) / stats["bytes_sent"])
    assert set(stats["stages"]) == {"0", "1"}
    for timing in stats["stages"].values():
        assert timing["steps"] == steps and 0 <= timing["seconds_waiting"] <= timing["seconds_step"]


def test_resume_equals_uninterrupted(tmp_path):
    """2 steps, save model + compression state, new processes, load, 2 steps == 4 steps."""
    run_workers("pipeline_worker.py", 2, ["resume", str(tmp_path), "full"])
    run_workers("pipeline_worker.py", 2, ["resume", str(tmp_path), "first"])
    shards = sorted(p.name for p in (tmp_path / "ckpt" / "actcomp_state").glob("*.safetensors"))
    assert any("-of-" in name for name in shards), shards  # small max_shard_size: sharded
    run_workers("pipeline_worker.py", 2, ["resume", str(tmp_path), "second"])
    for rank in range(2):
        full = load_file(tmp_path / f"full-rank{rank}.safetensors")
        second = load_file(tmp_path / f"second-rank{rank}.safetensors")
        assert full.keys() == second.keys()
        for key in full:
            if rank == 0 and key == "param.transformer.wte.weight":
                # The first stage's copy of the tied embedding: only the rows of each batch are
                # current (sent by the owner, the last stage, whose copy is compared on rank 1).
                continue
            torch.testing.assert_close(second[key], full[key], atol=1e-6, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
        full_losses = json.loads((tmp_path / f"full-rank{rank}.json").read_text())["losses"]
        second_losses = json.loads((tmp_path / f"second-rank{rank}.json").read_text())["losses"]
        assert second_losses == pytest.approx(full_losses[2:], rel=1e-6)


def test_dead_peer_fails_fast_with_a_clear_error(tmp_path):
    results = run_workers("pipeline_worker.py", 2, ["dead_peer", str(tmp_path)], timeout=120, check=False)
    assert [r.returncode for r in results] == [4, 3]
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert "with rank 1" in report["error"] and "dead, hung or slower than the timeout" in report["error"]
    assert report["seconds"] < 30


def test_bf16_autocast(tmp_path):
    run_workers("pipeline_worker.py", 2, ["autocast", str(tmp_path)])
    reference = debug_model("gpt2", seed=0)
    batch = padded_batch(reference.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(**{k: v for k, v in batch.items() if k != "sample_id"}).loss.item()
    elements = batch["input_ids"].numel() * reference.config.hidden_size
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["loss"] == pytest.approx(expected, rel=2e-2)
        assert report["matmul_dtypes"] == ["torch.bfloat16"]  # the stages compute in bf16
        for channel in ("boundary0.forward", "boundary0.backward"):  # and send bf16: 2 bytes a value
            assert report["channels"][channel]["bytes_sent"] == report["channels"][channel]["bytes_uncompressed"] \
                == 2 * elements


def test_accelerate_save_state_carries_every_ranks_compression_state(tmp_path):
    run_workers("pipeline_worker.py", 2, ["accelerate_state", str(tmp_path)])
    assert sorted(p.name for p in (tmp_path / "state" / "actcomp_state").glob("*.json")) == ["rank0.json", "rank1.json"]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["changed"] and report["restored"]
    keys = [json.loads((tmp_path / f"rank{r}.json").read_text())["keys"] for r in range(2)]
    assert any(k.startswith("boundary0.forward.sender.mirror.memory.") for k in keys[0])
    assert any(k.startswith("boundary0.forward.receiver.memory.") for k in keys[1])


def test_pipeline_x_data_parallel_matches_unsplit_model_on_the_full_batch(tmp_path):
    """2 stages x 2 replicas on 4 processes, no compression: every stage's gradients equal the
    unsplit single-process model's on the concatenated batch (with unequal token counts)."""
    run_workers("pipeline_worker.py", 4, ["two_d", str(tmp_path), "allreduce"], timeout=300)
    reference = debug_model("gpt2", seed=0)
    full = padded_batch(reference.config.vocab_size, batch=8)
    full["attention_mask"][4, -7:] = 0
    full["labels"][4, -7:] = -100
    loss = reference(**{k: v for k, v in full.items() if k != "sample_id"}).loss
    loss.backward()
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for rank in range(4):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        torch.testing.assert_close(got["loss"][0], loss.detach(), atol=1e-6, rtol=1e-6)
        check_stage_grads(got, ref, tie_partners(reference), f"rank {rank}", set())
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (report["replica"], report["stage"]) == (rank // 2, rank % 2)
        assert report["losses"][-1] < report["losses"][0]

    # Gradient accumulation across replicas: two steps under no_sync() + one sync, normalised by
    # the tokens of both global batches == the unsplit model on both batches with that count.
    reference = debug_model("gpt2", seed=0)
    second = padded_batch(reference.config.vocab_size, batch=8, seed=1)
    num_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in (full, second))
    for b in (full, second):
        reference(**{k: v for k, v in b.items() if k != "sample_id"}, num_items_in_batch=num_items).loss.backward()
    ref = dict(reference.named_parameters(remove_duplicate=False))
    seen = set()
    for rank in range(4):
        got = load_file(tmp_path / f"accumulated-rank{rank}.safetensors")
        check_stage_grads(got, ref, tie_partners(reference), f"accumulated rank {rank}", seen)
    assert seen == set(ref)


@pytest.mark.parametrize("hook", ["topk", "powersgd"])
def test_pipeline_x_data_parallel_with_a_compressed_hook(tmp_path, hook):
    """TopK (ours) or PowerSGD (torch's hook, handed each step's gradients as one flat bucket) on
    the data-parallel gradients and AQ-SGD on the boundary: each replica keeps AQ-SGD memory for
    its own shard's 4 sample ids only, and refuses the other shard's ids."""
    run_workers("pipeline_worker.py", 4, ["two_d", str(tmp_path), hook], timeout=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert reports[0]["losses"] == reports[1]["losses"]  # one value per pipeline, on every stage
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]
    for r in reports:
        start = 4 * r["replica"]
        assert r["sample_range"] == list(range(start, start + 4)) and r["memory_rows"] == 4
        other = 4 - start
        assert r["wrong_shard"] == (
            f"sample_id {other if other < start else other + 3} is outside this data-parallel replica's shard "
            f"[{start}, {start + 4}): each replica keeps AQ-SGD memory for its contiguous shard of the data set "
            "only. Shard with Pipeline.shard_dataset(dataset) after add_sample_ids (ActCompTrainer does both).")
    for r in reports:
        assert r["dp"]["hook"] == hook and r["dp"]["steps"] == 6
        # topk sends a tenth; PowerSGD: 2 uncompressed steps, then rank-2 factors of every matrix
        assert r["dp"]["compression_ratio"] > (2 if hook == "topk" else 1.5), r["dp"]
    # A lossy hook must not let copies drift: the replicas' copies of every stage stay bitwise
    # equal, and the rows of the tied embedding the first stages read equal the owner's (last stage).
    params = [load_file(tmp_path / f"params-rank{r}.safetensors") for r in range(4)]
    for stage in (0, 1):
        one, other = params[stage], params[2 + stage]
        for key in one:
            if key not in ("rows", "param.transformer.wte.weight"):
                assert torch.equal(one[key], other[key]), f"stage {stage}: {key} differs between replicas"
    for replica in (0, 1):
        first, last = params[2 * replica], params[2 * replica + 1]
        rows = first["rows"]
        assert torch.equal(first["param.transformer.wte.weight"][rows], last["param.lm_head.weight"][rows])


def test_world_size_must_match_the_plan(tmp_path):
    run_workers("pipeline_worker.py", 2, ["bad_world", str(tmp_path)], timeout=120)
    for rank in range(2):
        error = json.loads((tmp_path / f"rank{rank}.json").read_text())["error"]
        assert "Plan.num_stages=3 x data_parallel=1 needs exactly 3 processes (one per stage and replica), " \
            "but the world size is 2" in error


def replay(actions: list[list[tuple[str, int]]]) -> int:
    """Run all stages' actions with blocking receives and non-blocking sends, as the executor
    does, in time units: a forward 1; a `B` right before its own `W` is one backward pass of 2
    units whose input gradient leaves at its end; a split `B` and `W` 1 each. Returns the step's
    length; fails on a deadlock or an action before what it needs."""
    num_stages = len(actions)
    finished, clock, pos = {}, [0] * num_stages, [0] * num_stages
    while any(pos[s] < len(actions[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            while pos[s] < len(actions[s]):
                kind, i = actions[s][pos[s]]
                whole = kind == "B" and pos[s] + 1 < len(actions[s]) and actions[s][pos[s] + 1] == ("W", i)
                needs = {"F": [("F", s - 1, i)] if s else [],
                         "B": [("F", s, i)] + ([("B", s + 1, i)] if s < num_stages - 1 else []),
                         "W": [("B", s, i)]}[kind]
                if any(n not in finished for n in needs):
                    break
                cost = 2 if whole else 1  # B and W as one pass, else 1 each
                clock[s] = max([clock[s]] + [finished[n] for n in needs]) + cost
                finished[(kind, s, i)] = clock[s]
                if whole:
                    finished[("W", s, i)] = clock[s]
                    pos[s] += 1
                pos[s] += 1
                progressed = True
        assert progressed, f"deadlock at {pos}"
    return max(clock)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1"])
@pytest.mark.parametrize("num_stages, micro_batches", [(2, 2), (3, 4), (4, 4), (4, 7), (4, 8)])
def test_schedules_run_each_micro_batch_once_in_dependency_order(schedule, num_stages, micro_batches):
    """Replay all stages' actions: no deadlock, each micro-batch's F, B and W once and in order,
    forwards and input gradients in micro-batch order on every stage (the messages' order); at
    most S - s micro-batches in flight under 1F1B and at most S (1F1B's peak) under zbh1, whose
    step is shorter than 1F1B's where 1F1B has a drain to fill."""
    actions = [stage_actions(schedule, s, num_stages, micro_batches) for s in range(num_stages)]
    length = replay(actions)
    for s in range(num_stages):
        assert sorted(actions[s]) == sorted((kind, i) for kind in "FBW" for i in range(micro_batches))
        for kind in "FB":
            assert [i for k, i in actions[s] if k == kind] == list(range(micro_batches))
        in_flight = peak = 0
        for kind, _ in actions[s]:
            in_flight += {"F": 1, "B": 0, "W": -1}[kind]
            peak = max(peak, in_flight)
        assert peak <= {"gpipe": micro_batches, "1f1b": num_stages - s, "zbh1": num_stages}[schedule]
    if schedule == "zbh1":
        one_f_one_b = replay([stage_actions("1f1b", s, num_stages, micro_batches) for s in range(num_stages)])
        assert length < one_f_one_b  # e.g. 2 x 4: 13 time units against 15
    # GPipe and 1F1B run each backward as one pass; zbh1 splits some (the executor sees `B` and `W`)
    kinds = {kind for stage in actions for kind, _ in fused(stage)}
    assert kinds == ({"F", "B", "W", "BW"} & kinds if schedule == "zbh1" else {"F", "BW"})
    assert schedule != "zbh1" or "W" in kinds


def test_zbh1_reaches_the_bound_of_any_synchronous_schedule():
    """Unit-time F, B and W (a whole backward 2): the last stage waits for S - 1 forwards before
    its 3M units of work, so no synchronous schedule is shorter than 3M + S - 1; ZB-H1 reaches it
    for every M >= S (on 2 stages the paper's (p - 1)(F + B - W) bubble), and is never longer than
    1F1B, whose step is 3M + 3(S - 1) (each fill and drain hop waits for a forward and a whole
    backward)."""
    for num_stages in range(1, 6):
        for micro_batches in range(1, 3 * num_stages + 2):
            actions = [stage_actions("zbh1", s, num_stages, micro_batches) for s in range(num_stages)]
            baseline = [stage_actions("1f1b", s, num_stages, micro_batches) for s in range(num_stages)]
            assert step_length(actions) == replay(actions) <= replay(baseline), (num_stages, micro_batches)
            if micro_batches >= num_stages:
                assert replay(actions) == 3 * micro_batches + num_stages - 1, (num_stages, micro_batches)
                assert replay(baseline) == step_length(baseline) == 3 * micro_batches + 3 * (num_stages - 1)


def _stage_orders(micro_batches: int) -> list[list[tuple[str, int]]]:
    """Every order of one stage's actions that the executor can run: forwards and input
    gradients in micro-batch order (the order of the messages on each link), each micro-batch's
    `F` before its `B` before its `W`, a `W` anywhere after its `B`."""
    out = []

    def extend(order, forwards, backwards, weights):
        if len(order) == 3 * micro_batches:
            out.append(order)
            return
        if forwards < micro_batches:
            extend([*order, ("F", forwards)], forwards + 1, backwards, weights)
        if backwards < forwards:
            extend([*order, ("B", backwards)], forwards, backwards + 1, weights)
        for i in range(backwards):
            if i not in weights:
                extend([*order, ("W", i)], forwards, backwards, weights | {i})

    extend([], 0, 0, frozenset())
    return out


@pytest.mark.parametrize("num_stages, micro_batches", [(1, 3), (2, 2), (2, 3), (3, 2)])
def test_no_order_of_a_small_step_is_shorter_than_zbh1(num_stages, micro_batches):
    """Brute force, not a formula: every combination of every stage's runnable orders (11,236 at
    2 x 3), replayed in unit time; the shortest that does not deadlock is zbh1's length, and
    shorter than 1F1B's wherever 1F1B has a bubble to fill."""
    lengths = []
    for combination in itertools.product(_stage_orders(micro_batches), repeat=num_stages):
        try:
            lengths.append(replay(list(combination)))
        except AssertionError:  # a deadlock
            continue
    zbh1 = replay([stage_actions("zbh1", s, num_stages, micro_batches) for s in range(num_stages)])
    one_f_one_b = replay([stage_actions("1f1b", s, num_stages, micro_batches) for s in range(num_stages)])
    assert min(lengths) == zbh1
    assert num_stages == 1 or zbh1 < one_f_one_b


def test_prepare_without_distributed_is_a_clear_error():
    import hf_actcomp

    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialised"):
        hf_actcomp.prepare(debug_model("gpt2"), hf_actcomp.Plan(num_stages=2))


def test_a_bare_cuda_device_means_the_current_one(monkeypatch):
    """`prepare(device="cuda")` crashed in torch.cuda.set_device (it needs an index), seen on a
    GPU: the stage takes the current CUDA device, as torch reads a bare "cuda"."""
    from hf_actcomp.pipeline import construction

    made_current = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    assert construction.stage_device("cuda") == torch.device("cuda", 3)
    assert construction.stage_device("cuda:1") == torch.device("cuda", 1)
    assert made_current == [torch.device("cuda", 3), torch.device("cuda", 1)]
    assert construction.stage_device("cpu") == torch.device("cpu") and len(made_current) == 2




def test_frozen_parameters_tie_eval_mode_fp16_and_equal_shards(tmp_path):
    """2 stages x 2 replicas with the tied embedding and block 0 frozen: frozen parameters get no
    gradient and are neither exchanged (no tie bytes) nor averaged (the DP hook moves exactly the
    trainable gradients); eval_step restores the mode it found; fp16 autocast is refused with a
    pointer to bf16; replicas get equal, disjoint shards."""
    run_workers("pipeline_worker.py", 4, ["gradient_rules", str(tmp_path)], timeout=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in reports:
        assert "autocast_dtype=torch.float16 needs loss scaling" in r["fp16_error"] and "bfloat16" in r["fp16_error"]
        assert r["frozen"] and r["no_grad"] == r["frozen"]
        assert r["categories"]["tie"]["bytes_sent"] == 0
        ring = 2 * (2 - 1) * r["trainable_numel"] * 4 // 2  # ring all-reduce of fp32 gradients, 2 workers
        assert r["categories"]["data_parallel"]["bytes_sent"] == 2 * ring  # two optimizer steps
        assert r["modes_after_eval"] == [True, False]
        assert r["norm"] == reports[0]["norm"]
    assert reports[0]["shard"] == reports[1]["shard"] == [0, 1, 2, 3]
    assert reports[2]["shard"] == reports[3]["shard"] == [4, 5, 6, 7]


def test_hung_peer_times_out_when_waiting_or_polling(tmp_path):
    run_workers("pipeline_worker.py", 2, ["hung_peer", str(tmp_path)], timeout=120)
    for name in ("poll0", "poll1", "early"):
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert "Rank 0 failed receiving a message that never comes (16 bytes) with rank 1 (timeout 2s)" in report["error"]
        assert 1.5 < report["seconds"] < 10 and report["waiting"] >= 1.5


@pytest.mark.parametrize("layer_type", ["linear", "conv1d", "linear_no_bias", "lora", "checkpointed"])
@pytest.mark.parametrize("autocast", [False, True])
def test_held_back_weight_gradients_equal_one_backward(layer_type, autocast):
    """zbh1's `B` / `W` split: within `deferring`, the routed layers give the input gradient (and
    the untouched layers, here a LayerNorm, their weights' gradient) and hold back their weight
    and bias gradients, which `compute` then accumulates onto the ones already there; the result
    equals one plain backward for every parameter (plain tensors, holding no graph), under bf16
    autocast and activation checkpointing too (whose recomputed saved tensors are detached
    copies: the gradient must still land on the parameter). Frozen weights (a LoRA base layer)
    are not routed; `keep_weight_gradients` restores the class's forward."""
    from transformers.pytorch_utils import Conv1D

    from hf_actcomp.pipeline.split_backward import (
        WeightGradients,
        defer_weight_gradients,
        keep_weight_gradients,
    )

    torch.manual_seed(0)
    first = {"linear": lambda: torch.nn.Linear(8, 16), "checkpointed": lambda: torch.nn.Linear(8, 16),
             "conv1d": lambda: Conv1D(16, 8),
             "linear_no_bias": lambda: torch.nn.Linear(8, 16, bias=False),
             "lora": lambda: torch.nn.Linear(8, 16)}[layer_type]()
    layers = torch.nn.Sequential(first, torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    if layer_type == "lora":  # a frozen layer beside a trainable low-rank pair, as peft builds it
        first.weight.requires_grad_(False)
        first.bias.requires_grad_(False)
    plain = copy.deepcopy(layers)
    store = WeightGradients()
    assert defer_weight_gradients(layers, store) == (1 if layer_type == "lora" else 2)
    x = torch.randn(2, 5, 8)
    grad = torch.randn(2, 5, 4)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    results = []
    for model, split in ((plain, False), (layers, True)):
        for step in range(2):  # the second backward accumulates onto the first one's gradients
            inp = x.clone().requires_grad_(True)
            with context, store.routed() if split else contextlib.nullcontext():
                if layer_type == "checkpointed":
                    out = torch.utils.checkpoint.checkpoint(model, inp, use_reentrant=False)
                else:
                    out = model(inp)
            if split:
                with store.deferring(step):
                    out.backward(grad.to(out.dtype))
                if step == 0:
                    assert model[3].weight.grad is None  # routed: held back until `compute`
                assert model[2].weight.grad is not None  # not routed: its gradient comes in `B`
                store.compute(step)
            else:
                out.backward(grad.to(out.dtype))
        results.append([inp.grad] + [p.grad for p in model.parameters()])
    assert not store.pending
    for got, want in zip(results[1], results[0], strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, **({"atol": 1e-2, "rtol": 1e-2} if autocast else {}))
            # Plain tensors, as autograd leaves them: a `W` recorded under autograd would chain every
            # micro-batch's layer inputs and output gradients onto `.grad` until `zero_grad`.
            assert got.grad_fn is None and not got.requires_grad
    # Outside `routed`, the patched layers run their class's forward: autograd's own gradients, at once.
    layers.zero_grad()
    layers(x).backward(grad)
    assert layers[3].weight.grad is not None and not store.pending
    keep_weight_gradients(layers)
    assert not any("forward" in vars(m) for m in layers.modules())


def test_weight_gradients_free_what_they_held():
    """After a micro-batch's `W`, nothing keeps its layer inputs or output gradients alive (a
    `W` recorded under autograd kept them in `.grad`'s graph until `zero_grad`): zbh1's memory
    is bounded by the micro-batches in flight, not by the step's."""
    import weakref

    from hf_actcomp.pipeline.split_backward import WeightGradients, defer_weight_gradients

    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    store = WeightGradients()
    defer_weight_gradients(layers, store)
    held = []
    for step in range(3):  # accumulating, no zero_grad between them
        inp = torch.randn(2, 5, 8, requires_grad=True)
        with store.routed():
            out = layers(inp)
        with store.deferring(step):
            out.sum().backward()
        for work in store.pending[step]:
            held += [weakref.ref(work.__self__.x), weakref.ref(work.__self__.grad_2d)]
        del work
        store.compute(step)
        del inp, out
    assert len(held) == 12 and all(ref() is None for ref in held)


def test_compiled_blocks_keep_their_own_weight_gradients():
    """Layers inside a `torch.compile`d block are not routed (a Python side effect in their
    backward would break the compiled graph); the others are. Nothing is compiled here:
    `nn.Module.compile` compiles at the first call."""
    from hf_actcomp.pipeline.split_backward import WeightGradients, defer_weight_gradients

    stage = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
                                torch.nn.Linear(4, 4))
    stage[0].compile()
    assert defer_weight_gradients(stage, WeightGradients()) == 1
    assert "forward" in vars(stage[1]) and not any("forward" in vars(m) for m in stage[0].modules())
