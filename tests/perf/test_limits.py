"""perf.limits.wall_clock_limit: a run past its bound writes what it has, stops its servers and exits 124."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, time
from perf.tools.limits import wall_clock_limit

class FakeServer:
    def stop(self):
        print("server stopped", flush=True)

timer = wall_clock_limit(0.3, lambda note: print("wrote:", note, flush=True), [FakeServer()])
if sys.argv[1] == "hang":
    time.sleep(30)
timer.cancel()
print("finished", flush=True)
"""


def run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True, timeout=20)


def test_a_run_past_its_limit_writes_stops_and_exits_124():
    p = run("hang")
    assert p.returncode == 124
    assert p.stdout.splitlines() == ["wrote: TIME LIMIT: stopped after 0.3 s", "server stopped"]


def test_a_run_within_its_limit_is_left_alone():
    p = run("quick")
    assert p.returncode == 0 and p.stdout.splitlines() == ["finished"]


def test_report_writer_writes_what_the_lists_hold_when_called(tmp_path):
    import json

    from perf.tools.limits import report_writer

    lines, rows = ["# r"], []
    out = tmp_path / "r.md"
    write = report_writer(lines, str(out), rows)
    lines.append("| a |")
    rows.append({"a": 1})
    write("TIME LIMIT")
    assert out.read_text() == "# r\n| a |\n\nTIME LIMIT\n"
    assert json.loads((tmp_path / "r.json").read_text()) == [{"a": 1}]
