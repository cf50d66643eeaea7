"""An in-process stand-in for Triton's Python backend, at the `triton_io` seam: the parts of
`triton_python_backend_utils` the three roles use (tensors, responses, errors, decoupled response senders, BLS
calls), and a `Server` that loads the real role models (`MasterModel`, `DecodeModel`, `PrefillModel`) in this
process, routes BLS calls between them as Triton does, and lets a test send client requests to pd_master.

What it keeps of Triton's contract: a non-decoupled model's `execute` runs one call at a time (prefill batches what
it is given); a decoupled model's `execute` returns at once and answers through its senders; nothing may be sent on
a sender after its final flag, nor may is_cancelled() be asked then (either fails the test); a BLS decoupled stream
yields each response and, for a final flag sent without one, an empty response, then ends. What it leaves out:
shared-memory messages, process boundaries, the stub's threads, Prometheus' text format, HTTP and gRPC. Real-server
tests keep those. Metrics are kept per server (`Server.metric`), so tests read the same counters a server exports."""

from __future__ import annotations

import json
import queue
import secrets
import sys
import threading
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
STREAM_TIMEOUT_S = 120.0  # a BLS stream or a client waiting longer than this fails the test instead of hanging


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, array):
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors=(), error: TritonError | None = None):
        self._tensors, self._error = list(output_tensors), error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors


def get_input_tensor_by_name(request, name: str) -> Tensor | None:
    return request.inputs.get(name)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


class MetricFamily:
    """Triton's custom metrics API, kept in the current `Server`'s registry (`Server.metric` reads it)."""

    COUNTER, GAUGE = "counter", "gauge"

    def __init__(self, name: str, description: str, kind: str):
        self.name, self.kind = name, kind

    def Metric(self, labels: dict | None = None) -> _Metric:  # noqa: N802 (Triton's name)
        m = _Metric(self.kind, dict(labels or {}))
        Server.current.registry.setdefault(self.name, []).append(m)
        return m


class _Metric:
    def __init__(self, kind: str, labels: dict):
        self.kind, self.labels, self._value = kind, labels, 0.0

    def set(self, v: float) -> None:
        assert self.kind == MetricFamily.GAUGE, "set() on a counter"
        self._value = float(v)

    def increment(self, v: float) -> None:
        assert self.kind == MetricFamily.COUNTER and v >= 0, "a counter only grows"
        self._value += v

    def value(self) -> float:
        return self._value


class ResponseSender:
    """A decoupled request's sender: `deliver(response, final)` receives what the model sends."""

    def __init__(self, deliver):
        self.deliver, self.cancelled, self.closed = deliver, threading.Event(), False
        self.lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        with self.lock:
            assert not self.closed, "a response sent after the final flag"
            self.closed = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self.deliver(response, self.closed)

    def is_cancelled(self) -> bool:
        # after the final flag Triton frees what this reads (asking then corrupted the stub's heap in 2.51)
        assert not self.closed, "is_cancelled() asked after the final flag"
        return self.cancelled.is_set()


class Request:
    """What a model's execute receives."""

    def __init__(self, inputs: list[Tensor], parameters: dict | None = None, sender: ResponseSender | None = None):
        self.inputs = {t.name(): t for t in inputs}
        self._parameters = json.dumps(parameters or {})
        self._sender = sender

    def get_response_sender(self) -> ResponseSender:
        return self._sender

    def parameters(self) -> str:
        return self._parameters


class InferenceRequest:
    """A BLS call: `exec()` runs the named model of the current `Server`."""

    def __init__(self, model_name: str, inputs=(), requested_output_names=(), **kw):
        self.model_name, self.inputs_list = model_name, list(inputs)

    def exec(self, decoupled: bool = False):
        return Server.current.call(self.model_name, self.inputs_list, decoupled)


class Stream:
    """A decoupled call's responses, in order, ending after the final one."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.sender = ResponseSender(lambda response, final: self.q.put((response, final)))

    def __iter__(self):
        while True:
            response, final = self.q.get(timeout=STREAM_TIMEOUT_S)
            yield response if response is not None else InferenceResponse()
            if final:
                return


def module() -> types.ModuleType:
    """This file as `triton_python_backend_utils`."""
    return sys.modules[__name__]


class Server:
    """The three role models of one deployment, loaded in this process on the CPU, with `random:tiny-test` (or
    `model`) and the given config fields per role."""

    current: Server | None = None

    def __init__(self, tmp: Path, model: str = "random:tiny-test", decode=None, prefill=None, master=None):
        self.deployment = "ip" + secrets.token_hex(4)
        key = tmp / "internal_key"
        key.write_text(secrets.token_hex(24))
        wiring = dict(model=model, internal_key_file=str(key), deployment=self.deployment)
        self.configs = {
            "pd_prefill": {**wiring, "cpu_threads": 1, **(prefill or {})},
            "pd_decode": {**wiring, "cpu_threads": 1, **(decode or {})},
            "pd_master": {**wiring, **(master or {})},
        }
        self.decoupled = {"pd_master", "pd_decode"}
        self.held: dict[str, tuple] = {}  # model -> (which calls, the event that lets them through): `hold`
        self.registry: dict[str, list[_Metric]] = {}  # metric name -> its metrics (MetricFamily)
        self.locks = {name: threading.Lock() for name in self.configs}
        self.models: dict[str, object] = {}
        self._saved = sys.modules.get("triton_python_backend_utils")
        sys.modules["triton_python_backend_utils"] = module()
        Server.current = self
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        from backends.pd_decode.model import DecodeModel
        from backends.pd_master.model import MasterModel
        from backends.pd_prefill.model import PrefillModel

        for name, cls in (("pd_prefill", PrefillModel), ("pd_decode", DecodeModel), ("pd_master", MasterModel)):
            config = {
                "name": name,
                "parameters": {
                    "project_root": {"string_value": str(ROOT)},
                    "config": {"string_value": json.dumps(self.configs[name])},
                },
                "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
            }
            args = {"model_config": json.dumps(config), "model_instance_name": f"{name}_0",
                    "model_instance_kind": "CPU", "model_instance_device_id": "0"}  # fmt: skip
            self.models[name] = cls(args)

    @property
    def decode(self):
        return self.models["pd_decode"]

    @property
    def master(self):
        return self.models["pd_master"]

    @property
    def prefill(self):
        return self.models["pd_prefill"]

    def call(self, name: str, inputs: list[Tensor], decoupled: bool, parameters: dict | None = None):
        """A call of model `name` (BLS or client): its only response, or a decoupled call's `Stream`."""
        model = self.models.get(name)
        if model is None:
            return InferenceResponse(error=TritonError(f"model {name} is not loaded", TritonError.NOT_FOUND))
        held = self.held.get(name)
        if held is not None and held[0]({t.name(): t for t in inputs}):
            assert held[1].wait(STREAM_TIMEOUT_S), f"a call of {name} held for {STREAM_TIMEOUT_S} s"
        if decoupled:
            assert name in self.decoupled, f"{name} is not decoupled"
            stream = Stream()
            model.execute([Request(inputs, parameters, stream.sender)])
            return stream
        with self.locks[name]:  # Triton runs one execute at a time per instance
            return model.execute([Request(inputs, parameters)])[0]

    def metric(self, name: str, **labels) -> float:
        """The sum of metric `name` over the label sets that include `labels` (after sending pending updates)."""
        from backends.common.serving.metrics import _Worker

        _Worker.get().flush()
        return sum(m.value() for m in self.registry.get(name, []) if labels.items() <= m.labels.items())

    def wait_metric(self, name: str, pred, timeout: float = 10.0, **labels) -> float:
        """Metric `name` once `pred` holds for it (or its value at the timeout)."""
        import time

        t0 = time.monotonic()
        while not pred(v := self.metric(name, **labels)) and time.monotonic() - t0 < timeout:
            time.sleep(0.02)
        return v

    def hold(self, name: str, which) -> threading.Event:
        """Calls of model `name` for which `which(inputs)` is true wait until the returned event is set (a prefill
        job that takes as long as a test needs, deterministically)."""
        gate = threading.Event()
        self.held[name] = (which, gate)
        return gate

    def close(self) -> None:
        for _, gate in self.held.values():
            gate.set()
        for name in ("pd_master", "pd_decode", "pd_prefill"):
            model = self.models.pop(name, None)
            if model is not None:
                model.finalize()
        if self._saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = self._saved
        Server.current = None
        import shutil

        shutil.rmtree(f"/dev/shm/triton-pd-{self.deployment}", ignore_errors=True)


class Answer:
    """One client request to pd_master: its responses as they arrive."""

    def __init__(self, stream: Stream, cancel: threading.Event):
        self.stream, self.cancel_event = stream, cancel
        self.ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.responses = 0

    def cancel(self) -> None:
        """As a client that goes away: the sender reports is_cancelled()."""
        self.stream.sender.cancelled.set()

    def wait(self) -> Answer:
        for response in self.stream:
            if response.has_error():
                self.error = response.error().message()
                continue
            out = {t.name(): t.as_numpy() for t in response.output_tensors()}
            if "output_ids" in out:
                self.responses += 1
                self.ids += [int(x) for x in out["output_ids"].reshape(-1)]
            if "finish_reason" in out:
                v = out["finish_reason"].reshape(-1)[0]
                self.finish_reason = v.decode() if isinstance(v, bytes) else str(v)
        return self


def generate(server: Server, ids: list[int], stream: bool = True, images: list[bytes] | None = None,
             **sampling) -> Answer:  # fmt: skip
    """Send a request to pd_master as a streaming client would (images: base64 text of each, the `image` input);
    `.wait()` collects the answer."""
    inputs = [
        Tensor("input_ids", np.array(ids, dtype=np.int64)),
        Tensor("stream", np.array([stream], dtype=np.bool_)),
        Tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_)),
    ]
    if images:
        inputs.append(Tensor("image", np.array(list(images), dtype=np.object_)))
    s = server.call("pd_master", inputs, decoupled=True)
    return Answer(s, s.sender.cancelled)
