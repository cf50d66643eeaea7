"""perf/'s entry points: at most eight, each part of each one imports and parses its options (`--help` exits 0
with a usage line), and each says what it measures against what."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISPATCHERS = ["engine", "served", "scenario", "soak", "handoff", "kernels"]


def test_perf_has_at_most_eight_entry_points():
    entries = sorted(p.name for p in (ROOT / "perf").iterdir() if p.suffix in (".py", ".sh"))
    entries.remove("__init__.py")
    assert len(entries) <= 8, entries
    assert {f"{d}.py" for d in DISPATCHERS} | {"startup.py", "gpu.sh"} == set(entries)


@pytest.mark.parametrize("entry", DISPATCHERS)
def test_every_part_parses_its_options_and_says_what_it_measures_against(entry, capsys):
    mod = importlib.import_module(f"perf.{entry}")
    assert mod.TABLE and (" vs " in mod.__doc__ or "against" in mod.__doc__)
    for name, (tool, what) in mod.TABLE.items():
        assert re.search(r"\bvs\b|against", what), (entry, name, what)
        assert (ROOT / "perf" / "tools" / f"{tool}.py").exists(), tool
        with pytest.raises(SystemExit) as e:
            mod.dispatch(f"perf/{entry}.py", mod.__doc__, mod.TABLE, [name, "--help"])
        assert e.value.code == 0, (entry, name)
        assert f"{entry}.py {name}" in capsys.readouterr().out  # argparse's usage line names the part


def test_a_listing_and_an_unknown_part():
    from perf import engine

    assert engine.dispatch("perf/engine.py", engine.__doc__, engine.TABLE, []) == 0
    assert engine.dispatch("perf/engine.py", engine.__doc__, engine.TABLE, ["nope"]) == 2


def test_startup_parses_its_options(capsys):
    from perf import startup

    with pytest.raises(SystemExit) as e:
        startup.main(["--help"])
    assert e.value.code == 0 and "cold" in capsys.readouterr().out
