"""Helpers for Triton Python-backend requests and responses (used inside the stub only: pb_utils is imported
lazily so the rest of the package works without Triton)."""

from __future__ import annotations

import json

import numpy as np


def pb():
    import triton_python_backend_utils as pb_utils

    return pb_utils


def model_params(args: dict) -> dict[str, str]:
    cfg = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}


def instance_count(args: dict) -> int:
    """The instances of this model in the server (a GPU group's count is per GPU it lists)."""
    groups = json.loads(args["model_config"]).get("instance_group", [])
    return max(1, sum(int(g.get("count", 1)) * max(1, len(g.get("gpus", []))) for g in groups))


def input_array(request, name: str) -> np.ndarray | None:
    t = pb().get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def input_str(request, name: str) -> str | None:
    a = input_array(request, name)
    if a is None or a.size == 0:
        return None
    v = a.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def input_bool(request, name: str, default: bool = False) -> bool:
    a = input_array(request, name)
    return default if a is None or a.size == 0 else bool(a.reshape(-1)[0])


def input_ids(request, name: str) -> list[int] | None:
    a = input_array(request, name)
    return None if a is None else [int(x) for x in a.reshape(-1)]


def tensor(name: str, value) -> object:
    if isinstance(value, str):
        return pb().Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))
    if isinstance(value, (list, tuple)):
        return pb().Tensor(name, np.array(value, dtype=np.int64))
    if isinstance(value, np.ndarray):
        return pb().Tensor(name, value)
    if isinstance(value, bool):
        return pb().Tensor(name, np.array([value], dtype=np.bool_))
    return pb().Tensor(name, np.array([value], dtype=np.int64))


def error(message: str, code: str = "INTERNAL"):
    """A TritonError with one of INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED, UNKNOWN..."""
    e = pb().TritonError
    return e(message, getattr(e, code, e.INTERNAL))


def to_tensors(tensors: dict[str, np.ndarray]) -> list:
    """A wire message's named arrays as Triton tensors."""
    return [pb().Tensor(name, array) for name, array in tensors.items()]


def request_getter(request):
    """A wire Getter over a request's inputs."""
    return lambda name: input_array(request, name)


def response_getter(response):
    """A wire Getter over a (BLS) response's outputs."""

    def get(name: str):
        t = pb().get_output_tensor_by_name(response, name)
        return None if t is None else t.as_numpy()

    return get
