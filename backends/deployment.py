"""What a deployment is, as values: the model, where its instances run, how large its pools are and the limits it
enforces, all derived once from `triton-pd serve`'s options and the machine. `Deployment.template_values()` is what
the model repository's config.pbtxt templates are rendered with. Nothing here starts a process."""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from .common.core import role_config
from .common.core.role_config import DecodeConfig, MasterConfig, PrefillConfig, pbtxt_string
from .common.engine.sizing import cpu_threads_per_instance, default_max_streams, resolve_decode, resolve_prefill

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EXIT_TIMEOUT_S = 20  # tritonserver --exit-timeout-secs: how long its shutdown waits for requests in flight
ROLE_MODELS = {
    "all": ("pd_master", "pd_decode", "pd_prefill"),
    "master": ("pd_master",),
    "decode": ("pd_decode",),
    "prefill": ("pd_prefill",),
}


def _role_urls(a) -> tuple[str, dict[str, list[str]]]:
    """--role and the servers it reaches, checked together (a ValueError names the option)."""
    from .common.transfer.remote import parse_urls

    role = getattr(a, "role", "all")
    urls = {"decode": [], "prefill": []}
    for peer, needed_by in (("decode", "master"), ("prefill", "decode")):
        given = getattr(a, f"{peer}_urls", None)
        if role == needed_by and not given:
            raise ValueError(f"--role {role} needs --{peer}-urls (the {peer} servers' gRPC host:port)")
        if given and role != needed_by:
            raise ValueError(f"--{peer}-urls is for --role {needed_by}")
        if given:
            urls[peer] = parse_urls(given, f"--{peer}-urls")
    if role != "all" and not getattr(a, "internal_key_file", None):
        raise ValueError(f"--role {role} needs --internal-key-file: every server of the deployment shares one key")
    if getattr(a, "kv_transport", None) == "dist" and role not in ("all", "decode"):
        raise ValueError("--kv-transport is decode's choice (prefill follows each request's handle)")
    return role, urls


def parse_gpus(gpus: str, available: int | None = None, flag: str = "--gpus") -> list[int]:
    """'0,1' -> [0, 1]; an id the machine does not have is an error naming the flag."""
    try:
        ids = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        raise SystemExit(f"triton-pd: error: {flag} must be comma-separated GPU ids, got {gpus!r}") from None
    if not ids:
        raise SystemExit(f"triton-pd: error: {flag} names no GPU")
    bad = [g for g in ids if g < 0 or (available is not None and g >= available)]
    if bad:
        raise SystemExit(f"triton-pd: error: {flag} names GPU {bad[0]}, but this machine has {available} GPU(s)")
    return ids


def instance_groups(count: int, gpu: bool, gpus: str, available: int | None = None, flag: str = "--gpus") -> str:
    """Triton instance_group entries: `count` instances spread round robin over the listed GPUs (2 prefill
    instances over '1,2' -> one on GPU 1 and one on GPU 2)."""
    if not gpu:
        return f"{{ count: {count} kind: KIND_CPU }}"
    ids = parse_gpus(gpus, available, flag)
    per = {g: 0 for g in ids}
    for i in range(count):
        per[ids[i % len(ids)]] += 1
    return ", ".join(f"{{ count: {n} kind: KIND_GPU gpus: [ {g} ] }}" for g, n in per.items() if n)


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def _speculative(mode: str, cfg) -> str:
    """--speculative checked against the model before any process starts: mtp needs a hybrid model (decode then
    checks that its weights have the MTP head and refuses to load otherwise, naming the option)."""
    if mode == "mtp" and not cfg.is_hybrid:
        raise ValueError("--speculative mtp: this model ships no MTP head; use --speculative ngram")
    return mode


@dataclass(frozen=True)
class Deployment:
    """One served deployment: each role's settings (`role_config`), every default resolved, and where the roles'
    instances run."""

    decode: DecodeConfig
    prefill: PrefillConfig
    master: MasterConfig
    gpu: bool
    workdir: Path
    deployment_id: str  # names its shared-memory segments and mailbox
    key_file: Path
    mailbox: Path
    decode_groups: str
    prefill_groups: str
    prefill_instances: int
    decode_instances: int
    role: str = "all"  # which models this server runs: all three, or one role of a multi-server deployment
    shared_key: bool = False  # the internal key comes from a given file (shared by the deployment's servers)
    exit_timeout: int = EXIT_TIMEOUT_S  # tritonserver --exit-timeout-secs

    @property
    def models(self) -> tuple[str, ...]:
        return ROLE_MODELS[self.role]

    model = property(lambda self: self.decode.model)
    dtype = property(lambda self: self.decode.dtype)
    kv_tokens = property(lambda self: self.decode.kv_tokens)
    host_kv_tokens = property(lambda self: self.decode.host_kv_tokens)
    max_streams = property(lambda self: self.master.max_streams)
    request_timeout = property(lambda self: self.master.request_timeout)

    @classmethod
    def from_args(cls, a, n_gpus: int) -> Deployment:
        """From `triton-pd serve`'s parsed options on a machine with `n_gpus` GPUs: resolves the model (converting
        it once, before several processes want it), sizes the pools and fills in each role's config. A refused
        value is a ValueError naming its option."""
        from .common.model import loader

        cfg = loader.load_config(loader.resolve(a.model))
        gpu = a.device == "gpu" or (a.device == "auto" and n_gpus > 0)
        workdir = Path(a.workdir or PROJECT_ROOT / ".run" / f"serve-{a.http_port}").resolve()
        deployment_id = secrets.token_hex(4)
        if getattr(a, "exit_timeout", EXIT_TIMEOUT_S) < 0:
            raise ValueError("--exit-timeout: must be >= 0 seconds")
        role, urls = _role_urls(a)
        key = getattr(a, "internal_key_file", None)
        key_file = Path(key).resolve() if key else workdir / "internal_key"
        mailbox = Path("/dev/shm") / f"triton-pd-{deployment_id}"
        wiring = dict(model=a.model, internal_key_file=str(key_file), deployment=deployment_id)
        # the cores are shared by every compute instance this server runs; the rest of the machine-dependent
        # defaults (dtype, pools, host tier) are filled in by the same functions a role given no config uses
        threads = a.cpu_threads or cpu_threads_per_instance(
            (a.prefill_instances if role in ("all", "prefill") else 0)
            + (a.decode_instances if role in ("all", "decode") else 0)
        )
        state_pages = getattr(a, "state_pages", 0) or 0
        if getattr(a, "deterministic", "off") == "on" and gpu and cfg.is_hybrid:
            raise ValueError("--deterministic: hybrid (linear-attention) models are not covered yet on the GPU")
        fp8 = cfg.quantization == "fp8" or getattr(a, "quantization", "") == "fp8"
        if getattr(a, "deterministic", "off") == "on" and gpu and fp8:
            raise ValueError("--deterministic: FP8 weights are not covered (16-bit and float32 weights are)")
        decode = role_config.from_args(
            DecodeConfig, a, **wiring, mailbox_dir=str(mailbox), cpu_threads=threads, state_pages=state_pages,
            speculative=_speculative(getattr(a, "speculative", "off"), cfg), prefill_urls=",".join(urls["prefill"]),
            kv_transport=getattr(a, "kv_transport", None) or ("dist" if role == "decode" else "ipc"),
            kv_address=getattr(a, "kv_address", None) or (socket.gethostname() if role == "decode" else "127.0.0.1"),
        )  # fmt: skip
        if decode.decode_tp > 1:
            _check_tp("--decode-tp", decode.decode_tp, cfg, gpu, decode)
        decode = resolve_decode(decode, cfg, gpu, parse_gpus(a.decode_gpus)[0] if gpu else 0, a.decode_instances)
        prefill = role_config.from_args(PrefillConfig, a, **wiring, cpu_threads=threads, state_pages=state_pages)
        if prefill.prefill_tp > 1:
            _check_tp("--prefill-tp", prefill.prefill_tp, cfg, gpu, decode)
        prefill = resolve_prefill(prefill, cfg, gpu, a.prefill_instances)
        master = role_config.from_args(
            MasterConfig, a, **wiring, mailbox_dir=str(mailbox), decode_urls=",".join(urls["decode"]),
            max_streams=a.max_streams
            or default_max_streams(a.decode_instances * max(1, len(urls["decode"])), a.max_batch),
        )  # fmt: skip
        return cls(
            decode=decode,
            prefill=prefill,
            master=master,
            gpu=gpu,
            workdir=workdir,
            deployment_id=deployment_id,
            key_file=key_file,
            mailbox=mailbox,
            exit_timeout=getattr(a, "exit_timeout", EXIT_TIMEOUT_S),
            decode_groups=instance_groups(a.decode_instances, gpu, a.decode_gpus, n_gpus, "--decode-gpus"),
            prefill_groups=instance_groups(a.prefill_instances, gpu, a.prefill_gpus, n_gpus, "--prefill-gpus"),
            prefill_instances=a.prefill_instances,
            decode_instances=a.decode_instances,
            role=role,
            shared_key=bool(key),
        )

    def write_key(self) -> None:
        """The internal key, readable by this user only; a new one for every start (a shared one is only read:
        every server of a multi-server deployment is started with the same file)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.shared_key:
            if not self.key_file.is_file() or not self.key_file.read_text().strip():
                raise ValueError(
                    f"--internal-key-file: {self.key_file} is missing or empty (`triton-pd key FILE` makes one)"
                )
            return
        self.key_file.write_text(secrets.token_hex(24))
        self.key_file.chmod(0o600)

    def template_values(self) -> dict[str, str]:
        """The ${NAME} values of model_repository/*/config.pbtxt: each role's config as JSON, and placement."""
        return {
            "PROJECT_ROOT": str(PROJECT_ROOT),
            "DECODE_CONFIG": pbtxt_string(self.decode.to_json()),
            "PREFILL_CONFIG": pbtxt_string(self.prefill.to_json()),
            "MASTER_CONFIG": pbtxt_string(self.master.to_json()),
            "MASTER_INSTANCES": "1",
            "DECODE_GROUPS": self.decode_groups,
            "PREFILL_GROUPS": self.prefill_groups,
        }

    def summary(self) -> str:
        if self.role == "master":
            return f"role master: model {self.model} (its tokenizer), decode servers {self.master.decode_urls}"
        if self.role == "prefill":
            return f"role prefill: model {self.model} ({self.dtype}), {self.prefill_instances} prefill instance(s)"
        if self.role == "decode":
            instances = (
                f"{self.decode_instances} decode instance(s), prefill servers {self.decode.prefill_urls}, KV over "
                f"{self.decode.kv_transport}"
            )
        else:
            instances = f"{self.prefill_instances} prefill + {self.decode_instances} decode instance(s)"
        return (
            f"model {self.model} ({self.dtype}, {'GPU' if self.gpu else 'CPU'}), {instances}, decode KV pool "
            f"{self.kv_tokens} tokens, on_decode_oom={self.decode.on_decode_oom}, {self.decode.cpu_threads} CPU "
            f"thread(s) per instance, {self.max_streams} decode streams"
        )


def _check_tp(flag: str, n: int, cfg, gpu: bool, decode) -> None:
    """What --prefill-tp and --decode-tp > 1 cover so far, refused otherwise naming the option that conflicts."""
    from backends.common.model.tensor_parallel import TPError, check

    if gpu:
        raise ValueError(f"{flag} {n}: tensor parallelism runs on the CPU path so far (--device cpu)")
    if cfg.is_hybrid:
        raise ValueError(f"{flag} {n}: hybrid models' state pages are not split on the hand-off yet")
    if flag == "--decode-tp" and decode.speculative != "off":
        raise ValueError(f"{flag} {n}: speculative decoding does not run with tensor parallelism yet")
    try:
        check(cfg, n)
    except TPError as e:
        raise ValueError(f"{flag} {n}: {e}") from None
