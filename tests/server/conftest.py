"""A real tritonserver with the real models (CPU, SmolLM2, 1 prefill + 1 decode instance)."""

from __future__ import annotations

import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from backends.server_process import ROOT, ServerProcess, free_ports

STALE_S = 3600  # a test server's directory and log older than this are an earlier run's


@pytest.fixture(scope="session", autouse=True)
def _clear_earlier_runs():
    """Each test server keeps its logs and model repository in .run/test-<name>-<port> for a failure's post-mortem;
    those of earlier runs (untouched for STALE_S) go when a run starts, so that repeated runs do not pile them up
    (hundreds of MB over a day of `make test`) while a run going on beside this one keeps its own."""
    now = time.time()
    for path in (ROOT / ".run").glob("test-*"):
        try:
            if now - path.stat().st_mtime < STALE_S:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()
        except OSError:
            pass  # gone meanwhile, or not ours to remove
    yield


class Server(ServerProcess):
    """A server for tests: `triton-pd serve` with the given options in .run/test-<name>-<port>; the logs of every
    server still running go into a failing test's report. `--exit-timeout 2` unless the options say otherwise: a
    stop that finds a request still in flight (a stream a test left open) waits 2 s for it, not 20."""

    live: list[Server] = []

    def __init__(self, *extra: str, env: dict | None = None, name: str = "server"):
        self.name = name
        if "--exit-timeout" not in extra:
            extra = (*extra, "--exit-timeout", "2")
        port = free_ports(1)[0]
        super().__init__(
            list(extra), ROOT / ".run" / f"test-{name}-{port}.out", workdir=ROOT / ".run" / f"test-{name}-{port}",
            env=env, ready_timeout=300,
        )  # fmt: skip

    def _started(self) -> None:
        Server.live.append(self)

    def assert_released(self, timeout: float) -> None:
        """Decode holds no request in any state and no slot, its pool accounting is exact, and its idle invariant
        checks never failed. Read from one scrape at a time, until all of it holds or `timeout` seconds pass: decode
        sets its gauges one by one, so separate scrapes could pair a new `used` with an old `cached`."""
        specs = {
            **{n: f"pd_decode_{n}_requests" for n in ("running", "queued", "paused", "recovering")},
            **{n: f"pd_kv_slots_{n}" for n in ("used", "free", "cached", "total")},
            "violations": "pd_decode_invariant_violations_total",
        }

        def released(m: dict) -> bool:
            held = [m[n] for n in ("running", "queued", "paused", "recovering", "used")]
            return not any(held) and m["free"] + m["cached"] == m["total"] > 0

        t0 = time.monotonic()
        while not released(m := self.snapshot(specs)) and time.monotonic() - t0 < timeout:
            time.sleep(0.05)
        assert released(m), f"decode not released after {timeout} s: {m}"
        assert m["violations"] == 0, "decode logged scheduler invariant violations"

    def wait_paused(self, timeout: float = 120) -> None:
        """Until decode has a request paused or recovering; the test fails after `timeout` seconds without one."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.metric("pd_decode_paused_requests") + self.metric("pd_decode_recovering_requests") > 0:
                return
            time.sleep(0.02)
        pytest.fail("no request paused")

    def log_tail(self, chars: int = 4000) -> str:
        parts = []
        for path in (Path(self.log.name), self.workdir / "tritonserver.log"):
            try:
                parts.append(f"--- {path}\n{path.read_text(errors='replace')[-chars:]}")
            except OSError as e:
                parts.append(f"--- {path}: {e}")
        return "\n".join(parts)

    def stop(self) -> None:
        if self in Server.live:
            Server.live.remove(self)
        super().stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing (or timed-out) server test reports the tail of every running server's logs."""
    report = yield
    if report.failed:
        for srv in Server.live:
            report.sections.append((f"server {srv.name} logs", srv.log_tail()))
    return report


def openai_server(*args: str, name: str) -> Server:
    """A test server with the OpenAI front end too (`openai_url`), once the front end answers (the server's
    readiness is Triton's)."""
    port = free_ports(1)[0]
    s = Server(*args, "--openai-port", str(port), name=name)
    s.openai_url = f"http://127.0.0.1:{port}/v1"
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"{s.openai_url}/models", timeout=2):
                return s
        except OSError:
            if time.monotonic() - t0 > 120:
                s.stop()
                raise AssertionError(f"the OpenAI front end did not answer in 120 s: {s.log_tail()}") from None
            time.sleep(0.2)


@pytest.fixture(scope="session")
def server():
    """One SmolLM2 server, with the OpenAI front end, for the modules that only send it requests (test_serving,
    test_openai): a server start and stop fewer. Each test leaves it idle."""
    s = openai_server("--kv-tokens", "4096", name="serve")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tiny_server():
    """random:tiny-test, whose steps cost next to nothing, for the tests whose load is on the stubs and the relay
    rather than the model (test_churn's many short streams, test_fuzz's malformed requests): one server for both.
    Each test leaves it idle."""
    s = Server("--model", "random:tiny-test", "--kv-tokens", "2048", name="tiny")
    yield s
    s.stop()
