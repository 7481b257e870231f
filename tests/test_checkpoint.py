"""Per-rank compression state files: round trip, sharding, and refusal of another plan's state."""

import pytest
import torch

from hf_actcomp import Compression, MemoryConfig, Plan
from hf_actcomp.state.compression import load_state, save_state


def metadata(plan: Plan, stage: int = 0, world_size: int = 2, blocks=(0, 2)) -> dict:
    return {"plan": plan.to_dict(), "world_size": world_size, "stage": stage, "blocks": list(blocks)}


PLAN = Plan(num_stages=2, forward=Compression("aqsgd", bits=4), memory=MemoryConfig(num_samples=8))


def test_round_trip_and_sharding(tmp_path):
    state = {"memory.values": torch.randn(8, 4, 16), "memory.seen": torch.ones(8, dtype=torch.bool),
             "codec.calls": torch.tensor(3)}
    files = save_state(tmp_path, 1, state, metadata(PLAN, stage=1), max_shard_size=1024)
    assert len(files) > 1 and all(f.startswith("rank1-") for f in files)
    loaded = load_state(tmp_path, 1, metadata(PLAN, stage=1))
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(loaded[key], value)


@pytest.mark.parametrize("change, message", [
    (dict(plan=Plan(num_stages=2, forward=Compression("aqsgd", bits=2), memory=MemoryConfig(num_samples=8))),
     "plan.forward: saved"),
    (dict(plan=Plan(num_stages=2, forward=Compression("aqsgd", bits=4), memory=MemoryConfig(num_samples=9))),
     "plan.memory: saved"),
    (dict(world_size=4), "world_size: saved 2, running 4"),
    (dict(blocks=(0, 3)), "blocks: saved [0, 2], running [0, 3]"),
])
def test_state_from_another_plan_is_refused(tmp_path, change, message):
    save_state(tmp_path, 0, {"x": torch.zeros(2)}, metadata(PLAN))
    expected = metadata(change.get("plan", PLAN), world_size=change.get("world_size", 2),
                        blocks=change.get("blocks", (0, 2)))
    with pytest.raises(ValueError, match="saved under another plan or layout") as err:
        load_state(tmp_path, 0, expected)
    assert message in str(err.value)


def test_missing_rank_is_a_clear_error(tmp_path):
    save_state(tmp_path, 0, {"x": torch.zeros(2)}, metadata(PLAN))
    with pytest.raises(FileNotFoundError, match="No compression state for rank 1"):
        load_state(tmp_path, 1, metadata(PLAN, stage=1))



def test_pipeline_checkpoint_hooks_read_the_state_when_they_run(tmp_path):
    """`Pipeline.register_for_checkpointing`: Accelerate's save/load hooks go through the
    pipeline's own save/load at the time they run, so a compression state replaced after
    registering (a Plan.auto switch rebuilds it) is the one saved and loaded."""
    from types import SimpleNamespace

    from hf_actcomp.pipeline.engine import Pipeline

    calls, hooks = [], {}
    pipe = SimpleNamespace(save_compression_state=lambda d: calls.append(("save", d)),
                           load_compression_state=lambda d: calls.append(("load", d)))
    accelerator = SimpleNamespace(register_save_state_pre_hook=lambda h: hooks.update(save=h),
                                  register_load_state_pre_hook=lambda h: hooks.update(load=h))
    Pipeline.register_for_checkpointing(pipe, accelerator)
    pipe.save_compression_state = lambda d: calls.append(("save after the switch", d))
    hooks["save"]([], [], str(tmp_path))
    hooks["load"]([], str(tmp_path))
    assert calls == [("save after the switch", str(tmp_path / "actcomp_state")),
                     ("load", str(tmp_path / "actcomp_state"))]


def test_counters_go_on_from_a_saved_state(tmp_path):
    """The byte and error counters are part of the compression state: a simulation that loads a
    saved state reports the saved totals and adds to them (as the run that never stopped); a state
    without counters (an older checkpoint) loads and counts from zero."""
    from pipeline_cases import training_batches

    from hf_actcomp import simulate
    from hf_actcomp.debug import debug_model

    plan = Plan(num_stages=2, micro_batches=2, forward=Compression("aqsgd", bits=4),
                backward=Compression("quantize", bits=8), memory=MemoryConfig(num_samples=16))

    def run(sim, batches):
        for batch in batches:
            sim(**batch).loss.backward()
        return sim.stats()

    batches = list(training_batches(256, 6))
    straight = simulate(debug_model("gpt2", seed=0, vocab_size=256), plan)
    saved = run(straight, batches[:4])
    straight.save_compression_state(tmp_path / "state")
    expected = run(straight, batches[4:])
    resumed = simulate(debug_model("gpt2", seed=0, vocab_size=256), plan)
    resumed.load_compression_state(tmp_path / "state")
    assert resumed.stats()["bytes_sent"] == saved["bytes_sent"] > 0
    got = run(resumed, batches[4:])
    for key in ("bytes_sent", "bytes_uncompressed", "compression_ratio"):
        assert got[key] == expected[key], key
    assert got["relative_error"] == pytest.approx(expected["relative_error"], rel=1e-6)
    old = {k: v for k, v in straight.compression_state_dict().items() if not k.startswith("counters.")}
    fresh = simulate(debug_model("gpt2", seed=0, vocab_size=256), plan)
    fresh.load_compression_state_dict(old)
    assert fresh.stats()["bytes_sent"] == 0
