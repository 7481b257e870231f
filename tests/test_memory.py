import pytest
import torch

from hf_actcomp import MemoryConfig
from hf_actcomp.memory import MemoryStore, check_sample_ids


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
        files = sorted(p.name for p in tmp_path.iterdir())
        assert "b0.values.bin" in files
        assert (tmp_path / "b0.values.bin").stat().st_size == mem.nbytes_for((4, 8)) - (
            10 * 4 * 4 if dtype == "int8" else 0
        )


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
    with caplog.at_level(logging.INFO, logger="hf_actcomp.memory"):
        mem.write(torch.tensor([0]), torch.zeros(1, 128, 768))
    assert "boundary0: 1000 samples x (128, 768) x fp16 = 187.50 MiB (host store)" in caplog.text
