"""What a deployment is, as values: the model, where its instances run, how large its pools are and the limits it
enforces, all derived once from `triton-pd serve`'s options and the machine. `Deployment.template_values()` is what
the model repository's config.pbtxt templates are rendered with. Nothing here starts a process."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

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
    from .common.remote import parse_urls

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


def cpu_threads_per_instance(instances: int) -> int:
    """The cores this process may use, shared among the compute instances (prefill and decode run at the same
    time; torch's OpenMP threads spin at every barrier, so oversubscribed cores slow each step several-fold)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, instances))


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


def kv_bytes_per_token(cfg, dtype: str) -> int:
    import torch

    from .common.runner import parse_dtype

    itemsize = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    layers = len(cfg.full_layers) + (1 if cfg.is_hybrid and cfg.mtp_layers else 0)  # hybrid: full layers, MTP
    return layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def state_bytes(cfg, state_pages: int, max_batch: int) -> int:
    """Bytes of a hybrid model's state store on one decode instance: its pages and a scratch page per batch row."""
    from .common.runner import default_state_pages

    return (state_pages or default_state_pages(max_batch)) * 4 * cfg.state_floats_per_page() + max_batch * 4 * (
        cfg.state_floats_per_page()
    )


def kv_tokens_for_gpu(per_token: int, fraction: float, device: int = 0) -> int:
    import torch

    return int(torch.cuda.get_device_properties(device).total_memory * fraction // per_token)


def default_host_kv_tokens(per_token: int, kv_tokens: int, instances: int = 1) -> int:
    """Four times the device pool (paused requests outnumber running ones when the pool is over-committed), within
    a quarter of physical memory shared by the decode instances (pinned memory cannot be swapped out)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(4 * kv_tokens, ram // 4 // max(1, instances) // per_token)


def default_max_streams(decode_instances: int, max_batch: int) -> int:
    """Decode streams master opens at once: what the decode instances can run at once, and at least 64 (the earlier
    default), so that small batches still have requests waiting on decode. Not more: with 512 or 1,024 streams on
    2 cores a memory corruption in the 2.51 Python backend's shared-memory messages brought the server down in
    about one run in five (a stub's or tritonserver's SIGSEGV, then boost::interprocess::lock_exception; README,
    operating notes), while 256 ran 110 rounds on an H200 and 200 ran 7 rounds on 2 cores without a fault."""
    return max(64, decode_instances * max_batch)


@dataclass(frozen=True)
class Deployment:
    """One served deployment's settings, every default resolved."""

    model: str
    dtype: str
    gpu: bool
    workdir: Path
    deployment_id: str  # names its shared-memory segments and mailbox
    key_file: Path
    mailbox: Path
    kv_tokens: int
    host_kv_tokens: int
    prefill_kv_tokens: int
    cpu_threads: int
    request_timeout: float
    decode_groups: str
    prefill_groups: str
    prefill_instances: int
    decode_instances: int
    max_batch: int
    chunk_size: int
    max_prefill_tokens: int
    max_inflight: int
    max_streams: int
    on_decode_oom: str
    pause_policy: str
    fault_injection: str
    stall_seconds: float
    rotation_quantum: float
    decode_overlap: str  # "on": step n+1 launched before step n's tokens are read (GPU graphs, greedy)
    state_pages: int = 0  # hybrid models: state pages per instance (0: the runner's default)
    rotation_prefetch: str = "off"  # "on": the next paused request's KV copied back ahead of its turn
    rotation_wait: float = 0.3  # seconds the longest-paused request waits before it takes its turn (>= quantum)
    speculative: str = "off"  # decode's drafts: off, ngram (prompt lookup) or mtp (the model's MTP head)
    role: str = "all"  # which models this server runs: all three, or one role of a multi-server deployment
    decode_urls: str = ""  # master role: decode servers' gRPC addresses
    prefill_urls: str = ""  # decode role: prefill servers' gRPC addresses
    kv_transport: str = "ipc"  # ipc (this host) or dist (torch.distributed: any host)
    kv_backend: str = ""  # dist's backend: gloo or nccl ("": nccl on GPU, gloo on CPU)
    kv_address: str = ""  # dist: the host name prefill servers reach this decode server's KV receiver at
    shared_key: bool = False  # the internal key comes from a given file (shared by the deployment's servers)
    exit_timeout: int = EXIT_TIMEOUT_S  # tritonserver --exit-timeout-secs

    @property
    def models(self) -> tuple[str, ...]:
        return ROLE_MODELS[self.role]

    @classmethod
    def from_args(cls, a, n_gpus: int) -> Deployment:
        """From `triton-pd serve`'s parsed options on a machine with `n_gpus` GPUs: resolves the model (converting
        it once, before several processes want it) and sizes the pools."""
        from .common import loader

        cfg = loader.load_config(loader.resolve(a.model))
        gpu = a.device == "gpu" or (a.device == "auto" and n_gpus > 0)
        dtype = a.dtype or ("bfloat16" if gpu else "float32")
        workdir = Path(a.workdir or PROJECT_ROOT / ".run" / f"serve-{a.http_port}").resolve()
        deployment_id = secrets.token_hex(4)
        per_token = kv_bytes_per_token(cfg, dtype)
        kv_tokens = a.kv_tokens or (
            kv_tokens_for_gpu(per_token, a.kv_memory_fraction, parse_gpus(a.decode_gpus)[0]) if gpu else 16384
        )
        if gpu and cfg.is_hybrid and not a.kv_tokens:  # the state pages share the same fraction of the GPU
            kv_tokens = max(1024, kv_tokens - state_bytes(cfg, getattr(a, "state_pages", 0), a.max_batch) // per_token)
        if getattr(a, "exit_timeout", EXIT_TIMEOUT_S) < 0:
            raise ValueError("--exit-timeout: must be >= 0 seconds")
        rotation_wait = getattr(a, "rotation_wait", 0.3)
        for flag, value in (("--rotation-quantum", a.rotation_quantum), ("--rotation-wait", rotation_wait)):
            if value < 0:
                raise ValueError(f"{flag}: must be >= 0 seconds, got {value}")
        host_kv = a.host_kv_tokens
        if host_kv is None:
            host_kv = 0 if cfg.is_hybrid else default_host_kv_tokens(per_token, kv_tokens, a.decode_instances)
        role, urls = _role_urls(a)
        timeout = a.request_timeout
        if timeout is None:
            timeout = float(os.environ.get("PD_REQUEST_TIMEOUT_SECONDS", "1800"))
        return cls(
            model=a.model,
            dtype=dtype,
            gpu=gpu,
            workdir=workdir,
            deployment_id=deployment_id,
            key_file=Path(key).resolve()
            if (key := getattr(a, "internal_key_file", None))
            else workdir / "internal_key",
            mailbox=Path("/dev/shm") / f"triton-pd-{deployment_id}",
            kv_tokens=kv_tokens,
            host_kv_tokens=host_kv,
            prefill_kv_tokens=a.prefill_kv_tokens or (131072 if gpu else max(8192, 2 * cfg.max_position_embeddings)),
            cpu_threads=a.cpu_threads
            or cpu_threads_per_instance(
                (a.prefill_instances if role in ("all", "prefill") else 0)
                + (a.decode_instances if role in ("all", "decode") else 0)
            ),
            exit_timeout=getattr(a, "exit_timeout", EXIT_TIMEOUT_S),
            request_timeout=timeout,
            decode_groups=instance_groups(a.decode_instances, gpu, a.decode_gpus, n_gpus, "--decode-gpus"),
            prefill_groups=instance_groups(a.prefill_instances, gpu, a.prefill_gpus, n_gpus, "--prefill-gpus"),
            prefill_instances=a.prefill_instances,
            decode_instances=a.decode_instances,
            max_batch=a.max_batch,
            chunk_size=a.chunk_size,
            max_prefill_tokens=a.max_prefill_tokens,
            max_inflight=a.max_inflight,
            max_streams=a.max_streams
            or default_max_streams(a.decode_instances * max(1, len(urls["decode"])), a.max_batch),
            on_decode_oom=a.on_decode_oom,
            pause_policy=a.pause_policy,
            fault_injection=a.fault_injection,
            stall_seconds=a.stall_seconds,
            rotation_quantum=a.rotation_quantum,
            rotation_prefetch=getattr(a, "rotation_prefetch", "off"),
            rotation_wait=rotation_wait,
            decode_overlap=a.decode_overlap,
            state_pages=getattr(a, "state_pages", 0) or 0,
            speculative=_speculative(getattr(a, "speculative", "off"), cfg),
            role=role,
            decode_urls=",".join(urls["decode"]),
            prefill_urls=",".join(urls["prefill"]),
            kv_transport=getattr(a, "kv_transport", None) or ("dist" if role == "decode" else "ipc"),
            kv_backend="" if getattr(a, "kv_backend", "auto") == "auto" else a.kv_backend,
            kv_address=getattr(a, "kv_address", None) or (socket.gethostname() if role == "decode" else "127.0.0.1"),
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
        """The ${NAME} values of model_repository/*/config.pbtxt."""
        return {
            "PROJECT_ROOT": str(PROJECT_ROOT),
            "MODEL": self.model,
            "DTYPE": self.dtype,
            "DEPLOYMENT": self.deployment_id,
            "KEY_FILE": str(self.key_file),
            "MAILBOX_DIR": str(self.mailbox),
            "KV_TOKENS": str(self.kv_tokens),
            "PREFILL_KV_TOKENS": str(self.prefill_kv_tokens),
            "MAX_BATCH": str(self.max_batch),
            "CPU_THREADS": str(self.cpu_threads),
            "CHUNK_SIZE": str(self.chunk_size),
            "MAX_PREFILL_TOKENS": str(self.max_prefill_tokens),
            "MAX_INFLIGHT": str(self.max_inflight),
            "MAX_STREAMS": str(self.max_streams),
            "REQUEST_TIMEOUT": str(self.request_timeout),
            "ON_DECODE_OOM": self.on_decode_oom,
            "PAUSE_POLICY": self.pause_policy,
            "FAULT_INJECTION": self.fault_injection,
            "STALL_SECONDS": str(self.stall_seconds),
            "HOST_KV_TOKENS": str(self.host_kv_tokens),
            "ROTATION_QUANTUM": str(self.rotation_quantum),
            "ROTATION_PREFETCH": self.rotation_prefetch,
            "ROTATION_WAIT": str(self.rotation_wait),
            "DECODE_OVERLAP": self.decode_overlap,
            "STATE_PAGES": str(self.state_pages),
            "SPECULATIVE": self.speculative,
            "MASTER_INSTANCES": "1",
            "DECODE_GROUPS": self.decode_groups,
            "PREFILL_GROUPS": self.prefill_groups,
            "DECODE_URLS": self.decode_urls,
            "PREFILL_URLS": self.prefill_urls,
            "KV_TRANSPORT": self.kv_transport,
            "KV_BACKEND": self.kv_backend,
            "KV_ADDRESS": self.kv_address,
        }

    def summary(self) -> str:
        if self.role == "master":
            return f"role master: model {self.model} (its tokenizer), decode servers {self.decode_urls}"
        if self.role == "prefill":
            return f"role prefill: model {self.model} ({self.dtype}), {self.prefill_instances} prefill instance(s)"
        if self.role == "decode":
            instances = (
                f"{self.decode_instances} decode instance(s), prefill servers {self.prefill_urls}, KV over "
                f"{self.kv_transport}"
            )
        else:
            instances = f"{self.prefill_instances} prefill + {self.decode_instances} decode instance(s)"
        return (
            f"model {self.model} ({self.dtype}, {'GPU' if self.gpu else 'CPU'}), {instances}, decode KV pool "
            f"{self.kv_tokens} tokens, on_decode_oom={self.on_decode_oom}, {self.cpu_threads} CPU thread(s) per "
            f"instance, {self.max_streams} decode streams"
        )
