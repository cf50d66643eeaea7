"""How tritonserver is invoked for a deployment: the Python backend laid out for the running Python (from the
nvidia-pytriton wheel, or a given server), the model repository rendered from model_repository/, and the command
line and environment that start it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import string
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from .deployment import PROJECT_ROOT, Deployment

MODELS = ("pd_master", "pd_decode", "pd_prefill")


@dataclass
class Layout:
    tritonserver: Path
    backend_dir: Path
    lib_dirs: list[Path]


def pytriton_layout(workdir: Path) -> Layout:
    """The tritonserver bundled in nvidia-pytriton, with a backends/python/ folder for the running Python."""
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
    return Layout(base / "bin" / "tritonserver", be, [*python_lib_dir(), libs])


def python_lib_dir() -> list[Path]:
    """The folder of this Python's own libpython, when it has one (a Python built with --enable-shared, such as
    pyenv's): first on the stubs' library path, so that a stub embeds the interpreter whose standard library it
    imports. With the system's libpython instead (Debian's 3.11.2 under a 3.11.7), extension modules built for
    the newer patch release fail to load in the stub (`_ssl`: undefined symbol _PyModule_Add), and with them
    anything that imports ssl, transformers included."""
    libdir = sysconfig.get_config_var("LIBDIR")
    name = sysconfig.get_config_var("INSTSONAME") or ""
    system = libdir is None or libdir in ("/lib", "/usr/lib", "/usr/lib64") or libdir.startswith("/usr/lib/")
    if not system and name and (Path(libdir) / name).is_file():
        return [Path(libdir)]
    return []


def layout_for(workdir: Path, tritonserver: str | None, backend_dir: str | None) -> Layout:
    """A given tritonserver (with its backends folder), else the bundled one."""
    if tritonserver:
        return Layout(Path(tritonserver), Path(backend_dir or "/opt/tritonserver/backends"), [])
    layout = pytriton_layout(workdir)
    if backend_dir:
        layout.backend_dir = Path(backend_dir)
    return layout


def render(repo: Path, values: dict[str, str], models: tuple[str, ...] = MODELS, clean: bool = True) -> Path:
    """model_repository/ (the models this server runs) with the deployment's values, as the model repository
    `repo`: every ${NAME} of the config.pbtxt files filled in, each model's entry point copied. clean: remove
    `repo` first (else only the models' own folders are replaced)."""
    if clean and repo.exists():
        shutil.rmtree(repo)
    for name in models:
        if (repo / name).exists():
            shutil.rmtree(repo / name)
        src = PROJECT_ROOT / "model_repository" / name
        (repo / name / "1").mkdir(parents=True)
        shutil.copy2(src / "1" / "model.py", repo / name / "1" / "model.py")
        text = string.Template((src / "config.pbtxt").read_text()).substitute(values)
        (repo / name / "config.pbtxt").write_text(text)
    return repo


@dataclass(frozen=True)
class Ports:
    """The server's endpoints: their ports, and the address they bind (every interface by default, as Triton's)."""

    http: int
    grpc: int
    metrics: int
    address: str = "0.0.0.0"

    @property
    def host(self) -> str:
        """Where a client on this host reaches them: loopback when they bind every interface."""
        return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.address, self.address)


def command(layout: Layout, repo: Path, ports: Ports, dep: Deployment, shm_mb: int, log_verbose: int) -> list[str]:
    return os.environ.get("TRITON_PD_DEBUG_WRAP", "").split() + [
        str(layout.tritonserver),
        f"--model-repository={repo}",
        f"--backend-directory={layout.backend_dir}",
        f"--http-address={ports.address}",
        f"--http-port={ports.http}",
        f"--grpc-address={ports.address}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-address={ports.address}",
        f"--metrics-port={ports.metrics}",
        "--allow-metrics=true",
        "--exit-on-error=true",
        "--strict-readiness=true",
        f"--exit-timeout-secs={dep.exit_timeout}",
        f"--log-verbose={log_verbose}",
        # a pool large enough not to grow under load (growth of the Python backend's pool under concurrent BLS
        # traffic is where 2.51 has crashed for us); tensors are small, so this is address space, not RAM
        f"--backend-config=python,shm-default-byte-size={shm_mb << 20}",
        "--backend-config=python,shm-growth-byte-size=67108864",
        # One thread of this pool (per model instance, in tritonserver) is held by every BLS call until its first
        # response, and the same pool sends every decoupled response. Master holds at most --max-streams decode
        # streams, so a pool smaller than that starves master's sends to clients: with the default (32), 200
        # concurrent streams stalled every answer until some finished. A pool of --max-inflight + 64 (1088
        # threads) let 200 clients on 2 cores crash tritonserver (boost::interprocess::lock_exception).
        f"--backend-config=python,thread-pool-size={dep.max_streams + 64}",
    ]


def environment(layout: Layout, dep: Deployment) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # the stub takes the first python3
    env["LD_LIBRARY_PATH"] = ":".join([str(p) for p in layout.lib_dirs] + [env.get("LD_LIBRARY_PATH", "")])
    return env
