"""The package's layering, read from the source (lazy imports inside functions included): backends/common/
depends on nothing above it, kernels/ on nothing in backends/, the package on nothing in perf/, the roles do not
import each other, and no two modules import each other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("pd_master", "pd_decode", "pd_prefill")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Project modules `path` imports anywhere in its body."""
    pkg = module_name(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [f"{mod}.{a.name}" for a in node.names] + [mod]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n.split(".")[0] in ("backends", "kernels", "perf")}
    return out


def graph() -> dict[str, set[str]]:
    files = [p for d in ("backends", "kernels") for p in (ROOT / d).rglob("*.py")]
    mods = {module_name(p): p for p in files}
    g = {}
    for name, path in mods.items():
        # an import of a name from a module (from .x import Y) is an edge to the module x
        g[name] = {d if d in mods else d.rsplit(".", 1)[0] for d in imports(path)} & set(mods) - {name}
    return g


def test_common_depends_on_nothing_above_it():
    bad = {
        (m, d)
        for m, deps in graph().items()
        if m.startswith("backends.common")
        for d in deps
        if not (d.startswith("backends.common") or d.startswith("kernels"))
    }
    assert not bad, f"backends/common imports from above it: {sorted(bad)}"


# backends/common's subpackages and what each may import from the others (an edge not listed fails)
GROUPS = {
    "core": set(),  # device-free: requests, pools, the radix cache, schedulers, configs
    "model": {"core"},  # weights, tokenizers, KV and state stores, the models and their GPU paths
    "engine": {"core", "model"},  # the runner, the offline engine, sampling, sizing
    "transfer": {"core", "model"},  # KV between roles and servers, mailbox, gRPC clients
    "serving": {"core"},  # Triton I/O, wire messages, stream sender, reply channel, metrics
}


def test_common_is_in_layered_subpackages():
    common = ROOT / "backends" / "common"
    assert [p.name for p in common.glob("*.py")] == ["__init__.py"], "a module outside the subpackages"
    assert {p.name for p in common.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(GROUPS)
    bad = set()
    for m, deps in graph().items():
        if m.startswith("backends.common.") and m.count(".") >= 3:
            group = m.split(".")[2]
            for d in deps:
                if d.startswith("backends.common.") and d.split(".")[2] not in GROUPS[group] | {group}:
                    bad.add((m, d))
    assert not bad, f"backends/common subpackages import against their layering: {sorted(bad)}"


def test_the_core_imports_no_torch_numpy_or_triton():
    """The core runs anywhere plain Python does (its imports, lazy ones included, are read from the source)."""
    bad = set()
    for path in (ROOT / "backends" / "common" / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            bad |= {(path.name, n) for n in names if n.split(".")[0] in ("torch", "numpy", "triton", "kernels")}
            bad |= {(path.name, n) for n in names if n.startswith("triton_python_backend_utils")}
    assert not bad, sorted(bad)


def test_the_decode_loop_is_free_of_triton():
    """pd_decode's loop takes its sender and prefill client as arguments; only model.py (the glue) touches Triton."""
    g = graph()
    assert "backends.common.serving.triton_io" in g["backends.pd_decode.model"]
    assert not {d for d in g["backends.pd_decode.loop"] if d.endswith("triton_io")}


def test_kernels_import_nothing_from_the_backends():
    """kernels/ is the bottom layer: its references are PyTorch code in backends/common, named in docstrings only."""
    bad = {(m, d) for m, deps in graph().items() if m.startswith("kernels") for d in deps if d.startswith("backends")}
    assert not bad, f"kernels/ imports from backends/: {sorted(bad)}"


def test_the_installed_package_imports_nothing_from_perf():
    """backends/ and kernels/ are what `pip install` installs; perf/ holds scripts run from a checkout (the trace
    replay behind `triton-pd bench` lives in backends/replay.py)."""
    files = [p for d in ("backends", "kernels") for p in (ROOT / d).rglob("*.py")]
    bad = {(module_name(p), d) for p in files for d in imports(p) if d.split(".")[0] == "perf"}
    assert not bad, f"the package imports perf/: {sorted(bad)}"


def test_roles_do_not_import_each_other():
    bad = set()
    for m, deps in graph().items():
        for role in ROLES:
            if m.startswith(f"backends.{role}"):
                bad |= {(m, d) for d in deps if any(d.startswith(f"backends.{r}") for r in ROLES if r != role)}
    assert not bad, sorted(bad)


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d) :] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    # package __init__ re-exports are not cycles of code; only module-to-module ones count
    cycles = [c for c in cycles if not any(ROOT.joinpath(*x.split(".")).is_dir() for x in c)]
    assert not cycles, cycles


def test_the_graph_sees_known_edges():
    """The checker itself: it must see module-level and lazy imports, relative and absolute."""
    g = graph()
    assert "backends.common.model.batch" in g["backends.common.engine.runner"]  # from .batch import Span (module level)
    assert "backends.common.model.gpu_model" in g["backends.common.engine.runner"]  # lazy, inside ModelRunner.__init__
    assert "backends.common.serving.wire" in g["backends.pd_decode.model"]  # absolute
    assert "perf.tools.limits" in imports(ROOT / "perf" / "tools" / "hybrid_bench.py")  # perf/ imports are seen too
