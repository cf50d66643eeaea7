"""A real tritonserver with the real models (CPU, SmolLM2, 1 prefill + 1 decode instance)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class Server:
    live: list[Server] = []  # started and not yet stopped: their logs go into a failing test's report

    def __init__(self, *extra: str, env: dict | None = None, name: str = "server"):
        self.name = name
        self.http, self.grpc, self.metrics = free_ports(3)
        self.workdir = ROOT / ".run" / f"test-{name}-{self.http}"
        cmd = [
            sys.executable,
            "-m",
            "backends.cli",
            "serve",
            "--http-port",
            str(self.http),
            "--grpc-port",
            str(self.grpc),
            "--metrics-port",
            str(self.metrics),
            "--workdir",
            str(self.workdir),
            *extra,
        ]
        (ROOT / ".run").mkdir(exist_ok=True)
        self.log = open(ROOT / ".run" / f"test-{name}-{self.http}.out", "w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        Server.live.append(self)
        self._wait()

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http}"

    def _wait(self, timeout: float = 300) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("server not ready in time")

    def metric(self, name: str, **labels) -> float:
        """Sum of a metric's samples whose labels include `labels`."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5) as r:
            text = r.read().decode()
        total, found = 0.0, False
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise KeyError(name)
        return total

    def wait_metric(self, name: str, predicate, timeout: float = 2.0, **labels) -> float:
        t0 = time.monotonic()
        while True:
            v = self.metric(name, **labels)
            if predicate(v) or time.monotonic() - t0 > timeout:
                return v
            time.sleep(0.05)

    def assert_released(self, timeout: float) -> None:
        """Decode holds no request in any state and no slot, and its pool accounting is exact."""
        for name in (
            "pd_decode_running_requests",
            "pd_decode_queued_requests",
            "pd_decode_paused_requests",
            "pd_decode_recovering_requests",
            "pd_kv_slots_used",
        ):
            assert self.wait_metric(name, lambda v: v == 0, timeout=timeout) == 0, name
        assert self.metric("pd_kv_slots_free") + self.metric("pd_kv_slots_cached") == self.metric("pd_kv_slots_total")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except Exception:
            return False

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        # tritonserver runs in its own session: if the launcher could not stop it, nothing else will, and a client
        # stream it still holds open keeps this test process from exiting
        subprocess.run(["pkill", "-KILL", "-f", f"{self.workdir}/"], capture_output=True)
        self.log.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing (or timed-out) server test reports the tail of every running server's logs."""
    report = yield
    if report.failed:
        for srv in Server.live:
            report.sections.append((f"server {srv.name} logs", srv.log_tail()))
    return report


@pytest.fixture(scope="module")
def server():
    s = Server("--kv-tokens", "4096", name="serve")
    yield s
    s.stop()
