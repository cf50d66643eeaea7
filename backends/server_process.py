"""`triton-pd serve` as a child process: free ports, its own process group, a bounded wait until Triton reports
ready, metrics read from its Prometheus endpoint, and a stop that leaves nothing running. The one way benchmarks
(`triton-pd bench`, perf/) and the server tests start a server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ServerError(RuntimeError):
    pass


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


class ServerProcess:
    def __init__(
        self,
        args: list[str],
        log: Path,
        workdir: Path | None = None,
        env: dict | None = None,
        ready_timeout: float = 900,
    ):
        self.http, self.grpc, self.metrics = free_ports(3)
        self.workdir = Path(workdir) if workdir is not None else ROOT / ".run" / f"serve-{self.http}"
        cmd = [sys.executable, "-m", "backends.cli", "serve", "--http-port", str(self.http), "--grpc-port",
               str(self.grpc), "--metrics-port", str(self.metrics), "--workdir", str(self.workdir)]  # fmt: skip
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [*cmd, *args], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip
        self._started()
        self._wait(ready_timeout)

    def _started(self) -> None:
        """Hook for subclasses: the process exists (its logs may be wanted if the wait fails)."""

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http}"

    @property
    def metrics_url(self) -> str:
        return f"127.0.0.1:{self.metrics}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except Exception:
            return False

    def _wait(self, timeout: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited: {Path(self.log.name).read_text(errors='replace')[-3000:]}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"server not ready in {timeout:.0f} s; see {self.log.name}")

    def metric(self, name: str, **labels) -> float:
        """Sum of a metric's samples whose labels include `labels`; KeyError when it has none."""
        with urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=5) as r:
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
        """The metric's value once predicate holds, or its last value after timeout seconds."""
        t0 = time.monotonic()
        while True:
            v = self.metric(name, **labels)
            if predicate(v) or time.monotonic() - t0 > timeout:
                return v
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM to the launcher (it stops tritonserver), SIGKILL to the group after 60 s; then anything still
        running from this server's workdir: tritonserver runs in a session of its own, and a client stream it holds
        open would keep the caller from exiting."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        subprocess.run(["pkill", "-KILL", "-f", f"{self.workdir}/"], capture_output=True)
        if not self.log.closed:
            self.log.close()
