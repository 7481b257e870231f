"""When the transport posts its messages. Paired (NCCL): each send goes together with the
receive that follows it (one batch_isend_irecv, as NCCL needs where two stages' messages cross
under 1F1B), and a send with no receive after it at once. Early (gloo): receives are posted
when the engine announces them, sends at once, each kind under its own tag."""

import pytest
import torch
import torch.distributed as dist

from hf_actcomp.pipeline import transport as transport_module


class _Work:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


@pytest.fixture
def batches(monkeypatch):
    posted = []

    class Op:
        def __init__(self, op, tensor, peer=None, group=None, tag=0):
            self.kind = "send" if op is dist.isend else "recv"
            self.peer, self.nbytes, self.tag = peer, tensor.numel(), tag

    def batch(ops):
        posted.append([(op.kind, op.peer, op.nbytes, op.tag) for op in ops])
        return [_Work() for _ in ops]

    monkeypatch.setattr(transport_module.dist, "P2POp", Op)
    monkeypatch.setattr(transport_module.dist, "batch_isend_irecv", batch)
    return posted


def test_a_send_is_posted_with_the_next_receive(batches):
    t = transport_module.Transport(None, rank=0, timeout=5.0, early=False)
    t.send(torch.zeros(3, dtype=torch.uint8), dst=1, with_next_recv=True)  # e.g. F i's activations
    assert batches == []  # held for the next receive
    posted = t.post_recv(7, src=1, device=torch.device("cpu"), what="gradients", tag=2)  # recorded only
    assert batches == []
    t.wait_recv(posted)  # e.g. B j's gradients
    assert batches == [[("send", 1, 3, 0), ("recv", 1, 7, 2)]]
    t.send(torch.zeros(5, dtype=torch.uint8), dst=1)  # nothing to receive next: posted at once
    assert batches[-1] == [("send", 1, 5, 0)]
    t.send(torch.zeros(2, dtype=torch.uint8), dst=1, with_next_recv=True)
    t.flush()  # the end of the step posts what is left and waits for every send
    assert batches[-1] == [("send", 1, 2, 0)] and t.pending == [] and t.outbox == []


def test_early_receives_are_posted_ahead_and_sends_at_once(batches):
    t = transport_module.Transport(None, rank=1, timeout=5.0, early=True)
    first = t.post_recv(7, src=0, device=torch.device("cpu"), what="activations of micro-batch 0", tag=1)
    second = t.post_recv(9, src=0, device=torch.device("cpu"), what="activations of micro-batch 1", tag=1)
    assert batches == [[("recv", 0, 7, 1)], [("recv", 0, 9, 1)]]  # both on the wire before any data is needed
    t.send(torch.zeros(3, dtype=torch.uint8), dst=0, tag=2, with_next_recv=True)  # pairing ignored
    assert batches[-1] == [("send", 0, 3, 2)]
    assert t.wait_recv(first).numel() == 7 and len(batches) == 3  # nothing posted again
    with pytest.raises(RuntimeError, match="receives posted but never taken: activations of micro-batch 1"):
        t.flush()  # a step must take every receive it posted
    assert t.posted == [] and second.work is not None


def test_payloads_of_a_device_stage_on_gloo_go_through_the_host(batches):
    """gloo moves host memory: a CUDA stage's receives land in a host buffer, handed back on the
    stage's device (here the meta device stands in for CUDA); CPU stages are never staged."""
    t = transport_module.Transport(None, rank=0, timeout=5.0, early=True, via_host=True)
    device = torch.device("meta")
    posted = t.post_recv(4, src=1, device=device, what="gradients", tag=2)
    assert posted.buffer.device.type == "cpu"
    assert t.wait_recv(posted).device == device
    assert transport_module.Transport(None, rank=0, timeout=5.0, device=torch.device("cpu")).via_host is False
    # gloo's works complete only through wait(): host-staged receives wait, CUDA ones (NCCL) poll.
    cuda = torch.device("cuda")
    assert t.poll is False and transport_module.Transport(None, 0, 5.0, device=cuda, via_host=True).poll is False
    assert transport_module.Transport(None, 0, 5.0, device=cuda).poll is True  # not gloo: NCCL's buffers
