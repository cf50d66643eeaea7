"""`triton-pd bundle DIR`: an offline bundle for a GPU host that has Python, torch and triton but no package
registry (../shared/ENVIRONMENT.md): tritonserver trimmed to the host Python's stub, the numpy<2 overlay and the
client wheels, plus `bootstrap.sh`, which prepares it there and runs any project command in one line.

Built here from the installed nvidia-pytriton and wheels fetched with `pip download` for the host's Python (this
machine needs the registry; the GPU host does not)."""

from __future__ import annotations

import importlib.util
import io
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the overlay: numpy < 2 for the Python backend, the gRPC/HTTP client, and protobuf < 5 as tritonclient 2.50 needs
WHEELS = {
    "numpy==1.26.4": ["--implementation", "cp", "--platform", "manylinux2014_x86_64"],
    "tritonclient==2.50.0": ["--platform", "any"],  # the pure-Python wheel; perf_analyzer is not needed there
    "python-rapidjson==1.20": ["--implementation", "cp", "--platform", "manylinux2014_x86_64"],
    "protobuf==4.25.8": ["--implementation", "cp", "--platform", "manylinux2014_x86_64"],
}
LIMIT_MB = 45


def register(sub) -> None:
    p = sub.add_parser("bundle", help="build the offline GPU-host bundle (tritonserver, numpy<2 overlay, clients)")
    p.add_argument("dir", help="output folder (created; an existing bundle there is replaced)")
    p.add_argument("--python-version", default="3.12", help="the GPU host's Python (its stub is kept)")
    p.add_argument("--wheels", default=None, help="take the wheels from this folder instead of pip download")
    p.set_defaults(func=run)


def _pytriton() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("triton-pd bundle: nvidia-pytriton is not installed here (run `make setup`)")
    return Path(list(spec.submodule_search_locations)[0])


def pack_tritonserver(out: Path, py: str) -> None:
    pkg = _pytriton()
    site = pkg.parent
    base = pkg / "tritonserver"
    stub = base / "python_backend_stubs" / py
    if not stub.is_dir():
        raise SystemExit(f"triton-pd bundle: no Python backend stub for Python {py} in {base}")
    members = [
        (base / "bin" / "tritonserver", "pytriton/tritonserver/bin/tritonserver"),
        (base / "backends/python/libtriton_python.so", "pytriton/tritonserver/backends/python/libtriton_python.so"),
        (
            base / "backends/python/triton_python_backend_utils.py",
            "pytriton/tritonserver/backends/python/triton_python_backend_utils.py",
        ),
    ]
    members += [(f, f"pytriton/tritonserver/python_backend_stubs/{py}/{f.name}") for f in stub.iterdir()]
    for f in sorted((site / "nvidia_pytriton.libs").iterdir()):
        if f.name.startswith("libpython3"):  # the stubs of other Pythons need it; the host's stub embeds its own
            continue
        members.append((f, f"nvidia_pytriton.libs/{f.name}"))
    empty = out.parent / "__init__.py"
    empty.write_text("")
    with tarfile.open(out, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        tar.add(empty, "pytriton/__init__.py")  # makes the unpacked tree findable as the `pytriton` package
        for src, name in members:
            print(f"  + {name}", flush=True)
            tar.add(src, name)
    empty.unlink()


def fetch_wheels(dest: Path, py: str, source: str | None) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    if source:
        for req in WHEELS:
            name = req.split("==")[0].replace("-", "_")
            found = [w for w in Path(source).glob("*.whl") if w.name.lower().startswith(name.lower())]
            if not found:
                raise SystemExit(f"triton-pd bundle: no wheel for {req} in {source}")
            shutil.copy2(found[0], dest)
        return
    for req, extra in WHEELS.items():
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", py, *extra, "-d", str(dest), req]  # fmt: skip
        print(f"  pip download {req}", flush=True)
        subprocess.run(cmd, check=True)


def pack_overlay(wheels: Path, out: Path) -> None:
    """The wheels unpacked into one tar.xz (their test suites left out), to be unpacked into the overlay's
    site-packages: no pip needed there, and xz packs numpy's shared objects tighter than a wheel's zip."""
    with tarfile.open(out, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for whl in sorted(wheels.glob("*.whl")):
            print(f"  + {whl.name}", flush=True)
            with zipfile.ZipFile(whl) as z:
                for info in z.infolist():
                    name = info.filename
                    parts = name.split("/")
                    if parts[0].endswith(".data"):  # a wheel's purelib/platlib go to site-packages itself
                        if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                            continue
                        name = "/".join(parts[2:])
                    if info.is_dir() or "/tests/" in name:
                        continue
                    data = z.read(info)
                    ti = tarfile.TarInfo(name)
                    ti.size = len(data)
                    ti.mode = 0o755 if name.endswith(".so") else 0o644
                    tar.addfile(ti, io.BytesIO(data))


def run(a) -> int:
    out = Path(a.dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    print(f"triton-pd bundle: tritonserver for Python {a.python_version} -> {out}/tritonserver.tar.xz", flush=True)
    pack_tritonserver(out / "tritonserver.tar.xz", a.python_version)
    print("triton-pd bundle: wheels", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        fetch_wheels(Path(tmp) / "wheels", a.python_version, a.wheels)
        print("triton-pd bundle: overlay.tar.xz", flush=True)
        pack_overlay(Path(tmp) / "wheels", out / "overlay.tar.xz")
    shutil.copy2(HERE / "bootstrap.sh", out / "bootstrap.sh")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    for f in sorted(out.rglob("*")):
        if f.is_file():
            print(f"  {f.stat().st_size / 1e6:7.1f} MB  {f.relative_to(out)}")
    print(f"triton-pd bundle: {total / 1e6:.1f} MB in {out} (limit {LIMIT_MB} MB = {LIMIT_MB * 10**6} bytes)")
    if total > LIMIT_MB * 10**6:
        print(f"triton-pd bundle: error: larger than {LIMIT_MB} MB", file=sys.stderr)
        return 1
    print(f"on the GPU host, from the project root: bash {out}/bootstrap.sh COMMAND ...")
    return 0
