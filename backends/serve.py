"""`triton-pd serve`: its options, and the composition of the three pieces that serve a deployment: what it is
(`deployment.Deployment`, values), how tritonserver is invoked for it (`tritonserver`), and the process that
watches the server until it stops (`supervisor.Supervisor`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .common.core.role_config import add_options
from .deployment import EXIT_TIMEOUT_S, Deployment, gpu_count
from .supervisor import PARENT_ENV, Supervisor, ports_in_use, stop_with_process
from .tritonserver import Ports, command, environment, layout_for, render


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model with prefill/decode disaggregation on tritonserver",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_deployment_options(p)
    add_address_option(p)
    p.add_argument("--http-port", type=int, default=8000, help="Triton's HTTP endpoint (generate_stream)")
    p.add_argument("--grpc-port", type=int, default=8001, help="Triton's gRPC endpoint (streaming clients)")
    p.add_argument("--metrics-port", type=int, default=8002, help="Triton's Prometheus metrics (/metrics)")
    p.add_argument(
        "--openai-port",
        type=int,
        default=0,
        help="also serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) on this port, "
        "over pd_master's gRPC port (backends/openai_frontend.py; --role all or master); 0: none",
    )
    add_server_options(p)
    p.add_argument("--workdir", default=None, help="deployment folder (default: .run/serve-<http port>)")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for every model to be ready")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.set_defaults(func=cmd_serve)


def add_address_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default="0.0.0.0",
        help="the address the HTTP, gRPC, metrics and OpenAI endpoints bind (Triton's --http-address, --grpc-address "
        "and --metrics-address): 0.0.0.0, every interface, as Triton's default; 127.0.0.1 serves this host only",
    )


def add_server_options(p: argparse.ArgumentParser) -> None:
    """How tritonserver is run: the binary, its backends and the Python backend's shared memory."""
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
    p.add_argument("--shm-mb", type=int, default=256, help="Python backend shared-memory pool per model instance")


def add_deployment_options(p: argparse.ArgumentParser) -> None:
    """What a deployment is: the model, its pools and limits, the roles (shared by serve and repository). The
    options that set a role's config are generated from its fields (`role_config.add_options`)."""
    add_options(p, ["model", "dtype", "quantization"])
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
    add_options(p, ROLE_OPTIONS)
    p.add_argument(
        "--exit-timeout",
        type=int,
        default=EXIT_TIMEOUT_S,
        help="seconds tritonserver's shutdown waits for requests in flight (--exit-timeout-secs; after a master or "
        "decode stub died, the launcher kills it 2 s after stopping it)",
    )
    m = p.add_argument_group(
        "multi-server deployments (master, prefill and decode in tritonservers of their own, on one host or several)"
    )
    m.add_argument(
        "--role",
        choices=["all", "master", "decode", "prefill"],
        default="all",
        help="the models this server runs: all three (one server), or one role; a role needs --internal-key-file",
    )
    add_options(m, ["decode_urls", "prefill_urls"])
    m.add_argument(
        "--internal-key-file",
        default=None,
        help="the deployment's internal key, the same file (copied) on every server of it; `triton-pd key FILE` "
        "writes one. Default with --role all: a new key per start",
    )
    add_options(m, ["kv_transport", "kv_backend", "kv_address"])


# the role-config options of the main group, in --help's order (the rest: model, dtype and the multi-server group)
ROLE_OPTIONS = [
    "kv_tokens", "kv_memory_fraction", "prefill_kv_tokens", "cpu_threads", "max_batch", "chunk_size",
    "max_prefill_tokens", "prefill_max_batch", "prefill_concurrency", "max_inflight", "max_streams",
    "request_timeout", "on_decode_oom", "pause_policy", "fault_injection", "host_kv_tokens", "rotation_quantum",
    "rotation_wait", "rotation_turns", "rotation_victims", "rotation_prefetch", "decode_overlap", "speculative",
    "state_pages", "deterministic", "stall_seconds", "max_images_per_request", "max_image_pixels", "prefill_tp",
    "decode_tp",
]  # fmt: skip


def cmd_serve(a: argparse.Namespace) -> int:
    try:
        dep = Deployment.from_args(a, gpu_count())
        dep.write_key()
    except ValueError as e:  # options that contradict each other or the model (the message names the option)
        print(f"triton-pd: error: {e}", file=sys.stderr)
        return 2
    ports = Ports(a.http_port, a.grpc_port, a.metrics_port, a.address)
    wanted = {"--http-port": ports.http, "--grpc-port": ports.grpc, "--metrics-port": ports.metrics}
    if a.openai_port:
        if dep.role not in ("all", "master"):
            print("triton-pd: error: --openai-port: needs pd_master (--role all or master)", file=sys.stderr)
            return 2
        wanted["--openai-port"] = a.openai_port
    busy = ports_in_use(wanted, a.address)
    if busy:  # tritonserver would load every model, then fail to bind while another server answers on the port
        print(f"triton-pd: error: {', '.join(busy)}: already in use by another process", file=sys.stderr)
        return 2
    repo = render(dep.workdir / "models", dep.template_values(), dep.models)
    layout = layout_for(dep.workdir, a.tritonserver, a.backend_dir)
    log_path = dep.workdir / "tritonserver.log"
    print(f"[triton-pd] {dep.summary()}", flush=True)
    print(f"[triton-pd] starting tritonserver (log: {log_path})", flush=True)
    sup = Supervisor(command(layout, repo, ports, dep, a.shm_mb, a.log_verbose), environment(layout, dep), log_path,
                     ports.http, dep.models, exit_timeout=dep.exit_timeout, host=ports.host)  # fmt: skip
    frontend = None
    if os.environ.get(PARENT_ENV, "").isdigit():  # started by a script (ServerProcess): stop when it is gone
        stop_with_process(int(os.environ[PARENT_ENV]))
    try:
        if sup.wait_ready(a.ready_timeout):
            if a.openai_port:
                frontend = start_openai(dep, ports, a.openai_port)
            print_ready(ports, dep.role, a.openai_port)
        rc = sup.watch()
    finally:
        if frontend is not None:
            frontend.terminate()
            try:
                frontend.wait(timeout=10)
            except Exception:
                frontend.kill()
        sup.close(dep.deployment_id, dep.mailbox)
    if sup.died is not None:
        print(f"triton-pd: error: {sup.died}'s stub died (see {log_path})", file=sys.stderr)
        return 1
    if sup.stopping:
        print("[triton-pd] stopped", flush=True)
        return 0
    print(f"triton-pd: error: tritonserver exited with status {rc} (see {log_path})", file=sys.stderr)
    return 1


def start_openai(dep, ports: Ports, port: int):
    """The OpenAI-compatible front end as a child process over pd_master's gRPC port; it ends with the launcher
    however the launcher ends (parent-death signal), and is stopped with the server."""
    import os
    import subprocess

    from .supervisor import die_with_parent

    log = open(dep.workdir / "openai_frontend.log", "ab")
    cmd = [sys.executable, "-m", "backends.openai_frontend", "--grpc-url", f"{ports.host}:{ports.grpc}", "--model",
           dep.model, "--host", ports.address, "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent,
                            preexec_fn=die_with_parent(os.getpid()))  # fmt: skip
    log.close()
    import time
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:  # answering before "ready" is printed
        if proc.poll() is not None:
            print(f"triton-pd: error: the OpenAI front end exited (see {dep.workdir / 'openai_frontend.log'})",
                  file=sys.stderr)  # fmt: skip
            return None
        try:
            with urllib.request.urlopen(f"http://{ports.host}:{port}/v1/models", timeout=2):
                return proc
        except OSError:
            time.sleep(0.2)
    print("triton-pd: error: the OpenAI front end did not answer within 120 s", file=sys.stderr)
    return proc


def print_ready(ports: Ports, role: str = "all", openai_port: int = 0) -> None:
    if role != "all":
        print(f"[triton-pd] ready ({role}): HTTP :{ports.http}  gRPC :{ports.grpc}  metrics :{ports.metrics}/metrics",
              flush=True)  # fmt: skip
        return
    openai = f"  OpenAI :{openai_port}/v1" if openai_port else ""
    print(f"[triton-pd] ready: HTTP :{ports.http}  gRPC :{ports.grpc}  metrics :{ports.metrics}/metrics{openai}",
          flush=True)  # fmt: skip
    print(
        "[triton-pd] try:\n"
        f"  {Path(sys.executable).parent}/triton-pd generate --url {ports.host}:{ports.grpc} --chat "
        '--prompt "What is the capital of France?" --temperature 0\n'
        f"  curl -s -X POST {ports.host}:{ports.http}/v2/models/pd_master/generate_stream "
        '-d \'{"text_input": "What is the capital of France?", "apply_chat_template": true, '
        '"stream": true, "sampling_parameters": "{\\"temperature\\": 0, \\"max_tokens\\": 32}"}\'',
        flush=True,
    )


def register_key(sub) -> None:
    p = sub.add_parser("key", help="write a new internal key file for a multi-server deployment (--internal-key-file)")
    p.add_argument("file", help="where to write it (readable by this user only); copy it to every server")
    p.set_defaults(func=cmd_key)


def cmd_key(a: argparse.Namespace) -> int:
    import secrets

    path = Path(a.file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(secrets.token_hex(24))
    print(f"[triton-pd] internal key written to {path}", flush=True)
    return 0
