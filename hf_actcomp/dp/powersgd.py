"""torch's PowerSGD hook under the same name-based registration (reused, not rewritten)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from .base import ring_allreduce_bytes


class _FlatBucket:
    """What torch's PowerSGD hook reads of a `GradBucket`, for one flat buffer of a step's
    gradients: bucket 0, the step's last, its per-parameter gradients views of the buffer (the
    hook writes the decompressed result into them and returns the buffer)."""

    def __init__(self, flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        self._flat, self._params = flat, list(params)
        pieces = flat.split([p.numel() for p in self._params])
        self._grads = [g.view(p.shape) for g, p in zip(pieces, self._params, strict=True)]

    def buffer(self) -> torch.Tensor:
        return self._flat

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list[torch.Tensor]:
        return self._params


class PowerSGDCompressor:
    """Wraps `torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState`.

    As a DDP hook (`hf_actcomp.dp.register`) it sees DDP's buckets; inside a pipeline
    (`Plan(dp_compression="powersgd")`) `reduce` hands it each step's gradients as one flat
    bucket, whose layout (name order) never changes, so its state is stable across resumes.

    Bytes are estimated from the buffers torch all-reduces: the rank-r factors P and Q of each
    compressed matrix (and the uncompressed 1-D tensors), counted with the ring formula.
    """

    name = "powersgd"
    hub_tag = None  # the name

    def __init__(self, process_group=None, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 2,
                 min_compression_rate: float = 2.0, warm_start: bool = True, seed: int = 0) -> None:
        self.world_size = dist.get_world_size(process_group)
        if self.world_size < 2:
            raise ValueError(f"The 'powersgd' hook got a process group of {self.world_size} process: nothing to average.")
        self.torch_state = powersgd.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter, min_compression_rate=min_compression_rate,
            warm_start=warm_start, random_seed=seed)
        self.rank_r = matrix_approximation_rank
        self.step = 0
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
        self.seconds = 0.0
        self.param_names: dict[int, str] = {}

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
        self.bytes_uncompressed += ring_allreduce_bytes(nbytes, self.world_size)
        self.bytes_sent += ring_allreduce_bytes(self._wire_bytes(bucket), self.world_size)
        if bucket.is_last():
            self.step += 1
        # Finish each bucket before the next: torch chains the bucket's collectives in future
        # callbacks, and on gloo two buckets' chains can interleave in a different order on
        # different ranks (seen here as "Received data size doesn't match expected size").
        result = powersgd.powerSGD_hook(self.torch_state, bucket).wait()
        self.seconds += time.perf_counter() - start
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(result)
        return future

    def reduce(self, flat: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The average of `flat` (the concatenated gradients of `params`, in order) over the
        group, compressed by torch's hook: the pipeline's data-parallel sync calls this once a step."""
        return self.hook(_FlatBucket(flat, params)).wait()

    def end_step(self) -> None:
        """Nothing to do: `hook` counts the step at its last bucket, and `reduce`'s is the last."""

    def _wire_bytes(self, bucket) -> int:
        if self.torch_state.iter < self.torch_state.start_powerSGD_iter:
            return bucket.buffer().numel() * bucket.buffer().element_size()
        total = 0
        for grad in bucket.gradients():
            if grad.dim() <= 1:
                total += grad.numel()
            else:
                m = grad.reshape(grad.shape[0], -1)
                r = min(self.rank_r, *m.shape)
                compressed = (m.shape[0] + m.shape[1]) * r
                uncompressed = m.numel()
                total += compressed if uncompressed >= compressed * self.torch_state.min_compression_rate else uncompressed
        return total * bucket.buffer().element_size()

    def state_dict(self) -> dict[str, torch.Tensor]:
        s = self.torch_state
        out = {f"error.{k}": v for k, v in s.error_dict.items()}
        out.update({f"p.{k}": v for k, v in s.p_memory_dict.items()})
        out.update({f"q.{k}": v for k, v in s.q_memory_dict.items()})
        out["iter"] = torch.tensor(s.iter)
        out["step"] = torch.tensor(self.step)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        s = self.torch_state
        s.iter = int(state["iter"])
        self.step = int(state["step"])
        s.error_dict = {int(k[6:]): v.clone() for k, v in state.items() if k.startswith("error.")}
        s.p_memory_dict = {int(k[2:]): v.clone() for k, v in state.items() if k.startswith("p.")}
        s.q_memory_dict = {int(k[2:]): v.clone() for k, v in state.items() if k.startswith("q.")}

    def stats(self) -> dict:
        return {"hook": self.name, "steps": self.step, "bytes_sent": self.bytes_sent,
                "bytes_uncompressed": self.bytes_uncompressed,
                "compression_ratio": self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0,
                "seconds": self.seconds}
