"""Each role's settings as one typed value: `DecodeConfig`, `PrefillConfig`, `MasterConfig`.

A role reads exactly one model-config parameter, `config`: a JSON object of these fields (any subset; the rest
take their defaults, which are `triton-pd serve`'s). `triton-pd serve` and `triton-pd repository` render it from
the same dataclasses, and their command-line options are generated from the fields (`add_options`), so the
options, the rendered repository and a hand-written one cannot drift apart. An unknown field, a value of the wrong
type, a choice not offered or a value out of range is a ValueError naming the role and the field.

A default that depends on the machine or on the other roles is a sentinel here (0, "" or null) that the role
resolves when it starts (`serve` resolves it for the whole deployment and renders the number)."""

import argparse
import dataclasses
import json
import types
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

PARAMETER = "config"  # the model-config parameter holding a role's JSON


def opt(default, help: str, choices=None, minimum=None, cli: bool = True, flag_default=dataclasses.MISSING,
        const=None):  # fmt: skip
    """A config field. minimum: the smallest value allowed (None: any). cli: `serve` has an option for it (named
    after the field). flag_default: the option's default when it differs from the field's (None: `serve` computes
    the value from other options, as the help says). const: the value of the option given without one
    (`--deterministic` for `--deterministic on`)."""
    meta = dict(help=help, choices=choices, minimum=minimum, cli=cli, const=const)
    if flag_default is not dataclasses.MISSING:
        meta["flag_default"] = flag_default
    return field(default=default, metadata=meta)


class RoleConfig:
    ROLE: ClassVar[str] = ""

    @classmethod
    def from_json(cls, text: str | None):
        """The role's settings from its `config` parameter (None or "": every default)."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cls.ROLE} config: malformed JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{cls.ROLE} config: must be a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{cls.ROLE} config: unknown field {unknown[0]!r} (fields: {', '.join(known)})")
        return cls(**{k: _check(cls.ROLE, known[k], v) for k, v in data.items()})

    @classmethod
    def from_params(cls, params: dict[str, str]):
        """From a model's parameters (triton_io.model_params): only `config` is read."""
        return cls.from_json(params.get(PARAMETER))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    def __post_init__(self):
        for f in fields(self):
            _check(self.ROLE, f, getattr(self, f.name))


class FieldError(ValueError):
    """A config field's value refused: `field` names it, `problem` says why."""

    def __init__(self, role: str, field_name: str, problem: str):
        super().__init__(f"{role} config: {field_name!r} {problem}")
        self.field, self.problem = field_name, problem


def _kinds(f: dataclasses.Field) -> tuple[type, ...]:
    return f.type.__args__ if isinstance(f.type, types.UnionType) else (f.type,)


def _check(role: str, f: dataclasses.Field, value):
    """value if it is of f's type, among its choices and not below its minimum, else a FieldError naming it."""
    kinds = _kinds(f)
    if value is None and type(None) in kinds:
        return value
    if isinstance(value, bool) or not any(
        isinstance(value, k) or (k is float and isinstance(value, int)) for k in kinds if k is not type(None)
    ):
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise FieldError(role, f.name, f"must be {names}, got {value!r}")
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        raise FieldError(role, f.name, f"must be one of {', '.join(m['choices'])}, got {value!r}")
    if m.get("minimum") is not None and value < m["minimum"]:
        raise FieldError(role, f.name, f"must be >= {m['minimum']:g}, got {value!r}")
    return float(value) if float in kinds and not isinstance(value, float) else value


# ---- fields every role has ---------------------------------------------------------------------------------------
MODEL = "smollm2, a Hugging Face folder, a .gguf file or random:<shape>"
KEY = "file holding the deployment's internal key (required: internal requests without it are refused)"
DEPLOYMENT = "the deployment's id: names its shared-memory segments (distinct per deployment on one host)"
MAILBOX = "folder of the cancel and wake-up notices the roles of one host share (default /dev/shm/triton-pd-<id>)"
DTYPE = "weights and KV dtype (default: float32 on CPU, bfloat16 on GPU)"
THREADS = (
    "torch threads of each prefill and decode instance; 0: the usable cores divided among the instances, at least 1 "
    "(more threads than cores between them make each step many times slower)"
)
FAULTS = (
    "testing only, comma-separated: 'stale' makes decode re-deliver each recovery completion under an old epoch; "
    "'drop_paused_kv' keeps no paused KV, forcing prefill recovery; 'slow_prefill' makes prefill wait 3 s before "
    "each batch (cancellations still end its jobs), and 10 s before a batch with a recovery job with "
    "'slow_recovery' too"
)
DETERMINISTIC = (
    "on: batch-invariant kernels on the GPU (every matmul and attention reduces a row in an order fixed by its own "
    "shape), so an answer paused, swapped, recomputed or served from the prefix cache is bit for bit the answer "
    "given alone; costs decode and prefill speed (docs/engine.md, deterministic mode). Dense models; give the same "
    "value to every prefill and decode server of a deployment. `--deterministic` alone means on"
)
IMAGES = "images (Qwen3.5 checkpoints): at most this many per request; more is INVALID_ARG naming `image`"
PIXELS = "images: at most this many pixels (width x height) each, as decoded; more is INVALID_ARG naming `image[i]`"
QUANTIZATION = (
    "fp8: convert a 16-bit checkpoint's projections to fine-grained FP8 at load (e4m3, a scale per 128 x 128 "
    "block, activations quantized per token and 128-channel group: what Qwen's FP8 checkpoints hold; "
    "docs/engine.md, FP8). An FP8 checkpoint or a random -fp8 shape is FP8 without it. Give the same value to every "
    "prefill and decode server of a deployment"
)
STATE_PAGES = (
    "hybrid (linear-attention) models: state pages per prefill and decode instance, one per running request plus "
    "the prefix cache's state checkpoints. Default: 2 x --max-batch + 8 (decode; on a GPU at most what fits "
    "--kv-memory-fraction beside its weights and KV pool) and 2 x 64 + 8 (prefill); ignored for dense models"
)


@dataclass(frozen=True)
class DecodeConfig(RoleConfig):
    ROLE: ClassVar[str] = "pd_decode"

    model: str = opt("smollm2", MODEL)
    internal_key_file: str = opt("", KEY, cli=False)
    deployment: str = opt("local", DEPLOYMENT, cli=False)
    mailbox_dir: str = opt("", MAILBOX, cli=False)
    dtype: str = opt("", DTYPE, flag_default=None)
    quantization: str = opt("", QUANTIZATION, choices=("", "fp8"))
    cpu_threads: int = opt(0, THREADS, minimum=0)
    decode_tp: int = opt(
        1,
        "tensor-parallel ranks of each decode instance, one process each: the instance's stub is rank 0 and starts "
        "the others (so far the CPU path and dense models)",
        minimum=1,
    )
    kv_tokens: int = opt(
        0, "decode KV pool size in tokens per instance (default: 16384 on CPU; on GPU from --kv-memory-fraction)",
        minimum=0, flag_default=None,
    )  # fmt: skip
    kv_memory_fraction: float = opt(
        0.5,
        "GPU only: fraction of the GPU's memory for one decode instance's KV pool (hybrid models: and its state "
        "pages, whose default is cut so that the instance's weights, KV pool and state pages stay within it)",
        minimum=0.0,
    )
    max_batch: int = opt(256, "decode: requests decoded together at most", minimum=1)
    host_kv_tokens: int | None = opt(
        None,
        "decode's host-memory KV tier in tokens per instance: paused requests' KV is copied there and swapped back "
        "in instead of recomputed (pinned memory on a GPU). Default: 4 x --kv-tokens, within a quarter of this "
        "machine's memory shared by the decode instances (hybrid models: less their host state pages); 0 disables it. "
        "Hybrid models: each host copy also holds the paused state (host state pages: --max-batch, at most 64); a "
        "paused request's state page waits on the device and goes to host memory only when another request needs it",
        minimum=0,
    )
    on_decode_oom: str = opt(
        "pause",
        "when decode runs out of KV: pause and recover (default), or end the segment and let master re-submit "
        "prompt + generated ids, recomputed from scratch (the naive baseline, for comparisons)",
        choices=("pause", "restart"),
    )
    pause_policy: str = opt(
        "latest", "which running request decode pauses first", choices=("latest", "oldest", "longest")
    )
    rotation_quantum: float = opt(
        0.1,
        "seconds: while decode's pool is over-committed, a request paused this long takes the place of requests "
        "that have run this long since they resumed, and paused requests resume in the order they paused, so no "
        "answer stalls for long. 0: a paused request waits until there is room",
        minimum=0.0,
    )
    rotation_wait: float = opt(
        0.3,
        "seconds: rotating, the longest-paused request takes its turn once it has waited this long (never less "
        "than --rotation-quantum). With k requests paused turns come about every max(quantum, wait / k), so a few "
        "streams taking turns pay for fewer turns while each still waits about this long (within "
        "--rotation-turns); 0: a quantum",
        minimum=0.0,
    )
    rotation_turns: int = opt(
        4,
        "rotating: while at most this many requests are paused, up to this many turns in any --rotation-wait "
        "seconds, so each waits about the wait; with more paused (a sustained overload) one turn per wait, so "
        "each of k paused waits about k x wait and a turn's swap-in is paid for by a longer run instead of "
        "thrashing; 0: no bound",
        minimum=0,
    )
    rotation_victims: str = opt(
        "smallest",
        "rotating, which running requests give a paused one its turn: smallest, those holding the fewest positions "
        "(the ones furthest along keep running and finish, and the next turn swaps back the least K/V); "
        "longest-running, the longest since they resumed (every stream advances at the same pace)",
        choices=("smallest", "longest-running"),
    )
    rotation_prefetch: str = opt(
        "on",
        "rotating with a host tier: the next paused request's KV is copied back ahead of its turn into free or "
        "evictable slots, so that at its turn decode waits only for the rest (hybrid models: the K/V ahead, the "
        "state with the rest); off: copied back at its turn",
        choices=("on", "off"),
    )
    decode_overlap: str = opt(
        "on",
        "decode launches step n+1 before reading step n's tokens whenever the next step is certain to be one more "
        "greedy token for every running request (GPU decode graphs), also beside paused or waiting requests that "
        "cannot fit yet; off: every step is read before the next",
        choices=("on", "off"),
    )
    speculative: str = opt(
        "off",
        "speculative decoding on decode, one draft token per step, verified exactly (the answers are token for "
        "token the non-speculative ones): ngram drafts by prompt lookup for any model, mtp with the model's "
        "multi-token-prediction head (Qwen3-Next). Turns --decode-overlap off",
        choices=("off", "ngram", "mtp"),
    )
    state_pages: int = opt(0, STATE_PAGES, minimum=0)
    deterministic: str = opt("off", DETERMINISTIC, choices=("off", "on"), const="on")
    stall_seconds: float = opt(
        30.0,
        "decode reports (log and pd_decode_stalls_total) when requests wait and nothing progresses this long; "
        "0 disables",
        minimum=0.0,
    )
    prefill_concurrency: int = opt(
        16, "decode: prefill jobs (prompts and recoveries) in flight at once per decode instance", minimum=1
    )
    prefill_urls: str = opt(
        "",
        "--role decode: prefill servers' gRPC host:port, comma-separated (jobs go round robin to live ones; one "
        "that cannot be reached is skipped and its jobs retried on the next)",
        flag_default=None,
    )
    kv_transport: str = opt(
        "ipc",
        "how prefill's KV reaches decode: ipc (this host: CUDA IPC or shared memory) or dist (torch.distributed "
        "point-to-point: NCCL between GPUs, gloo on CPU; any host). Default: ipc for --role all, dist for --role "
        "decode",
        choices=("ipc", "dist"),
        flag_default=None,
    )
    kv_backend: str = opt(
        "auto",
        "dist's backend (auto: NCCL between two GPUs; gloo on CPU, or when prefill and decode share a GPU, where "
        "NCCL refuses the pair)",
        choices=("auto", "nccl", "gloo"),
    )
    kv_address: str = opt(
        "127.0.0.1",
        "--role decode with dist: the host name or address prefill servers reach this server's KV receiver at "
        "(default: this host's name with --role decode, else 127.0.0.1); its port is picked free per decode instance "
        "and sent with each job",
        flag_default=None,
    )
    fault_injection: str = opt("", FAULTS)


@dataclass(frozen=True)
class PrefillConfig(RoleConfig):
    ROLE: ClassVar[str] = "pd_prefill"

    model: str = opt("smollm2", MODEL)
    internal_key_file: str = opt("", KEY, cli=False)
    deployment: str = opt("local", DEPLOYMENT, cli=False)
    dtype: str = opt("", DTYPE, flag_default=None)
    quantization: str = opt("", QUANTIZATION, choices=("", "fp8"))
    cpu_threads: int = opt(0, THREADS, minimum=0)
    prefill_tp: int = opt(
        1,
        "tensor-parallel ranks of each prefill instance, one process each: the instance's stub is rank 0 and starts "
        "the others (so far the CPU path and dense models)",
        minimum=1,
    )
    prefill_kv_tokens: int = opt(
        0,
        "prefill's own KV pool (its prefix cache) in tokens (default: max(8192, 2 x context) on CPU, 131072 on GPU)",
        minimum=0,
        flag_default=None,
    )
    prefill_max_batch: int = opt(64, "prefill: requests in one forward pass at most", minimum=1)
    chunk_size: int = opt(512, "prefill: chunk size in tokens", minimum=1)
    max_prefill_tokens: int = opt(4096, "prefill: tokens per forward pass at most", minimum=1)
    state_pages: int = opt(0, STATE_PAGES, minimum=0)
    deterministic: str = opt("off", DETERMINISTIC, choices=("off", "on"), const="on")
    fault_injection: str = opt("", FAULTS)
    max_images_per_request: int = opt(8, IMAGES, minimum=0)
    max_image_pixels: int = opt(4096 * 4096, PIXELS, minimum=1)


@dataclass(frozen=True)
class MasterConfig(RoleConfig):
    ROLE: ClassVar[str] = "pd_master"

    model: str = opt("smollm2", MODEL)
    internal_key_file: str = opt("", KEY, cli=False)
    deployment: str = opt("local", DEPLOYMENT, cli=False)
    mailbox_dir: str = opt("", MAILBOX, cli=False)
    max_inflight: int = opt(
        1024, "master: requests in flight before new ones are answered UNAVAILABLE (server busy)", minimum=1
    )
    max_streams: int = opt(
        0,
        "master: decode streams open at once; further requests wait in master (their wait counts in TTFT and in "
        "the deadline). Also sizes the Python backend's thread pool (this + 64). Default: --decode-instances x "
        "--max-batch, at least 64 (256 for a role given none). At 512-1,024 streams on 2 cores, a memory corruption "
        "inside Triton 2.51's Python backend crashed the server in about one run in five (docs/operations.md)",
        minimum=0,
        flag_default=None,
    )
    request_timeout: float = opt(1800.0, "total deadline per request in seconds, pauses included; negative disables")
    decode_urls: str = opt("", "--role master: decode servers' gRPC host:port, comma-separated", flag_default=None)
    max_images_per_request: int = opt(8, IMAGES, minimum=0)
    max_image_pixels: int = opt(4096 * 4096, PIXELS, minimum=1)


ROLES = (DecodeConfig, PrefillConfig, MasterConfig)
DEFAULT_MAX_STREAMS = 256  # max(64, one decode instance x the default max_batch)


def mailbox_dir(cfg) -> str:
    return cfg.mailbox_dir or f"/dev/shm/triton-pd-{cfg.deployment}"


def cli_fields(classes=ROLES) -> list[dataclasses.Field]:
    """The fields `serve` has options for, each once (fields of several roles share one option)."""
    seen: dict[str, dataclasses.Field] = {}
    for cls in classes:
        for f in fields(cls):
            if f.metadata["cli"] and f.name not in seen:
                seen[f.name] = f
    return list(seen.values())


def add_options(p: argparse.ArgumentParser, names: list[str] | None = None) -> None:
    """One option per config field (`--kv-tokens` for kv_tokens), with its type, default, choices and help;
    names: only these fields, in this order."""
    by_name = {f.name: f for f in cli_fields()}
    for name in names if names is not None else list(by_name):
        f = by_name[name]
        kinds = [k for k in _kinds(f) if k is not type(None)]
        m = f.metadata
        default = m.get("flag_default", f.default)
        kw = dict(default=default, help=m["help"])
        if m.get("choices"):
            kw["choices"] = list(m["choices"])
        elif kinds[0] is not str:
            kw["type"] = kinds[0]
        if m.get("const") is not None:
            kw.update(nargs="?", const=m["const"])
        p.add_argument("--" + name.replace("_", "-"), **kw)


def from_args(cls, a: argparse.Namespace, **resolved):
    """cls from parsed options (each field's option, where the parser has it), with `resolved` values on top."""
    values = {f.name: getattr(a, f.name) for f in fields(cls) if f.metadata["cli"] and hasattr(a, f.name)}
    values = {k: v for k, v in values.items() if v is not None}
    values.update(resolved)
    try:
        return cls(**values)
    except FieldError as e:  # named as the option the user typed
        raise ValueError(f"--{e.field.replace('_', '-')}: {e.problem}") from None


def pbtxt_string(text: str) -> str:
    """text as the inside of a single-quoted protobuf text-format string (config.pbtxt's `string_value: '...'`)."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


def read_key(cfg) -> str:
    """The deployment's internal key, from the config's `internal_key_file` (required)."""
    if not cfg.internal_key_file:
        raise FieldError(cfg.ROLE, "internal_key_file", "is required: the file holding the deployment's internal key")
    with open(cfg.internal_key_file) as f:
        return f.read().strip()
