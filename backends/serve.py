"""`triton-pd serve`: lay out the Python backend, render the model repository with this deployment's settings,
start tritonserver, show progress until every model is ready, and shut down cleanly on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import glob
import os
import secrets
import shutil
import signal
import string
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MODELS = ("pd_master", "pd_decode", "pd_prefill")
EXIT_TIMEOUT_S = 20  # tritonserver --exit-timeout-secs: how long its shutdown waits for requests in flight


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model with prefill/decode disaggregation on tritonserver",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="smollm2, a Hugging Face folder, a .gguf file or random:<shape>")
    p.add_argument("--dtype", default=None, help="weights and KV dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="where prefill and decode instances run (auto: GPU when one exists)",
    )
    p.add_argument("--prefill-instances", type=int, default=1, help="prefill model instances")
    p.add_argument("--decode-instances", type=int, default=1, help="decode model instances")
    p.add_argument("--prefill-gpus", default="0", help="comma-separated GPU ids for prefill instances (round robin)")
    p.add_argument("--decode-gpus", default="0", help="comma-separated GPU ids for decode instances (round robin)")
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="decode KV pool size in tokens per instance (default: 16384 on CPU; on GPU from --kv-memory-fraction)",
    )
    p.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=0.5,
        help="GPU only: fraction of the GPU's memory for one decode instance's KV pool",
    )
    p.add_argument(
        "--prefill-kv-tokens",
        type=int,
        default=None,
        help="prefill's own KV pool (its prefix cache) in tokens (default: max(8192, 2 x context) on "
        "CPU, 131072 on GPU)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        help="torch threads of each prefill and decode instance; 0: the usable cores divided among the instances, "
        "at least 1 (more threads than cores between them make each step many times slower)",
    )
    p.add_argument("--max-batch", type=int, default=256, help="decode: requests decoded together at most")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill: chunk size in tokens")
    p.add_argument("--max-prefill-tokens", type=int, default=4096, help="prefill: tokens per forward pass at most")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=1024,
        help="master: requests in flight before new ones are answered UNAVAILABLE (server busy)",
    )
    p.add_argument(
        "--max-streams",
        type=int,
        default=64,
        help="master: decode streams open at once; further requests wait in master (their wait counts in TTFT "
        "and in the deadline). Also sizes the Python backend's thread pool (this + 64). Keep it moderate: with "
        "120-200 concurrent streams master's stub has crashed in Triton 2.51 (README, operating notes)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="total deadline per request in seconds, pauses included; negative disables (default: "
        "$PD_REQUEST_TIMEOUT_SECONDS or 1800)",
    )
    p.add_argument(
        "--on-decode-oom",
        choices=["pause", "restart"],
        default="pause",
        help="when decode runs out of KV: pause and recover (default), or end the segment and let master "
        "re-submit prompt + generated ids, recomputed from scratch (the naive baseline, for comparisons)",
    )
    p.add_argument(
        "--pause-policy",
        choices=["latest", "oldest", "longest"],
        default="latest",
        help="which running request decode pauses first",
    )
    p.add_argument(
        "--fault-injection",
        default="",
        help="testing only, comma-separated: 'stale' makes decode re-deliver each recovery completion "
        "under an old epoch; 'drop_paused_kv' keeps no paused KV, forcing prefill recovery; 'slow_prefill' makes "
        "prefill wait 3 s before each batch (cancellations still end its jobs)",
    )
    p.add_argument(
        "--host-kv-tokens",
        type=int,
        default=None,
        help="decode's host-memory KV tier in tokens per instance: paused requests' KV is copied there and swapped "
        "back in instead of recomputed (pinned memory on a GPU). Default: 4 x --kv-tokens, within a quarter of "
        "this machine's memory shared by the decode instances; 0 disables it",
    )
    p.add_argument(
        "--rotation-quantum",
        type=float,
        default=0.1,
        help="seconds: while decode's pool is over-committed, a request paused this long takes the place of "
        "requests that have run this long since they resumed, and paused requests resume in the order they "
        "paused, so no answer stalls for long. 0: a paused request waits until there is room",
    )
    p.add_argument(
        "--stall-seconds",
        type=float,
        default=30.0,
        help="decode reports (log and pd_decode_stalls_total) when requests wait and nothing progresses this "
        "long; 0 disables",
    )
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument(
        "--tritonserver",
        default=None,
        help="tritonserver binary (default: the one bundled in the nvidia-pytriton wheel)",
    )
    p.add_argument(
        "--backend-dir",
        default=None,
        help="Triton backends folder holding python/ (default: laid out from nvidia-pytriton)",
    )
    p.add_argument("--workdir", default=None, help="deployment folder (default: .run/serve-<http port>)")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for every model to be ready")
    p.add_argument("--shm-mb", type=int, default=256, help="Python backend shared-memory pool per model instance")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.set_defaults(func=cmd_serve)


@dataclass
class Layout:
    tritonserver: Path
    backend_dir: Path
    lib_dirs: list[Path]


def pytriton_layout(workdir: Path) -> Layout:
    """The tritonserver bundled in nvidia-pytriton, with a backends/python/ folder for the running Python."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "triton-pd: error: nvidia-pytriton is not installed (run `make setup`) and no --tritonserver was given"
        )
    base = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    libs = base.parent.parent / "nvidia_pytriton.libs"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = base / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.exists():
        raise SystemExit(f"triton-pd: error: no Python backend stub for Python {ver} in {base}")
    be = workdir / "backends"
    py = be / "python"
    py.mkdir(parents=True, exist_ok=True)
    for src in (
        base / "backends/python/libtriton_python.so",
        base / "backends/python/triton_python_backend_utils.py",
        stub,
    ):
        dst = py / src.name
        if not dst.exists():
            shutil.copy2(src, dst)
    return Layout(base / "bin" / "tritonserver", be, [libs])


def render(workdir: Path, values: dict[str, str]) -> Path:
    repo = workdir / "models"
    if repo.exists():
        shutil.rmtree(repo)
    for name in MODELS:
        src = PROJECT_ROOT / "model_repository" / name
        (repo / name / "1").mkdir(parents=True)
        shutil.copy2(src / "1" / "model.py", repo / name / "1" / "model.py")
        text = string.Template((src / "config.pbtxt").read_text()).substitute(values)
        (repo / name / "config.pbtxt").write_text(text)
    return repo


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


def kv_bytes_per_token(cfg, dtype: str) -> int:
    import torch

    from .common.runner import parse_dtype

    itemsize = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def kv_tokens_for_gpu(per_token: int, fraction: float, device: int = 0) -> int:
    import torch

    return int(torch.cuda.get_device_properties(device).total_memory * fraction // per_token)


def default_host_kv_tokens(per_token: int, kv_tokens: int, instances: int = 1) -> int:
    """Four times the device pool (paused requests outnumber running ones when the pool is over-committed), within
    a quarter of physical memory shared by the decode instances (pinned memory cannot be swapped out)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(4 * kv_tokens, ram // 4 // max(1, instances) // per_token)


def wait_ready(proc: subprocess.Popen, http_port: int, timeout: float, log_path: Path, stopping: list) -> None:
    t0, shown = time.monotonic(), set()
    url = f"http://127.0.0.1:{http_port}"
    while not stopping:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-30:]
            raise SystemExit(
                "triton-pd: error: tritonserver exited with status "
                f"{proc.returncode} before it was ready; last log lines:\n" + "\n".join(tail)
            )
        for m in MODELS:
            if m not in shown and _ok(f"{url}/v2/models/{m}/ready"):
                shown.add(m)
                print(f"[triton-pd] {m} ready ({time.monotonic() - t0:.0f} s)", flush=True)
        if len(shown) == len(MODELS) and _ok(f"{url}/v2/health/ready"):
            return
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"triton-pd: error: models not ready after {timeout:.0f} s (see {log_path})")
        time.sleep(0.5)


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def cmd_serve(a: argparse.Namespace) -> int:
    from .common import loader

    loader.resolve(a.model)  # validate and convert once, before several processes want it
    n_gpus = gpu_count()
    gpu = a.device == "gpu" or (a.device == "auto" and n_gpus > 0)
    dtype = a.dtype or ("bfloat16" if gpu else "float32")
    workdir = Path(a.workdir or PROJECT_ROOT / ".run" / f"serve-{a.http_port}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    deployment = secrets.token_hex(4)
    key_file = workdir / "internal_key"
    key_file.write_text(secrets.token_hex(24))
    key_file.chmod(0o600)
    mailbox = Path("/dev/shm") / f"triton-pd-{deployment}"
    cfg = loader.load_config(loader.resolve(a.model))
    per_token = kv_bytes_per_token(cfg, dtype)
    kv_tokens = a.kv_tokens or (
        kv_tokens_for_gpu(per_token, a.kv_memory_fraction, parse_gpus(a.decode_gpus)[0]) if gpu else 16384
    )
    host_kv = (
        a.host_kv_tokens
        if a.host_kv_tokens is not None
        else default_host_kv_tokens(per_token, kv_tokens, a.decode_instances)
    )
    prefill_kv = a.prefill_kv_tokens or (131072 if gpu else max(8192, 2 * cfg.max_position_embeddings))
    timeout = (
        a.request_timeout
        if a.request_timeout is not None
        else float(os.environ.get("PD_REQUEST_TIMEOUT_SECONDS", "1800"))
    )
    cpu_threads = a.cpu_threads or cpu_threads_per_instance(a.prefill_instances + a.decode_instances)
    values = {
        "PROJECT_ROOT": str(PROJECT_ROOT),
        "MODEL": a.model,
        "DTYPE": dtype,
        "DEPLOYMENT": deployment,
        "KEY_FILE": str(key_file),
        "MAILBOX_DIR": str(mailbox),
        "KV_TOKENS": str(kv_tokens),
        "PREFILL_KV_TOKENS": str(prefill_kv),
        "MAX_BATCH": str(a.max_batch),
        "CPU_THREADS": str(cpu_threads),
        "CHUNK_SIZE": str(a.chunk_size),
        "MAX_PREFILL_TOKENS": str(a.max_prefill_tokens),
        "MAX_INFLIGHT": str(a.max_inflight),
        "MAX_STREAMS": str(a.max_streams),
        "REQUEST_TIMEOUT": str(timeout),
        "ON_DECODE_OOM": a.on_decode_oom,
        "PAUSE_POLICY": a.pause_policy,
        "FAULT_INJECTION": a.fault_injection,
        "STALL_SECONDS": str(a.stall_seconds),
        "HOST_KV_TOKENS": str(host_kv),
        "ROTATION_QUANTUM": str(a.rotation_quantum),
        "MASTER_INSTANCES": "1",
        "DECODE_GROUPS": instance_groups(a.decode_instances, gpu, a.decode_gpus, n_gpus, "--decode-gpus"),
        "PREFILL_GROUPS": instance_groups(a.prefill_instances, gpu, a.prefill_gpus, n_gpus, "--prefill-gpus"),
    }
    repo = render(workdir, values)
    if a.tritonserver:
        layout = Layout(Path(a.tritonserver), Path(a.backend_dir or "/opt/tritonserver/backends"), [])
    else:
        layout = pytriton_layout(workdir)
        if a.backend_dir:
            layout.backend_dir = Path(a.backend_dir)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # the stub takes the first python3
    env["LD_LIBRARY_PATH"] = ":".join([str(p) for p in layout.lib_dirs] + [env.get("LD_LIBRARY_PATH", "")])
    env["PD_REQUEST_TIMEOUT_SECONDS"] = str(timeout)
    cmd = os.environ.get("TRITON_PD_DEBUG_WRAP", "").split() + [
        str(layout.tritonserver),
        f"--model-repository={repo}",
        f"--backend-directory={layout.backend_dir}",
        f"--http-port={a.http_port}",
        f"--grpc-port={a.grpc_port}",
        f"--metrics-port={a.metrics_port}",
        "--allow-metrics=true",
        "--exit-on-error=true",
        "--strict-readiness=true",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        f"--log-verbose={a.log_verbose}",
        # a pool large enough not to grow under load (growth of the Python backend's pool under concurrent BLS
        # traffic is where 2.51 has crashed for us); tensors are small, so this is address space, not RAM
        f"--backend-config=python,shm-default-byte-size={a.shm_mb << 20}",
        "--backend-config=python,shm-growth-byte-size=67108864",
        # One thread of this pool (per model instance, in tritonserver) is held by every BLS call until its first
        # response, and the same pool sends every decoupled response. Master holds at most --max-streams decode
        # streams, so a pool smaller than that starves master's sends to clients: with the default (32), 200
        # concurrent streams stalled every answer until some finished. A pool of --max-inflight + 64 (1088
        # threads) let 200 clients on 2 cores crash tritonserver (boost::interprocess::lock_exception).
        f"--backend-config=python,thread-pool-size={a.max_streams + 64}",
    ]
    log_path = workdir / "tritonserver.log"
    print(
        f"[triton-pd] model {a.model} ({dtype}, {'GPU' if gpu else 'CPU'}), {a.prefill_instances} prefill + "
        f"{a.decode_instances} decode instance(s), decode KV pool {kv_tokens} tokens, on_decode_oom="
        f"{a.on_decode_oom}, {cpu_threads} CPU thread(s) per instance",
        flush=True,
    )
    print(f"[triton-pd] starting tritonserver (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    stopping = []

    def on_signal(signum, frame):
        # only signal here: the main thread may be inside proc.wait(), whose lock a handler must not take
        if not stopping:
            stopping.append(signum)
            print("\n[triton-pd] shutting down (again to force)", flush=True)
            _signal_group(proc, signal.SIGTERM, group=False)
        else:
            _signal_group(proc, signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stubs: dict[str, tuple[int, str]] = {}
    died = None
    try:
        wait_ready(proc, a.http_port, a.ready_timeout, log_path, stopping)
        if not stopping:
            print(
                f"[triton-pd] ready: HTTP :{a.http_port}  gRPC :{a.grpc_port}  metrics :{a.metrics_port}/metrics",
                flush=True,
            )
            print(
                "[triton-pd] try:\n"
                f"  {Path(sys.executable).parent}/triton-pd generate --url 127.0.0.1:{a.grpc_port} --chat "
                '--prompt "What is the capital of France?" --temperature 0\n'
                f"  curl -s -X POST 127.0.0.1:{a.http_port}/v2/models/pd_master/generate_stream "
                '-d \'{"text_input": "What is the capital of France?", "apply_chat_template": true, '
                '"stream": true, "sampling_parameters": "{\\"temperature\\": 0, \\"max_tokens\\": 32}"}\'',
                flush=True,
            )
        if not stopping:
            stubs = python_stubs(proc.pid)
        # Triton 2.51 neither restarts a dead Python stub nor fails the requests it held: with master's or a decode
        # instance's stub gone, the client streams through it would hang for ever. Stop instead, so that clients see
        # an error and a supervisor can restart the server. (A dead prefill instance fails its jobs at once:
        # decode reports them, and the server keeps serving.)
        watched = {name: pid for name, (pid, _) in stubs.items() if name.startswith(("pd_master", "pd_decode"))}
        kill_at = None
        while True:
            try:
                rc = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                pass
            if kill_at is not None and time.monotonic() > kill_at:
                _signal_group(proc, signal.SIGKILL)  # its shutdown waits for requests the dead stub will never end
            if died is None and not stopping:
                died = next((name for name, pid in watched.items() if not process_alive(pid)), None)
                if died is not None:
                    print(
                        f"[triton-pd] {died}'s stub (pid {watched[died]}) died and Triton does not restart it: "
                        f"stopping the server (see {log_path})",
                        flush=True,
                    )
                    _signal_group(proc, signal.SIGTERM, group=False)
                    kill_at = time.monotonic() + EXIT_TIMEOUT_S + 10
    finally:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        _signal_group(proc, signal.SIGKILL)  # stub processes left behind by a crash
        cleanup(deployment, mailbox, [region for _, region in stubs.values()])
    if died is not None:
        print(f"triton-pd: error: {died}'s stub died (see {log_path})", file=sys.stderr)
        return 1
    if stopping:
        print("[triton-pd] stopped", flush=True)
        return 0
    print(f"triton-pd: error: tritonserver exited with status {rc} (see {log_path})", file=sys.stderr)
    return 1


def python_stubs(server_pid: int) -> dict[str, tuple[int, str]]:
    """The Python stubs tritonserver `server_pid` runs, from /proc: instance name -> (pid, name of the stub's
    shared-memory region in /dev/shm)."""
    stubs = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            if int(_stat_fields(stat)[1]) != server_pid:  # the parent pid
                continue
            with open(stat[: -len("stat")] + "cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().rstrip(b"\0").split(b"\0")]
        except (OSError, IndexError, ValueError, UnicodeDecodeError):
            continue
        # stub, model.py, shm region, shm sizes, parent pid, backend dir, ..., instance name, execution env
        if len(argv) >= 4 and argv[0].endswith("triton_python_backend_stub"):
            stubs[argv[-2]] = (int(stat.split("/")[2]), argv[2])
    return stubs


def process_alive(pid: int) -> bool:
    """False once the process is gone or a zombie (tritonserver does not reap a stub that died)."""
    try:
        return _stat_fields(f"/proc/{pid}/stat")[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _stat_fields(path: str) -> list[str]:
    """The fields of a /proc/<pid>/stat after the command name (which may hold spaces): state, parent pid, ..."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def _signal_group(proc: subprocess.Popen, sig: int, group: bool = True) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


def cleanup(deployment: str, mailbox: Path, stub_regions: tuple[str, ...] | list[str] = ()) -> None:
    """Shared-memory segments and the mailbox of this deployment, even if a stub died without finalize(), and the
    stubs' own regions, which tritonserver removes only when it stops cleanly."""
    shutil.rmtree(mailbox, ignore_errors=True)
    regions = [f"/dev/shm/{r}" for r in stub_regions if r.startswith("triton_python_backend_shm_region")]
    for path in glob.glob(f"/dev/shm/tpd_{deployment}_*") + regions:
        try:
            os.unlink(path)
        except OSError:
            pass
