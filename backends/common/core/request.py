"""Sampling parameters (vLLM semantics) and InferReq, the request object that lives as long as its answer."""

from __future__ import annotations

import enum
import json
import math
import secrets
from dataclasses import dataclass, field, fields

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one image's place in a Qwen3.5 prompt's text


class ParamError(ValueError):
    """Invalid request input; `field` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings; matched on text by the master

    def validate(self) -> SamplingParams:
        def check(ok, name, msg):
            if not ok:
                raise ParamError(name, msg)

        check(
            isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
            "max_tokens",
            "must be an integer",
        )
        check(self.max_tokens > 0, "max_tokens", f"must be > 0, got {self.max_tokens}")
        check(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0,
            "temperature",
            f"must be a number >= 0, got {self.temperature!r}",
        )
        check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", f"must be -1, 0 or > 0, got {self.top_k!r}")
        check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            f"must be an integer in [0, 2^63), got {self.seed!r}",
        )
        check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens,
            "min_tokens",
            f"must be an integer >= 0, got {self.min_tokens!r}",
        )
        check(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        check(
            isinstance(self.stop_token_ids, list) and all(isinstance(t, int) for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of integers",
        )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a string or a list of non-empty strings",
        )
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        return self

    @classmethod
    def from_json(cls, text: str | bytes) -> SamplingParams:
        """Parse the `sampling_parameters` JSON of Triton's vLLM backend convention. Unknown keys are errors."""
        try:
            raw = json.loads(text or "{}")
        except (ValueError, UnicodeDecodeError) as e:
            raise ParamError("sampling_parameters", f"malformed JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ParamError("sampling_parameters", "must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ParamError("sampling_parameters", f"unknown key(s) {', '.join(unknown)}")
        for name, v in raw.items():
            raw[name] = _coerce(name, v)
        return cls(**raw).validate()

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_INT_KEYS = ("max_tokens", "top_k", "min_tokens", "seed")
_FLOAT_KEYS = ("temperature", "top_p")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _int(name: str, v: str) -> int:
    try:
        return int(v.strip())
    except ValueError:
        raise ParamError(name, f"must be an integer, got {v!r}") from None


def _coerce(name: str, v):
    """A value as Triton's vLLM backend takes it: numbers and booleans may come as strings ("16", "0.7", "true":
    genai-perf sends {"max_tokens": "16"}), and whole floats as integers (16.0). Anything else is left for
    `validate` to refuse, naming the key."""
    if name in _INT_KEYS:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str):
            return _int(name, v)
    elif name in _FLOAT_KEYS and isinstance(v, str):
        try:
            f = float(v.strip())
        except ValueError:
            raise ParamError(name, f"must be a number, got {v!r}") from None
        if not math.isfinite(f):
            raise ParamError(name, f"must be a finite number, got {v!r}")
        return f
    elif name == "ignore_eos" and isinstance(v, str):
        if v.strip().lower() in _TRUE + _FALSE:
            return v.strip().lower() in _TRUE
        raise ParamError(name, f"must be a boolean (true or false), got {v!r}")
    elif name == "stop_token_ids" and isinstance(v, list):
        return [_int(name, t) if isinstance(t, str) else t for t in v]
    return v


class ReqState(enum.Enum):
    WAITING = "waiting"  # admitted, nothing computed yet
    WAITING_KV = "waiting_kv"  # decode: waiting for prefill to write the prompt's KV
    RUNNING = "running"
    PAUSED = "paused"  # decode: KV released, request kept
    RECOVERING = "recovering"  # decode: slots reserved, prefill recomputing the missing KV
    FINISHED = "finished"


class InferReq:
    """One answer being generated. Its token history is exact int64 ids, never rebuilt from text.

    KV: slots[i] holds position i's K/V, for i in [0, len(slots)). slots[:cached_len] belong to the radix cache
    (locked through last_node); slots[cached_len:] belong to this request.
    """

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, arrival: int = 0):
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.arrival = arrival  # admission order, for the pause policy
        self.state = ReqState.WAITING
        self.slots: list[int] = []
        self.cached_len = 0
        self.last_node = None
        self.state_page = -1  # hybrid models: the live linear-attention state page (-1: none)
        self.draft: int | None = None  # speculative decoding: the guess for the token after the next input
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.epoch = 0
        self.num_pauses = 0
        self.paused_at = 0.0  # decode: when it last paused (the scheduler's clock)
        self.running_since = 0.0  # decode: when it last started or resumed running
        # images (backends/common/model/multimodal.Multimodal): rotary positions, the tower's rows, cache keys
        self.mm = None
        self.mm_wire: tuple[str, list[bytes]] | None = None  # decode: (MMInfo JSON, images) for prefill's jobs

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """What the prefix caches key this sequence by: its ids, with a request's image tokens replaced by keys
        of the image's content (every image's tokens have the same id)."""
        if self.mm is None:
            return self.all_ids
        return self.mm.cache_keys(self.prompt_ids) + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (the decode step needs one token of a long sequence)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    def __repr__(self) -> str:
        return f"InferReq({self.rid}, {self.state.value}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)})"
