"""`triton-pd repository OUT [serve options]`: a model repository that a stock tritonserver serves.

`serve` renders the same repository into its work folder and starts tritonserver on it; this command only writes
it, with every parameter filled in and a copy of the project's code (`backends/`, `kernels/` and the pinned
requirements, in the first model's `code/` folder), so that a Triton user can start it their own way
(`tritonserver --model-repository OUT`, NVIDIA's container, a Helm chart). What a repository cannot hold is
printed and written to OUT/README.md: the Python that runs the models (with the pinned dependencies), and the
Python backend's settings that tritonserver takes only on its command line (`--backend-config`)."""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

from .deployment import PROJECT_ROOT, Deployment, gpu_count
from .tritonserver import MODELS, Ports, command, environment, layout_for, render

KEEP = {*MODELS, "internal_key", "README.md"}
CODE = "code"  # in the first model's folder (not a version number: Triton does not read it)
PACKAGES = ("backends", "kernels")


def copy_code(dst: Path) -> None:
    """This project's packages and its pinned requirements, so that the repository runs from a copy of itself."""
    if dst.exists():
        shutil.rmtree(dst)
    for pkg in PACKAGES:
        shutil.copytree(PROJECT_ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(PROJECT_ROOT / "requirements.lock", dst / "requirements.lock")


def server_command(dep: Deployment, repo: Path, a: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start tritonserver on `repo`: the given --tritonserver, else the one bundled in
    nvidia-pytriton with its Python backend laid out in this environment (outside the repository: every folder in
    a repository is a model)."""
    layout = layout_for(Path(sys.prefix) / "lib" / "triton-pd", a.tritonserver, a.backend_dir)
    argv = command(layout, repo, Ports(a.http_port, a.grpc_port, a.metrics_port, a.address), dep, a.shm_mb, 0)
    return argv, environment(layout, dep)


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    """argv as one shell line, with the variables the Python backend's stub needs (PATH: its `python3` is the
    first on PATH, and must be this environment's; LD_LIBRARY_PATH: the bundled server's libraries)."""
    keep = {k: env[k] for k in ("PATH", "LD_LIBRARY_PATH") if env.get(k)}
    keep["PATH"] = f"{Path(sys.executable).parent}:$PATH"
    lib = [p for p in keep.get("LD_LIBRARY_PATH", "").split(":") if p]
    if lib:
        keep["LD_LIBRARY_PATH"] = ":".join(lib) + ":$LD_LIBRARY_PATH"
    head = " ".join(f'{k}="{v}"' for k, v in keep.items())
    return f"{head} {shlex.join(argv)}"


README = """# A triton-pd model repository

Written by `{cmd}`
(model {model}, role {role}). Every setting is in the config.pbtxt files (each model's `config` parameter, one
JSON object: fields left out take `triton-pd serve`'s defaults); `internal_key` is the deployment's
internal key (keep it readable by the server's user only; the internal models refuse requests without it).

## Start it with the tritonserver bundled in this environment

```bash
{line}
```

## Start it with another tritonserver (NVIDIA's container, a Helm chart)

- The models import this project's code from `{root}` (their `project_root` parameter; a relative path is
  relative to each model's folder: the repository's own copy, so the folder can be moved or mounted anywhere).
  The Python that runs them must have the project's pinned dependencies (`{code}/requirements.lock`, numpy < 2
  included: `pip install -r` it into the container's Python, torch from the index that matches its CUDA), or be
  a conda-pack environment named by the models' `EXECUTION_ENV_PATH` parameter.
- Pass the Python backend's settings on tritonserver's command line; the repository cannot hold them:
  `{backend_config}`.
  The thread pool must be larger than the number of decode streams (`--max-streams` + 64): every decode stream
  holds one thread of it until its first response.
- Shared memory: the decode and prefill models hand KV over through `/dev/shm` (`{mailbox}`); in a container
  give it room (`--shm-size`).
"""


def cmd_repository(a: argparse.Namespace) -> int:
    out = Path(a.out).resolve()
    if out.exists() and (not out.is_dir() or any(p.name not in KEEP for p in out.iterdir())):
        print(f"triton-pd: error: {out}: exists and holds other files than a repository this command wrote",
              file=sys.stderr)  # fmt: skip
        return 2
    a.workdir = str(out)
    try:
        dep = Deployment.from_args(a, gpu_count())
        dep.write_key()
    except ValueError as e:
        print(f"triton-pd: error: {e}", file=sys.stderr)
        return 2
    values = dep.template_values()
    if a.project_root:
        root = str(Path(a.project_root).resolve())
    else:  # the code travels with the repository, found relative to each model's folder
        root = f"../{dep.models[0]}/{CODE}"
    values["PROJECT_ROOT"] = root
    render(out, values, dep.models, clean=False)
    if not a.project_root:
        copy_code(out / dep.models[0] / CODE)
    for name in set(MODELS) - set(dep.models):  # a role's repository holds only that role's models
        stale = out / name
        if stale.exists():
            shutil.rmtree(stale)
    argv, env = server_command(dep, out, a)
    line = shell_line(argv, env)
    backend_config = " ".join(x for x in argv if x.startswith("--backend-config=python"))
    cmd = "triton-pd repository " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["repository"] else [a.out])
    code = f"{dep.models[0]}/{CODE}" if not a.project_root else root
    text = README.format(cmd=cmd, model=dep.model, role=dep.role, line=line, root=root, code=code,
                         backend_config=backend_config, mailbox=dep.mailbox)  # fmt: skip
    (out / "README.md").write_text(text)
    print(f"[triton-pd] {dep.summary()}")
    print(f"[triton-pd] model repository written to {out} ({', '.join(dep.models)}); start it with:")
    print(f"  {line}")
    return 0


def register(sub) -> None:
    from .serve import add_address_option, add_deployment_options, add_server_options

    p = sub.add_parser(
        "repository",
        help="write a model repository (every parameter rendered) that a stock tritonserver serves",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", help="the repository folder to write (new, or one this command wrote before)")
    p.add_argument(
        "--project-root",
        default=None,
        help="where the models import this project's code from (default: a copy of it inside the repository, "
        "found relative to each model's folder, so the repository can move); or a checkout's path",
    )
    add_deployment_options(p)
    add_address_option(p)
    p.add_argument("--http-port", type=int, default=8000, help="for the printed command")
    p.add_argument("--grpc-port", type=int, default=8001, help="for the printed command")
    p.add_argument("--metrics-port", type=int, default=8002, help="for the printed command")
    add_server_options(p)
    p.set_defaults(func=cmd_repository)
