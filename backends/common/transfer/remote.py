"""The internal models of other tritonservers, over Triton's gRPC protocol (tritonclient's messages on one shared
channel per server): master's decode streams and decode's prefill calls when the roles run in separate servers.

- `DecodeServers` (master): each request is one ModelStreamInfer call on a decode server's channel, so its
  responses and errors are its own; a cancel travels on the same call as a second request naming the first
  (`DecodeRequest.cancel`). Requests go to the server with the fewest open streams.
- `PrefillServers` (decode): each job is one ModelInfer call to a live prefill server, round robin. A server that
  cannot be reached (refused, reset, gone mid-call) is marked down for `down_seconds` and the job is retried on the
  next; an answer from prefill itself (an error included) is never retried."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult, service_pb2_grpc
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import np_to_triton_dtype

_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
# transport-level failures: the server is not there (or stopped being there mid-call); anything else is its answer
UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}


def parse_urls(text: str, flag: str) -> list[str]:
    urls = [u.strip() for u in text.split(",") if u.strip()]
    for u in urls:
        host, _, port = u.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{flag}: {u!r} is not host:port")
    if not urls:
        raise ValueError(f"{flag}: names no server")
    return urls


def infer_request(model: str, tensors: dict[str, np.ndarray], request_id: str, outputs=()):
    inputs = []
    for name, array in tensors.items():
        i = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        i.set_data_from_numpy(array)
        inputs.append(i)
    outs = [InferRequestedOutput(n) for n in outputs] or None
    return _get_inference_request(model, inputs, "", request_id, outs, 0, False, False, 0, None, None)


class Unreachable(ConnectionError):
    pass


class Server:
    """One remote tritonserver: a channel and its stub."""

    def __init__(self, url: str):
        self.url = url
        self.channel = grpc.insecure_channel(url, options=_OPTIONS)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.down_until = 0.0
        self.open_streams = 0
        self.lock = threading.Lock()

    def streams(self, delta: int) -> None:
        with self.lock:
            self.open_streams += delta

    def close(self) -> None:
        self.channel.close()


class PrefillServers:
    def __init__(self, urls: list[str], model: str, outputs, down_seconds: float = 5.0, timeout: float = 600.0):
        self.servers = [Server(u) for u in urls]
        self.model, self.outputs, self.down_seconds, self.timeout = model, list(outputs), down_seconds, timeout
        self._next = 0
        self._lock = threading.Lock()

    def order(self) -> list[Server]:
        """Every server once, live ones first, starting at the round-robin position."""
        with self._lock:
            n = len(self.servers)
            start, self._next = self._next, (self._next + 1) % n
        ring = [self.servers[(start + i) % n] for i in range(n)]
        now = time.monotonic()
        return [s for s in ring if s.down_until <= now] + [s for s in ring if s.down_until > now]

    def call(self, server: Server, tensors: dict[str, np.ndarray], request_id: str):
        """The answer's getter, or (error message, status code name) for an error prefill answered; raises
        Unreachable (and marks the server down) when it could not be asked."""
        try:
            resp = server.stub.ModelInfer(
                infer_request(self.model, tensors, request_id, self.outputs), timeout=self.timeout
            )
        except grpc.RpcError as e:
            if e.code() in UNREACHABLE:
                server.down_until = time.monotonic() + self.down_seconds
                raise Unreachable(f"prefill server {server.url}: {e.code().name} {e.details()}") from None
            return None, (e.details() or str(e), e.code().name)
        server.down_until = 0.0
        result = InferResult(resp)
        return result.as_numpy, None

    def close(self) -> None:
        for s in self.servers:
            s.close()


_END = object()


class RemoteStream:
    """One decode request's responses, as (error message or None, getter or None) pairs until its final one."""

    def __init__(self, server: Server, model: str, request_id: str, tensors, outputs, cancel_tensors):
        self.server, self.rid, self.cancel_tensors, self.model = server, request_id, cancel_tensors, model
        self.requests: queue.Queue = queue.Queue()
        first = infer_request(model, tensors, request_id, outputs)
        # a FINAL flag sent without a response still reaches us, as an empty response marked final
        first.parameters["triton_enable_empty_final_response"].bool_param = True
        self.requests.put(first)
        self.ended = False
        server.streams(+1)
        self.call = server.stub.ModelStreamInfer(iter(self.requests.get, _END))

    def __iter__(self):
        try:
            for resp in self.call:
                if resp.infer_response.id != self.rid:
                    continue  # the answer to a cancel sent on this call
                final = resp.infer_response.parameters["triton_final_response"].bool_param
                if resp.error_message:
                    yield resp.error_message, None
                else:
                    result = InferResult(resp.infer_response)
                    if resp.infer_response.outputs:
                        yield None, result.as_numpy
                if final:
                    break
        except grpc.RpcError as e:
            yield f"decode server {self.server.url}: {e.code().name} {e.details()}", None
        finally:
            self._end()

    def cancel(self, reason: str) -> None:
        if not self.ended:
            self.requests.put(infer_request(self.model, self.cancel_tensors(reason), self.rid + "~cancel"))

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self.server.streams(-1)
            self.requests.put(_END)  # closes our side of the call
            self.call.cancel()


class DecodeServers:
    def __init__(self, urls: list[str], model: str, outputs):
        self.servers = [Server(u) for u in urls]
        self.model, self.outputs = model, list(outputs)
        self._lock = threading.Lock()

    def open(self, request_id: str, tensors, cancel_tensors) -> RemoteStream:
        """`cancel_tensors(reason)`: the request that cancels this one, sent on the same call."""
        with self._lock:
            server = min(self.servers, key=lambda s: s.open_streams)
            return RemoteStream(server, self.model, request_id, tensors, self.outputs, cancel_tensors)

    def close(self) -> None:
        for s in self.servers:
            s.close()
