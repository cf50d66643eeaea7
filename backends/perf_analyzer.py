"""`triton-pd perf-analyzer ARGS...`: Triton's perf_analyzer from this environment, runnable as installed.

The `tritonclient` manylinux wheel puts a `perf_analyzer` binary in the environment's bin/ that links
`libcudart.so.12` (even for a CPU-only run), and ships that library only under another name, inside
`nvidia_pytriton.libs/` of the `nvidia-pytriton` wheel. This command makes a `libcudart.so.12` link to it in a
folder of the environment (once), puts that folder on `LD_LIBRARY_PATH` and runs perf_analyzer with the given
arguments unchanged, so its exit status and output are perf_analyzer's own."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
from pathlib import Path

LIB_NAME = "libcudart.so.12"


def binary() -> Path:
    """The perf_analyzer next to this Python, else the first on PATH."""
    here = Path(sys.executable).parent / "perf_analyzer"
    if here.exists():
        return here
    found = shutil.which("perf_analyzer")
    if found is None:
        raise FileNotFoundError("perf_analyzer: not found (it comes with tritonclient[all]; run `make setup`)")
    return Path(found)


def bundled_cudart() -> Path | None:
    """The CUDA runtime that nvidia-pytriton ships (libcudart-<hash>.so.12.*), or None."""
    libs = Path(sysconfig.get_paths()["purelib"]) / "nvidia_pytriton.libs"
    found = sorted(libs.glob("libcudart-*.so.12*"))
    return found[0] if found else None


def library_dir(base: Path | None = None) -> Path | None:
    """A folder holding a `libcudart.so.12` link to the bundled runtime (made on first use), or None when the
    environment has no bundled runtime (a system one may still be found by the loader)."""
    target = bundled_cudart()
    if target is None:
        return None
    folder = base or Path(sys.prefix) / "lib" / "triton-pd-perf-analyzer"
    link = folder / LIB_NAME
    if not (link.is_symlink() and link.resolve() == target.resolve()):
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{LIB_NAME}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        tmp.replace(link)  # atomic: two first runs at once both end with the same link
    return folder


def command(args: list[str]) -> tuple[list[str], dict]:
    """(argv, environment) that run perf_analyzer with `args`."""
    env = dict(os.environ)
    lib = library_dir()
    if lib is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p)
    return [str(binary()), *args], env


def cmd_perf_analyzer(a: argparse.Namespace) -> int:
    try:
        argv, env = command(a.args)
    except FileNotFoundError as e:
        print(f"triton-pd: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execve(argv[0], argv, env)
    return 0  # not reached


def register(sub) -> None:
    p = sub.add_parser(
        "perf-analyzer",
        help="run Triton's perf_analyzer from this environment (its CUDA runtime resolved); arguments go to it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        prefix_chars="\0",  # every argument, dashes included, is perf_analyzer's
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="perf_analyzer's arguments, e.g. -m pd_master -u HOST:PORT")
    p.set_defaults(func=cmd_perf_analyzer)
