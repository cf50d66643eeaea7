"""perf/gpu.sh runs on a GPU host that CI never reaches: its commands are checked here against the tools
they call, so that a renamed flag or test fails on the CPU instead of costing a GPU session its device time."""

import re
import shlex
from pathlib import Path

from perf.tools import hybrid_bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "perf" / "gpu.sh").read_text().replace("\\\n", " ")  # continuation lines joined


def test_every_hybrid_bench_command_parses_with_its_flags(capsys, monkeypatch):
    """Each `perf/engine.py hybrid` command's arguments get past the tool's parser (an unknown flag or value would
    exit 2 through argparse) to its GPU check, which returns 2 without a GPU (made so on a GPU host too, where the
    command would otherwise run the benchmark)."""
    monkeypatch.setattr(hybrid_bench.torch.cuda, "is_available", lambda: False)
    commands = [line.split("perf/engine.py hybrid", 1)[1] for line in SCRIPT.splitlines()
                if "perf/engine.py hybrid" in line and not line.lstrip().startswith("#")]  # fmt: skip
    assert len(commands) == 2, commands  # the layout and qwen3.5-9b
    for command in commands:
        capsys.readouterr()
        assert hybrid_bench.main(shlex.split(command)) == 2  # returned: parsed, then no CUDA GPU here
        assert "needs a CUDA GPU" in capsys.readouterr().err


def kernel_test_selection(step: str, ids: bool) -> tuple[list[str], list[str]]:
    """(files, -k names) of the script's pytest step `step`, each name checked to select a test of those files (a
    rename would deselect it), or with `ids` a parametrisation's id too."""
    m = re.search(rf'step {step} \d+ python3 -m pytest -q -p \S+\s+((?:tests/kernels/\S+\.py\s+)+)-k "([^"]+)"', SCRIPT)
    assert m is not None, step
    files = m.group(1).split()
    source = "\n".join((ROOT / f).read_text() for f in files)
    tests = re.findall(r"^def (test_\w+)", source, re.M)
    names = " ".join(m.group(2).split()).split(" or ")
    for name in names:
        assert any(name in t for t in tests) or (ids and f'"{name}"' in source), (
            f"-k {name!r} selects nothing in {files}"
        )
    return files, names


def test_the_kernel_tests_it_selects_exist():
    """bench's pytest -k names each select a test of the files it runs."""
    files, names = kernel_test_selection("kernel_tests", ids=False)
    assert len(files) >= 2 and len(names) >= 7


def test_the_tuning_caches_it_starts_from_are_tuning_cache_files():
    """The files the script copies in as its starting tuning caches exist and are kernels.linear.TuneCache files
    (the kernels' tuning version and entries), so a run starts from their picks instead of warning and tuning afresh."""
    import json

    m = re.search(r"^\s*cp (perf/tune_cache/\S+) (perf/tune_cache/\S+) ", SCRIPT, re.M)
    assert m is not None
    for path in m.groups():
        data = json.loads((ROOT / path).read_text())
        from kernels import delta_tune, linear

        assert data["code"] in (linear.TUNE_VERSION, delta_tune.STEP_TUNE_VERSION), path
        assert data["entries"] and all({"choice", "times"} <= set(e) for e in data["entries"].values())


def test_every_seed_stalls_command_parses_with_its_flags(monkeypatch):
    """Each `perf/scenario.py seed` command (the hybrid seed step, with MTP and dense, either phase for PHASE) gets
    past the tool's parser and its checks of policies and limits to loading the model, where it stops here."""
    from backends.common.model import loader
    from perf.tools import seed_stalls

    class Parsed(Exception):
        pass

    def stop(model):
        raise Parsed(model)

    monkeypatch.setattr(loader, "resolve", stop)
    commands = [line.split("perf/scenario.py seed", 1)[1] for line in SCRIPT.splitlines()
                if "perf/scenario.py seed" in line and not line.lstrip().startswith("#")]  # fmt: skip
    assert len(commands) == 3, commands  # seed (hybrid), seed-mtp and seed-dense
    models = []
    for command in commands:
        for phase in seed_stalls.PHASES:
            args = shlex.split(command.replace("$PHASE", phase[0]))
            try:
                seed_stalls.main(args)
            except Parsed as e:
                models.append(e.args[0])
            else:
                raise AssertionError(f"seed_stalls {args} returned before loading its model")
    assert sorted(set(models)) == ["random:llama3.1-8b", "random:qwen3.5-9b"]


def test_each_mode_fits_one_device_command():
    """A device command ends at 600 s, and a command killed there returns nothing (the archive is packed on exit):
    the wall limits of each mode's steps add up to less."""
    modes = re.findall(r"^  ([a-z0-9-]+)\)\n(.*?)^    ;;", SCRIPT, re.M | re.S)
    assert {m for m, _ in modes} == {"bench", "startup", "vision", "fp8", "seed", "seed-mtp", "seed-dense",
                                     "soak-policies"}  # fmt: skip
    for mode, body in modes:
        limits = [int(n) for n in re.findall(r"^\s*step \S+ (\d+) ", body, re.M)]
        assert limits, mode
        assert sum(limits) <= 590, f"{mode}: steps' limits {limits} add up to {sum(limits)} s"


def test_the_soak_policies_command_parses_and_plans_every_policy_within_its_step():
    """soak-policies: its `perf/soak.py policies` options parse, and the deadline leaves room for each policy's
    start, load and drain, with the bundle's bootstrap (about 90 s) inside the step's limit."""
    import shlex

    from perf.tools import soak_policies

    (line,) = [ln for ln in SCRIPT.splitlines() if "perf/soak.py policies" in ln and not ln.lstrip().startswith("#")]
    step_limit = int(re.search(r"step soak_policies (\d+) ", line).group(1))
    args = shlex.split(line.split("perf/soak.py policies", 1)[1].replace('"$USERS"', "64").replace("$W", "/tmp/x"))
    a = soak_policies.parser().parse_args(args)
    per_policy = a.start_allowance + a.duration + a.drain_timeout
    assert len(a.policies) * per_policy <= a.deadline <= step_limit - 90, (a.deadline, per_policy, step_limit)
    assert a.duration - a.warmup >= 60


def test_the_startup_commands_parse_and_need_a_gpu(monkeypatch, tmp_path):
    """startup's `perf/startup.py` commands (cold, then picks from cold's files) get past their parser; without a
    CUDA GPU each start is recorded as an error (the child cannot capture) and the run exits 1 with its row
    written."""
    import json
    import shlex

    from perf import startup

    lines = [ln for ln in SCRIPT.splitlines() if "perf/startup.py" in ln and not ln.lstrip().startswith("#")]
    calls = []
    monkeypatch.setattr(startup, "start", lambda name, *a: calls.append(name) or {"start": name, "error": "no GPU"})
    for line in lines:
        args = shlex.split(line.split("perf/startup.py", 1)[1].replace('"$W', f'"{tmp_path}'))
        assert startup.main(args) == 1
        out = json.loads((tmp_path / f"startup-{calls[-1]}.json").read_text())
        assert out["model"] == "random:qwen3.5-9b" and [r["start"] for r in out["rows"]] == calls[-1:]
    assert calls == ["cold", "picks"]
