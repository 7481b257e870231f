"""How a restarted replica fetches its peer's outer state when torchft heals it: safetensors over
HTTP, on an address the user names.

torchft's own `HTTPTransport` unpickles what it fetches (`torch.load(weights_only=False)`) and
listens on every interface. What a DiLoCo replica heals from is tensors (the anchor weights, the
outer momentum) and a few numbers, so this transport sends the tensors as safetensors and the
rest as JSON, and binds its server to `host` only.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torchft.checkpointing.transport import CheckpointTransport


def flatten(state: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON skeleton of a nested state (dicts with any keys, lists, numbers, strings), each
    tensor replaced by a reference into `tensors`. Dict keys keep their type (int or str)."""
    if isinstance(state, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = state.detach().cpu().contiguous()
        return {"tensor": key}
    if isinstance(state, dict):
        return {"dict": [[k, flatten(v, tensors)] for k, v in state.items()]}
    if isinstance(state, list | tuple):
        return {"list": [flatten(v, tensors) for v in state]}
    if state is None or isinstance(state, bool | int | float | str):
        return {"value": state}
    raise TypeError(f"Cannot send a {type(state).__name__} when healing a replica (tensors, numbers, strings only).")


def unflatten(skeleton: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    (kind, value), = skeleton.items()
    if kind == "tensor":
        return tensors[value]
    if kind == "dict":
        return {k: unflatten(v, tensors) for k, v in value}
    if kind == "list":
        return [unflatten(v, tensors) for v in value]
    return value


def encode_state(state: Any) -> bytes:
    """One message: an 8-byte length, the JSON skeleton, the safetensors blob."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(flatten(state, tensors)).encode()
    return len(skeleton).to_bytes(8, "little") + skeleton + save_safetensors(tensors)


def decode_state(message: bytes) -> Any:
    size = int.from_bytes(message[:8], "little")
    skeleton = json.loads(message[8 : 8 + size])
    return unflatten(skeleton, load_safetensors(message[8 + size :]))


class SafetensorsTransport(CheckpointTransport):
    """torchft's checkpoint transport, serving the state of the step a peer asks for.

    Args:
        host: the address the server binds to and advertises (what peers connect to).
        timeout: how long a fetch may take.
    """

    def __init__(self, host: str, timeout: timedelta) -> None:
        self.host = host
        self.timeout = timeout
        # A peer may ask as soon as the quorum names this replica its source, before this side
        # has staged the state: a request waits (up to `timeout`) until some state is served.
        self._served = threading.Condition()
        self._message: bytes | None = None
        self._step: int | None = None
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                with transport._served:
                    transport._served.wait_for(lambda: transport._message is not None,
                                               timeout=transport.timeout.total_seconds())
                    message, step = transport._message, transport._step
                if message is None or self.path != f"/checkpoint/{step}":
                    self.send_error(400, f"serving step {step}, asked for {self.path}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(message)))
                self.end_headers()
                self.wfile.write(message)

            def log_message(self, *args: Any) -> None:  # quiet: torchft logs the heal itself
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._server.server_address[1]}/checkpoint"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        message = encode_state(state_dict)
        with self._served:
            self._message, self._step = message, step
            self._served.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._served:
            self._message = self._step = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        with urllib.request.urlopen(f"{metadata}/{step}", timeout=timeout.total_seconds()) as response:
            return decode_state(response.read())

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()
