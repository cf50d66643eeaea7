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

from .supervisor import PARENT_ENV, child_pids, exit_message, python_stubs

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


def _sample(text: str, name: str, labels: dict) -> float:
    """Sum of the samples of metric `name` in a Prometheus text scrape whose labels include `labels`; KeyError when
    it has none."""
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


def _spec(spec: str | tuple[str, dict]) -> tuple[str, dict]:
    """(name, labels) of a metrics spec: a name, or (name, labels)."""
    return spec if isinstance(spec, tuple) else (spec, {})


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
        # this host only: the servers that scripts and tests start are reached at 127.0.0.1
        cmd = [sys.executable, "-m", "backends.cli", "serve", "--address", "127.0.0.1", "--http-port",
               str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics), "--workdir",
               str(self.workdir)]  # fmt: skip
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [*cmd, *args], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            # the launcher stops when this process is gone: a killed bench or test run takes its servers with it
            env={**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())}, start_new_session=True,
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
                raise ServerError(f"server exited: {exit_message(Path(self.log.name).read_text(errors='replace'))}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"server not ready in {timeout:.0f} s; see {self.log.name}")

    def _scrape(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, **labels) -> float:
        """Sum of a metric's samples whose labels include `labels`; KeyError when it has none."""
        return _sample(self._scrape(), name, labels)

    def snapshot(self, specs: dict) -> dict[str, float]:
        """Several metrics from one scrape: key -> metric name, or (name, labels); KeyError for one without a
        sample, OSError when the endpoint does not answer. One scrape, so values that a backend sets together are
        read together (separate scrapes may fall between two of its gauge updates)."""
        text = self._scrape()
        return {key: _sample(text, *_spec(spec)) for key, spec in specs.items()}

    def read_metrics(self, specs: dict) -> dict[str, float]:
        """As snapshot, but 0 for a metric with no sample yet (a counter nothing has touched), and for every one
        when the endpoint does not answer."""
        try:
            text = self._scrape()
        except OSError:
            return dict.fromkeys(specs, 0.0)
        out = {}
        for key, spec in specs.items():
            try:
                out[key] = _sample(text, *_spec(spec))
            except KeyError:
                out[key] = 0.0
        return out

    def tritonserver_pids(self) -> list[int]:
        """This server's tritonserver process (a list: empty once it has gone), from /proc (Linux)."""
        return [pid for pid in child_pids(self.proc.pid) if _name(pid).startswith("tritonserver")]

    def process_rss(self) -> dict[str, int]:
        """Resident bytes of this server's tritonserver and of each of its Python stubs (by instance name), read
        from /proc (Linux); empty once tritonserver has gone."""
        out: dict[str, int] = {}
        for pid in self.tritonserver_pids():
            out["tritonserver"] = out.get("tritonserver", 0) + _rss(pid)
            for instance, (stub, _) in sorted(python_stubs(pid).items()):
                out[instance] = _rss(stub)
        return out

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


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _rss(pid: int) -> int:
    """VmRSS in bytes, 0 for a process that has gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) << 10 for ln in f if ln.startswith("VmRSS:")), 0)
    except (OSError, ValueError):
        return 0


class SplitDeployment:
    """A multi-server deployment as child processes: `prefills` prefill servers, one decode server reaching them
    over gRPC (KV over the network transport), one master reaching decode; one internal key shared by all.

    `args` go to every server (model, pools, policies: each role reads what is its own); `prefill_args[i]` and
    `decode_args` add placement and the like per server. `grpc_url` is master's, `metrics_url` decode's (where the
    pool and request-state metrics are); `servers` lists every ServerProcess, prefill first."""

    def __init__(self, args: list[str], log_dir: Path, prefills: int = 1, prefill_args: list[list[str]] | None = None,
                 decode_args: list[str] = (), ready_timeout: float = 900):  # fmt: skip
        import secrets

        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        key = log_dir / "internal_key"
        key.write_text(secrets.token_hex(24))
        key.chmod(0o600)
        common = [*args, "--internal-key-file", str(key)]
        self.servers: list[ServerProcess] = []
        try:
            for i in range(prefills):
                extra = (prefill_args or [[]] * prefills)[i]
                self.servers.append(ServerProcess([*common, "--role", "prefill", *extra], log_dir / f"prefill{i}.log",
                                                  ready_timeout=ready_timeout))  # fmt: skip
            urls = ",".join(s.grpc_url for s in self.servers)
            self.decode = ServerProcess([*common, "--role", "decode", "--prefill-urls", urls, "--kv-address",
                                         "127.0.0.1", *decode_args], log_dir / "decode.log",
                                        ready_timeout=ready_timeout)  # fmt: skip
            self.servers.append(self.decode)
            self.master = ServerProcess([*common, "--role", "master", "--decode-urls", self.decode.grpc_url],
                                        log_dir / "master.log", ready_timeout=ready_timeout)  # fmt: skip
            self.servers.append(self.master)
        except Exception:
            self.stop()
            raise

    @property
    def grpc_url(self) -> str:
        return self.master.grpc_url

    @property
    def metrics_url(self) -> str:
        return self.decode.metrics_url

    @property
    def grpc(self) -> int:
        return self.master.grpc

    @property
    def metrics(self) -> int:
        return self.decode.metrics

    def metric(self, name: str, **labels) -> float:
        return self.decode.metric(name, **labels)

    def snapshot(self, specs: dict) -> dict[str, float]:
        return self.decode.snapshot(specs)

    def read_metrics(self, specs: dict) -> dict[str, float]:
        return self.decode.read_metrics(specs)

    def wait_metric(self, name: str, predicate, timeout: float = 2.0, **labels) -> float:
        return self.decode.wait_metric(name, predicate, timeout, **labels)

    def process_rss(self) -> dict[str, int]:
        """Every server's processes, named `<role>:<process>` (master:tritonserver, decode:pd_decode_0_0, ...)."""
        roles = [f"prefill{i}" for i in range(len(self.servers) - 2)] + ["decode", "master"]
        return {f"{role}:{k}": v for role, srv in zip(roles, self.servers) for k, v in srv.process_rss().items()}

    def stop(self) -> None:
        for s in reversed(self.servers):
            s.stop()


def start_deployment(layout: str, args: list[str], log: Path, prefill_args: str = "", decode_args: str = ""):
    """`one`: one tritonserver with all three models (ServerProcess, log is its file); `split`: SplitDeployment
    with one prefill server (log is its folder), `prefill_args` and `decode_args` as shell words."""
    import shlex

    if layout == "one":
        return ServerProcess(args, log)
    if layout != "split":
        raise ValueError(f"layout {layout!r} is not one or split")
    return SplitDeployment(args, Path(log), 1, [shlex.split(prefill_args)], shlex.split(decode_args))
