"""`make test`'s scheduling: the tests that start a tritonserver run in two pytest-xdist work units."""

from __future__ import annotations

import re
from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_with_server_tests_is_in_the_server_unit():
    mark = re.compile(r"^(pytestmark = .*|@)pytest\.mark\.server\b", re.M)  # a module's mark or a test's
    marked = [p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py") if mark.search(p.read_text())]
    assert "tests/server/test_serving.py" in marked and "tests/test_replay.py" in marked
    assert all(conftest.work_unit(f"{m}::test_x") in ("server-a", "server-b") for m in marked), marked
    assert all((ROOT / m).exists() for m in conftest.SERVER_MODULES + conftest.SERVER_A)


def test_the_scheduler_puts_server_tests_in_two_units_and_the_rest_in_their_own():
    split = conftest.ServerUnits._split_scope
    assert split(None, "tests/server/test_faults.py::test_a[pd_master]") == "server-a"
    assert split(None, "tests/test_replay.py::test_replay_smoke_pauses") == "server-a"
    # the modules that share a session-scoped server stay in one unit
    assert {split(None, f"tests/server/{m}.py::t") for m in ("test_serving", "test_openai")} == {"server-b"}
    assert {split(None, f"tests/server/{m}.py::t") for m in ("test_churn", "test_fuzz")} == {"server-b"}
    other = "tests/common/test_engine.py::test_chat_answer_is_paris"
    assert split(None, other) == other
