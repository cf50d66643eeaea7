"""The messages between the deployment's models: one dataclass per contract, encoded into named tensors once by its
sender and decoded (and validated) once by its receiver.

    client ──MasterRequest──► master ──DecodeRequest──► decode ──PrefillRequest──► prefill
                              master ◄─DecodeResponse── decode ◄─PrefillResponse── prefill

Tensors here are plain numpy arrays keyed by name (`Tensors`); `triton_io` turns them into Triton tensors and reads
them back through a `Getter`, so every contract is testable without Triton. Nothing is pickled: ids are int64, text
is UTF-8 BYTES, sampling parameters and the KV handle are JSON strings. A decode error raises `ParamError` naming
the field; an internal request without the deployment's key is refused before any other field is read."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from backends.common.core.request import ParamError, SamplingParams

Tensors = dict[str, np.ndarray]
Getter = Callable[[str], "np.ndarray | None"]

KEY_FIELD = "internal_key"
FINISH_ERROR = "error"  # decode's finish_reason for an error that travels as an ordinary final response


# ---- encoding helpers ---------------------------------------------------------------------------------------
def _ints(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _text(value: str) -> np.ndarray:
    return np.array([value.encode("utf-8")], dtype=np.object_)


def _flag(value: bool) -> np.ndarray:
    return np.array([bool(value)], dtype=np.bool_)


def _blobs(values: list[bytes]) -> np.ndarray:
    return np.array(list(values), dtype=np.object_)


def get_blobs(get: Getter, name: str) -> list[bytes]:
    """A BYTES tensor's elements as bytes ([] when absent): images as the client sent them."""
    a = get(name)
    if a is None:
        return []
    return [v if isinstance(v, bytes) else str(v).encode() for v in np.asarray(a, dtype=object).reshape(-1)]


def _get_ints(get: Getter, name: str, required: bool = True) -> list[int] | None:
    a = get(name)
    if a is None:
        if required:
            raise ParamError(name, "is required")
        return None
    return [int(x) for x in np.asarray(a).reshape(-1)]


def _get_int(get: Getter, name: str) -> int:
    v = _get_ints(get, name)
    if len(v) != 1:
        raise ParamError(name, f"must hold one integer, got {len(v)}")
    return v[0]


def _get_text(get: Getter, name: str, default: str | None = None) -> str:
    a = get(name)
    if a is None or np.asarray(a).size == 0:
        if default is None:
            raise ParamError(name, "is required")
        return default
    v = np.asarray(a).reshape(-1)[0]
    try:
        return v.decode("utf-8") if isinstance(v, bytes) else str(v)
    except UnicodeDecodeError:
        raise ParamError(name, "is not valid UTF-8") from None


def _get_flag(get: Getter, name: str, default: bool) -> bool:
    a = get(name)
    return default if a is None or np.asarray(a).size == 0 else bool(np.asarray(a).reshape(-1)[0])


def _get_params(get: Getter) -> SamplingParams:
    return SamplingParams.from_json(_get_text(get, "sampling_parameters", "{}"))


def check_key(get: Getter, expected: str) -> None:
    """Refuse an internal request that lacks the deployment's key (ParamError naming internal_key)."""
    got = get(KEY_FIELD)
    if got is None or np.asarray(got).size == 0:
        raise ParamError(KEY_FIELD, "this is an internal model of the deployment: requests must carry its internal_key")
    if _get_text(get, KEY_FIELD) != expected:
        raise ParamError(KEY_FIELD, "internal_key does not match this deployment")


# ---- client -> master ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class MasterRequest:
    """A client's request to the deployment's public model: a prompt as text or token ids, sampling parameters
    as a JSON object, streaming or not. The one builder of pd_master's inputs (`backends.client`, the replay bench
    and the server tests); pd_master reads them field by field, so that a malformed one is refused by name."""

    MODEL = "pd_master"
    OUTPUTS = ("text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens")

    text: str | None = None
    ids: list[int] | None = None
    params: dict = field(default_factory=dict)
    stream: bool = True
    chat: bool = False  # apply the model's chat template to text
    exclude_input: bool | None = None  # None: the server's default
    raw_params: str | None = None  # sent as is instead of params (a client that writes its own JSON)
    images: list[bytes] | None = None  # base64 text of PNG or JPEG images, one per placeholder in the prompt

    def encode(self) -> Tensors:
        out: Tensors = {}
        if self.text is not None:
            out["text_input"] = _text(self.text)
        if self.ids is not None:
            out["input_ids"] = _ints(self.ids)
        out["stream"] = _flag(self.stream)
        if self.chat:
            out["apply_chat_template"] = _flag(True)
        if self.exclude_input is not None:
            out["exclude_input_in_output"] = _flag(self.exclude_input)
        params = self.raw_params if self.raw_params is not None else json.dumps(self.params)
        out["sampling_parameters"] = _text(params)
        if self.images:
            out["image"] = _blobs(self.images)
        return out


TRITON_DTYPES = {np.dtype(np.int64): "INT64", np.dtype(np.bool_): "BOOL", np.dtype(np.object_): "BYTES"}


# ---- master -> decode ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class DecodeRequest:
    """One client request's decode stream (a segment of it in restart mode)."""

    MODEL = "pd_decode"

    request_id: str
    input_ids: list[int]
    params: SamplingParams
    # not empty: no new request, but the notice that cancels `request_id` with this reason (master reaching a
    # decode server of its own over gRPC, where the host's mailbox does not reach)
    cancel: str = ""
    # not empty: master's reply socket (backends/common/serving/reply_channel.py); decode then answers the stream
    # with one empty response at once and the final flag at the end, and sends everything else there
    reply_to: str = ""
    # a request with images: their grids, digests and the expanded prompt's length (multimodal.MMInfo's JSON),
    # and the images as the client sent them, which decode forwards with each of the request's prefill jobs
    mm_info: str = ""
    images: list[bytes] = field(default_factory=list)

    def encode(self, key: str) -> Tensors:
        return {
            "input_ids": _ints(self.input_ids),
            "sampling_parameters": _text(json.dumps(self.params.to_dict())),
            "request_id": _text(self.request_id),
            KEY_FIELD: _text(key),
            **({"cancel": _text(self.cancel)} if self.cancel else {}),
            **({"reply_to": _text(self.reply_to)} if self.reply_to else {}),
            **({"mm_info": _text(self.mm_info), "image": _blobs(self.images)} if self.mm_info else {}),
        }

    @classmethod
    def decode(cls, get: Getter, key: str) -> DecodeRequest:
        check_key(get, key)
        rid = _get_text(get, "request_id", "")
        cancel = _get_text(get, "cancel", "")
        if cancel:
            if not rid:
                raise ParamError("request_id", "a cancel names the request it cancels")
            return cls(rid, [], SamplingParams(), cancel)
        ids = _get_ints(get, "input_ids", required=False) or []
        if not rid or not ids:
            raise ParamError("input_ids", "request_id and input_ids are required")
        mm_info, images = _get_text(get, "mm_info", ""), get_blobs(get, "image")
        if bool(mm_info) != bool(images):
            raise ParamError("mm_info", "a request with images carries mm_info and image together")
        return cls(rid, ids, _get_params(get), reply_to=_get_text(get, "reply_to", ""), mm_info=mm_info,
                   images=images)  # fmt: skip


# ---- decode -> master ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class DecodeResponse:
    """What one decode response carries: every token pending for the stream since the last response; on the final
    one its finish reason, or an error (finish_reason "error" with a message and a Triton status code name)."""

    OUTPUTS = ("output_ids", "finish_reason", "error_message", "error_code", "num_pauses")

    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_code: str = "INTERNAL"
    num_pauses: int = 0

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def encode(self) -> Tensors:
        failed = self.error is not None
        return {
            "output_ids": _ints([] if failed else self.output_ids),
            "finish_reason": _text(FINISH_ERROR if failed else (self.finish_reason or "")),
            "error_message": _text(self.error or ""),
            "error_code": _text(self.error_code if failed else ""),
            "num_pauses": _ints([self.num_pauses]),
        }

    @classmethod
    def decode(cls, get: Getter) -> DecodeResponse | None:
        """None for a response without outputs (the empty closing response of a decoupled stream)."""
        ids = _get_ints(get, "output_ids", required=False)
        if ids is None:
            return None
        reason = _get_text(get, "finish_reason", "")
        pauses = _get_ints(get, "num_pauses", required=False) or [0]
        if reason == FINISH_ERROR:
            message = _get_text(get, "error_message", "") or "decode failed"
            return cls([], None, message, _get_text(get, "error_code", "") or "INTERNAL", pauses[0])
        return cls(ids, reason or None, None, "INTERNAL", pauses[0])


# ---- decode -> prefill --------------------------------------------------------------------------------------
@dataclass(slots=True)
class PrefillRequest:
    """Compute K/V for positions [start, len(input_ids)) into decode's `dst_slots` (one per position), under
    `epoch`; `sample` asks for the first output token (a prompt), else the answer carries none (a recovery)."""

    MODEL = "pd_prefill"
    OUTPUTS = ("first_token", "epoch")

    request_id: str
    input_ids: list[int]
    start: int
    dst_slots: list[int]
    epoch: int
    sample: bool
    params: SamplingParams  # the seed already resolved by decode
    kv_handle: str  # decode's KV pool as JSON fields (kv_handoff.export_handle)
    # hybrid models: decode's state pages (same JSON form) and the page to write the state after input_ids into
    state_handle: str = ""
    dst_state_page: int = -1
    # a request with images: as in DecodeRequest (prefill keeps what it makes of them under request_id)
    mm_info: str = ""
    images: list[bytes] = field(default_factory=list)
    # True: no job, but the notice that request_id has ended: prefill lets go of what it keeps for it
    release: bool = False

    def __post_init__(self) -> None:
        if self.release:
            return
        if not self.input_ids:
            raise ParamError("input_ids", "is empty")
        if not 0 <= self.start < len(self.input_ids) or len(self.dst_slots) != len(self.input_ids) - self.start:
            raise ParamError(
                "dst_slots", f"{len(self.dst_slots)} slots for positions [{self.start}, {len(self.input_ids)})"
            )
        if self.epoch < 0:
            raise ParamError("epoch", f"must be >= 0, got {self.epoch}")
        if self.state_handle and self.dst_state_page < 0:
            raise ParamError("dst_state_page", f"must be >= 0 with a state_handle, got {self.dst_state_page}")

    @classmethod
    def release_of(cls, request_id: str) -> PrefillRequest:
        """The notice that `request_id` ended (every other field empty)."""
        return cls(request_id, [], 0, [], 0, False, SamplingParams(), "", release=True)

    def encode(self, key: str) -> Tensors:
        if self.release:
            return {"request_id": _text(self.request_id), "release": _flag(True), KEY_FIELD: _text(key)}
        state = {"state_handle": _text(self.state_handle), "dst_state_page": _ints([self.dst_state_page])}
        return {
            **(state if self.state_handle else {}),
            **({"mm_info": _text(self.mm_info), "image": _blobs(self.images)} if self.mm_info else {}),
            "input_ids": _ints(self.input_ids),
            "start": _ints([self.start]),
            "dst_slots": _ints(self.dst_slots),
            "epoch": _ints([self.epoch]),
            "request_id": _text(self.request_id),
            "sample": _flag(self.sample),
            "sampling_parameters": _text(json.dumps(self.params.to_dict())),
            "kv_handle": _text(self.kv_handle),
            KEY_FIELD: _text(key),
        }

    @classmethod
    def decode(cls, get: Getter, key: str) -> PrefillRequest:
        check_key(get, key)
        if _get_flag(get, "release", False):
            rid = _get_text(get, "request_id", "")
            if not rid:
                raise ParamError("request_id", "a release names the request it releases")
            return cls.release_of(rid)
        mm_info, images = _get_text(get, "mm_info", ""), get_blobs(get, "image")
        if bool(mm_info) != bool(images):
            raise ParamError("mm_info", "a request with images carries mm_info and image together")
        return cls(
            request_id=_get_text(get, "request_id", "?"),
            input_ids=_get_ints(get, "input_ids"),
            start=_get_int(get, "start"),
            dst_slots=_get_ints(get, "dst_slots"),
            epoch=_get_int(get, "epoch"),
            sample=_get_flag(get, "sample", True),
            params=_get_params(get),
            kv_handle=_get_text(get, "kv_handle"),
            state_handle=_get_text(get, "state_handle", ""),
            dst_state_page=_get_int(get, "dst_state_page") if get("dst_state_page") is not None else -1,
            mm_info=mm_info,
            images=images,
        )


# ---- prefill -> decode --------------------------------------------------------------------------------------
@dataclass(slots=True)
class PrefillResponse:
    """The transfer is written; `first_token` is the sampled token of a prompt job, None for a recovery job."""

    epoch: int
    first_token: int | None = None

    def encode(self) -> Tensors:
        return {
            "first_token": _ints([-1 if self.first_token is None else self.first_token]),
            "epoch": _ints([self.epoch]),
        }

    @classmethod
    def decode(cls, get: Getter) -> PrefillResponse:
        token = _get_int(get, "first_token")
        return cls(_get_int(get, "epoch"), None if token < 0 else token)
