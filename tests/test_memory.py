import os

import pytest
import torch

from hf_actcomp import MemoryConfig
from hf_actcomp.aqsgd_memory import MemoryStore, check_sample_ids


@pytest.mark.parametrize("store", ["device", "host", "mmap"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8"])
def test_store_round_trip(tmp_path, store, dtype):
    config = MemoryConfig(store=store, dtype=dtype, num_samples=10, path=str(tmp_path))
    mem = MemoryStore(10, config, name="b0")
    assert mem.nbytes_for((4, 8)) == 10 * 32 * {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}[dtype] + (
        10 * 4 * 4 if dtype == "int8" else 0
    )
    ids = torch.tensor([7, 2, 5])
    rows = torch.randn(3, 4, 8)
    assert not mem.is_seen(ids).any()
    mem.write(ids, rows)
    assert mem.is_seen(torch.tensor([7, 2, 5, 0])).tolist() == [True, True, True, False]
    back = mem.read(torch.tensor([5, 7]), torch.device("cpu"), torch.float32)
    tol = {"fp32": 0, "fp16": 1e-3, "bf16": 1e-2, "int8": 1.0 / 127}[dtype]
    expected = rows[[2, 0]]
    scale = expected.abs().amax(dim=-1, keepdim=True)
    assert ((back - expected).abs() <= tol * scale + 1e-7).all()
    if store == "mmap":
        files = {p.name.split(".")[1]: p for p in tmp_path.iterdir()}  # b0.<part>.<unique>.bin
        assert sorted(files) == (["scales", "values"] if dtype == "int8" else ["values"])
        assert files["values"].stat().st_size == mem.nbytes_for((4, 8)) - (10 * 4 * 4 if dtype == "int8" else 0)


def test_state_dict_round_trip():
    config = MemoryConfig(store="host", dtype="fp32", num_samples=6)
    a = MemoryStore(6, config)
    a.write(torch.tensor([1, 4]), torch.randn(2, 3, 2))
    b = MemoryStore(6, config)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.seen, b.seen)
    ids = torch.tensor([1, 4])
    assert torch.equal(a.read(ids, torch.device("cpu"), torch.float32), b.read(ids, torch.device("cpu"), torch.float32))
    with pytest.raises(ValueError, match="checkpoint has 6 samples, this plan has 7"):
        MemoryStore(7, MemoryConfig(num_samples=7)).load_state_dict(a.state_dict())


def test_fixed_sequence_length_is_required():
    mem = MemoryStore(4, MemoryConfig(num_samples=4))
    mem.write(torch.tensor([0]), torch.zeros(1, 5, 2))
    with pytest.raises(ValueError, match=r"holds samples of shape \(5, 2\) but got \(6, 2\).*fixed sequence length"):
        mem.write(torch.tensor([1]), torch.zeros(1, 6, 2))


@pytest.mark.parametrize(
    "ids, message",
    [
        (None, "needs a 'sample_id'"),
        (torch.tensor([0, -1]), "sample_id -1 is negative"),
        (torch.tensor([0, 10]), r"sample_id 10 is out of range: memory.num_samples=10"),
        (torch.tensor([3, 3]), "duplicates"),
        (torch.tensor([0.0, 1.0]), "integer tensor"),
        (torch.tensor([0, 1, 2]), "3 entries but the batch has 2 rows"),
    ],
)
def test_sample_id_errors(ids, message):
    with pytest.raises(ValueError, match=message):
        check_sample_ids(ids, num_samples=10, batch_size=2)


def test_read_before_write_is_an_error():
    with pytest.raises(RuntimeError, match="read before any write"):
        MemoryStore(2, MemoryConfig(num_samples=2)).read(torch.tensor([0]), torch.device("cpu"), torch.float32)


def test_size_is_logged_before_allocation(caplog):
    import logging

    mem = MemoryStore(1000, MemoryConfig(num_samples=1000, dtype="fp16"), name="boundary0")
    assert mem.nbytes_for((128, 768)) == 1000 * 128 * 768 * 2
    with caplog.at_level(logging.INFO, logger="hf_actcomp.aqsgd_memory"):
        mem.write(torch.tensor([0]), torch.zeros(1, 128, 768))
    assert "boundary0: 1000 samples x (128, 768) x fp16 = 187.50 MiB (host store)" in caplog.text


@pytest.mark.parametrize("store, where", [("device", "cpu"), ("host", "cpu")])
def test_a_store_larger_than_free_memory_is_refused_before_allocation(monkeypatch, store, where):
    from hf_actcomp import aqsgd_memory as memory

    asked = []
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: asked.append(device.type) or 2**20)
    mem = MemoryStore(1000, MemoryConfig(store=store, num_samples=1000, dtype="fp16"), name="boundary0")
    message = rf"boundary0 needs 0.18 GiB on cpu \(store='{store}'\) but only 0.00 GiB is free.*store='mmap'.*dtype='int8'"
    with pytest.raises(MemoryError, match=message):
        mem.write(torch.tensor([0]), torch.zeros(1, 128, 768))
    assert asked == [where] and mem.values is None  # nothing allocated
    small = MemoryStore(2, MemoryConfig(store=store, num_samples=2, dtype="fp16"))
    small.write(torch.tensor([0]), torch.zeros(1, 4, 8))  # 128 bytes fit
    mapped = MemoryStore(1000, MemoryConfig(store="mmap", num_samples=1000, dtype="fp16"))
    mapped.write(torch.tensor([0]), torch.zeros(1, 128, 768))  # on disk: not checked against RAM
    assert asked == [where, where]
    mapped.close()


def test_free_memory_is_known_on_this_host():
    from hf_actcomp.aqsgd_memory import free_memory_bytes

    assert free_memory_bytes(torch.device("cpu")) > 2**20


def _filled(config, name="memory"):
    mem = MemoryStore(config.num_samples, config, name=name)
    mem.write(torch.tensor([1, 4]), torch.randn(2, 3, 8))
    return mem


@pytest.mark.parametrize("saved, configured", [("int8", "fp16"), ("fp16", "int8")])
def test_int8_and_float_checkpoints_do_not_mix(saved, configured):
    state = _filled(MemoryConfig(dtype=saved, num_samples=6)).state_dict()
    target = MemoryStore(6, MemoryConfig(dtype=configured, num_samples=6), name="b0")
    with pytest.raises(ValueError, match=rf"b0: the checkpoint holds {saved} memory but this store is configured "
                                         rf"with dtype='{configured}'"):
        target.load_state_dict(state)
    assert not target.seen.any() and target.values is None  # nothing touched


def test_load_copies_into_the_store_own_buffers():
    config = MemoryConfig(store="host", dtype="fp16", num_samples=6)
    a = _filled(config)
    b = _filled(config)
    buffer = b.values
    b.load_state_dict({k: v.float() if k == "values" else v for k, v in a.state_dict().items()})
    assert b.values is buffer and b.values.dtype == torch.float16
    ids = torch.tensor([1, 4])
    assert torch.equal(a.read(ids, torch.device("cpu"), torch.float32), b.read(ids, torch.device("cpu"), torch.float32))


def test_a_resumed_store_saves_what_it_loaded():
    """Tables are allocated at the first access after a resume (on that access's device); a
    checkpoint taken before that access must still hold the memory."""
    a = _filled(MemoryConfig(store="device", dtype="fp32", num_samples=6))
    b = MemoryStore(6, a.config)
    b.load_state_dict(a.state_dict())
    c = MemoryStore(6, a.config)
    c.load_state_dict(b.state_dict())
    ids = torch.tensor([1, 4])
    assert torch.equal(c.read(ids, torch.device("cpu"), torch.float32), a.read(ids, torch.device("cpu"), torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="placement after a resume needs a CUDA device")
@pytest.mark.parametrize("store", ["device", "host"])
def test_resumed_store_is_placed_like_a_fresh_one(store):
    cuda = torch.device("cuda")
    config = MemoryConfig(store=store, dtype="fp16", num_samples=6)
    a = MemoryStore(6, config)
    a.write(torch.tensor([1, 4]), torch.randn(2, 3, 8, device=cuda))
    checkpoint = {k: v.cpu() for k, v in a.state_dict().items()}  # as safetensors.load_file returns it
    b = MemoryStore(6, config)
    b.load_state_dict(checkpoint)
    out = b.read(torch.tensor([1, 4]), cuda, torch.float32)
    assert torch.equal(out, a.read(torch.tensor([1, 4]), cuda, torch.float32))
    assert b.values.device == a.values.device and b.values.dtype == torch.float16
    assert not b.values.is_pinned() and not a.values.is_pinned()  # host rows are copied out: no pinning


def _mmap(path, num_samples=4):
    return MemoryConfig(store="mmap", dtype="fp32", num_samples=num_samples, path=None if path is None else str(path))


def test_mmap_stores_with_the_same_name_use_different_files(tmp_path, monkeypatch):
    a, b = MemoryStore(4, _mmap(tmp_path), name="b0"), MemoryStore(4, _mmap(tmp_path), name="b0")
    rows = torch.randn(2, 3, 8)
    a.write(torch.tensor([0, 1]), rows)
    b.write(torch.tensor([0, 1]), torch.zeros(2, 3, 8))
    assert len(list(tmp_path.iterdir())) == 2
    assert torch.equal(a.read(torch.tensor([0, 1]), torch.device("cpu"), torch.float32), rows)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 3)
    c = MemoryStore(4, _mmap(tmp_path), name="b1")
    c.write(torch.tensor([0]), rows[:1])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("b1.")][0].startswith("b1.rank3.values.")


def test_mmap_store_does_not_truncate_existing_files(tmp_path):
    existing = tmp_path / "b0.values.bin"  # e.g. mapped by another process
    existing.write_bytes(b"x" * 100)
    MemoryStore(4, _mmap(tmp_path), name="b0").write(torch.tensor([0]), torch.ones(1, 3, 8))
    assert existing.read_bytes() == b"x" * 100


@pytest.mark.parametrize("in_temp_dir", [True, False])
@pytest.mark.parametrize("how", ["close", "del"])
def test_mmap_store_removes_what_it_created(tmp_path, in_temp_dir, how):
    import gc

    mem = MemoryStore(4, _mmap(None if in_temp_dir else tmp_path), name="b0")
    mem.write(torch.tensor([0]), torch.ones(1, 3, 8))
    directory = os.path.dirname(mem.values.untyped_storage().filename)
    assert os.listdir(directory)
    if how == "close":
        mem.close()
        assert mem.values is None and not mem.seen.any()
        mem.close()  # idempotent
    else:
        del mem
        gc.collect()
    if in_temp_dir:
        assert not os.path.exists(directory)
    else:
        assert os.listdir(directory) == []


def _anonymous_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_mmap_memory_goes_from_checkpoint_to_table_without_a_copy_in_ram(tmp_path):
    """A resumed mmap store is allocated at load and filled from a memory map of the checkpoint:
    the process's anonymous memory does not grow by the table's size (load_file would add 128 MiB)."""
    from hf_actcomp.state.compression import load_state, save_state

    config = MemoryConfig(store="mmap", dtype="fp32", num_samples=128, path=str(tmp_path / "a"))
    a = MemoryStore(128, config)
    a.write(torch.arange(128), torch.ones(128, 256, 1024))  # 128 MiB
    a.values[5, 3, 7] = 2.0
    meta = {"plan": {}, "world_size": 1, "stage": 0, "blocks": [0, 1]}
    save_state(tmp_path / "state", 0, a.state_dict(), meta)
    a.close()
    b = MemoryStore(128, MemoryConfig(store="mmap", dtype="fp32", num_samples=128, path=str(tmp_path / "b")))
    before = _anonymous_rss()
    b.load_state_dict(load_state(tmp_path / "state", 0, meta))
    grown = _anonymous_rss() - before
    assert b._loaded is None and b.values.shape == (128, 256, 1024)
    assert grown < 32 * 2**20, f"anonymous memory grew by {grown / 2**20:.0f} MiB"
    assert b.values[5, 3, 7] == 2.0 and b.values[6, 3, 7] == 1.0 and bool(b.seen.all())
    b.close()


def test_replica_shards_and_their_sample_ids():
    from hf_actcomp import Compression
    from hf_actcomp.aqsgd_memory import replica_sample_range
    from hf_actcomp.feedback import AQSGDReceiver

    assert [replica_sample_range(10, 2, r) for r in (0, 1)] == [range(0, 5), range(5, 10)]
    assert replica_sample_range(11, 3, 2) == range(6, 9)  # like shard_dataset: the last 11 % 3 rows dropped
    with pytest.raises(ValueError, match="memory.num_samples=1 cannot give 2 replicas a sample each"):
        replica_sample_range(1, 2, 0)
    assert check_sample_ids(torch.tensor([5, 9]), range(5, 10), 2).tolist() == [5, 9]
    with pytest.raises(ValueError, match=r"sample_id 4 is outside this data-parallel replica's shard \[5, 10\)"):
        check_sample_ids(torch.tensor([4, 6]), range(5, 10), 2)
    with pytest.raises(ValueError, match=r"sample_id 10 is outside"):
        check_sample_ids(torch.tensor([6, 10]), range(5, 10), 2)

    # The replica's receiver keeps 5 rows; sample 7 is row 2.
    config = MemoryConfig(store="host", dtype="fp32", num_samples=10)
    receiver = AQSGDReceiver(Compression("aqsgd", bits=4), config, name="b0", sample_range=range(5, 10))
    assert receiver.memory.num_samples == 5
    x = torch.randn(2, 3, 8)
    payload = torch.cat([x.reshape(-1).view(torch.uint8)])  # first visit: sent in full
    out = receiver.decode(payload, x.shape, x.dtype, sample_ids=torch.tensor([7, 5]))
    assert torch.equal(out, x) and receiver.memory.seen.tolist() == [True, False, True, False, False]
    assert torch.equal(receiver.memory.read(torch.tensor([2]), torch.device("cpu"), torch.float32)[0], x[0])


def test_sender_and_receiver_of_a_replica_shard_stay_in_step():
    """Replica 1 of 2 over 10 samples: ids 5..9, memory rows 0..4, on both ends, over revisits."""
    from hf_actcomp import Compression
    from hf_actcomp.feedback import build_receiver, build_sender

    config = MemoryConfig(store="host", dtype="fp32", num_samples=10)
    compression = Compression("aqsgd", bits=4)
    sender = build_sender(compression, config, "b0", sample_range=range(5, 10))
    receiver = build_receiver(compression, config, "b0", sample_range=range(5, 10))
    ids = torch.tensor([9, 6])
    for step in range(3):
        x = torch.randn(2, 3, 8) + step
        payload = sender.encode(x, sample_ids=ids)
        out = receiver.decode(payload, x.shape, x.dtype, sample_ids=ids)
        assert torch.equal(out, sender.last_reconstruction)
        if step == 0:
            assert torch.equal(out, x)  # first visit: in full
    assert receiver.memory.seen.tolist() == [False, True, False, False, True]
