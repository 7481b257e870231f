"""The transport posts each send together with the receive that follows it (one
batch_isend_irecv, as NCCL needs where two stages' messages cross under 1F1B), and a send with
no receive after it at once."""

import torch
import torch.distributed as dist

from hf_actcomp.pipeline import transport as transport_module


class _Work:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def test_a_send_is_posted_with_the_next_receive(monkeypatch):
    batches = []

    class Op:
        def __init__(self, op, tensor, peer=None, group=None):
            self.kind = "send" if op is dist.isend else "recv"
            self.peer, self.nbytes = peer, tensor.numel()

    def batch(ops):
        batches.append([(op.kind, op.peer, op.nbytes) for op in ops])
        return [_Work() for _ in ops]

    monkeypatch.setattr(transport_module.dist, "P2POp", Op)
    monkeypatch.setattr(transport_module.dist, "batch_isend_irecv", batch)
    t = transport_module.Transport(None, rank=0, timeout=5.0)
    t.send(torch.zeros(3, dtype=torch.uint8), dst=1, with_next_recv=True)  # e.g. F i's activations
    assert batches == []  # held for the next receive
    t.recv(7, src=1, device=torch.device("cpu"), what="gradients")  # e.g. B j's gradients
    assert batches == [[("send", 1, 3), ("recv", 1, 7)]]
    t.send(torch.zeros(5, dtype=torch.uint8), dst=1)  # nothing to receive next: posted at once
    assert batches[-1] == [("send", 1, 5)]
    t.send(torch.zeros(2, dtype=torch.uint8), dst=1, with_next_recv=True)
    t.flush()  # the end of the step posts what is left and waits for every send
    assert batches[-1] == [("send", 1, 2)] and t.pending == [] and t.outbox == []
