"""The supervisor of one tritonserver process: progress until every model is ready, Ctrl-C and SIGTERM turned
into a clean stop (twice forces it), the stop of the whole server when master's or a decode instance's stub dies
(Triton 2.51 neither restarts it nor fails the streams it held), and the deployment's shared memory removed
whatever happened."""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from .tritonserver import MODELS

# A dead prefill instance fails its jobs at once (decode reports them), so the server keeps serving without it.
WATCHED = ("pd_master", "pd_decode")
# with master's or decode's stub dead nothing in flight can finish, and tritonserver's shutdown would wait out its
# exit timeout for requests that stub never ends, then hang unloading it: it gets this long after SIGTERM, then
# SIGKILL (the launcher removes what it leaves)
DEAD_STUB_GRACE_S = 2.0


def exit_message(log_text: str, limit: int = 3000) -> str:
    """What a server that exited printed, within about `limit` characters: Triton's error lines first (glog's
    `E1207 ...` lines, where a model's failed initialize is reported, far above the config table Triton prints as
    it stops) and Python errors, then the log's last lines."""
    errors = [line for line in log_text.splitlines() if re.match(r"E\d{4} ", line) or "Error" in line]
    head = "\n".join(errors)[-(limit * 2 // 3) :]
    return (head + "\n...\n" if head else "") + log_text[-(limit - len(head)) :]


class Supervisor:
    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, http_port: int, models=MODELS, *,
                 exit_timeout: float, host: str = "127.0.0.1"):  # fmt: skip
        self.log_path, self.http_port, self.models = log_path, http_port, tuple(models)
        self.host = host  # where the server's HTTP endpoint answers on this host
        self.exit_timeout = exit_timeout
        self.stopping: list[int] = []
        self.stubs: dict[str, tuple[int, str]] = {}
        self.regions: set[str] = set()
        self.died: str | None = None
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent(os.getpid()))  # fmt: skip
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        # only signal here: the main thread may be inside proc.wait(), whose lock a handler must not take
        if not self.stopping:
            self.stopping.append(signum)
            print("\n[triton-pd] shutting down (again to force)", flush=True)
            signal_group(self.proc, signal.SIGTERM, group=False)
        else:
            signal_group(self.proc, signal.SIGKILL)

    def wait_ready(self, timeout: float) -> bool:
        """True once every model and the server are ready; False if a stop was asked for first."""
        t0, shown = time.monotonic(), set()
        url = f"http://{self.host}:{self.http_port}"
        while not self.stopping:
            self._scan()  # each stub as soon as it runs: one may die before the launcher sees the server ready
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"triton-pd: error: tritonserver exited with status {self.proc.returncode} before it was ready:\n"
                    + exit_message(self.log_path.read_text(errors="replace"))
                )
            for m in self.models:
                if m not in shown and _ok(f"{url}/v2/models/{m}/ready"):
                    shown.add(m)
                    print(f"[triton-pd] {m} ready ({time.monotonic() - t0:.0f} s)", flush=True)
            if len(shown) == len(self.models) and _ok(f"{url}/v2/health/ready") and self.proc.poll() is None:
                self._scan()
                return True
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"triton-pd: error: models not ready after {timeout:.0f} s (see {self.log_path})")
            time.sleep(0.5)
        return False

    def _scan(self) -> None:
        """Adds the stubs running now to self.stubs; an instance keeps the pid it was first seen with (a stub
        Triton relaunched under the same name does not hide the death of the first one)."""
        for name, stub in python_stubs(self.proc.pid).items():
            self.stubs.setdefault(name, stub)
            self.regions.add(stub[1])

    def _dead(self) -> tuple[str, int | None] | None:
        """A master or decode instance whose stub is gone, with its pid; or such a model with no stub at all
        (its only stub died before any scan saw it; a zombie has no command line to recognise it by)."""
        # a stub named by the model alone is the short-lived one Triton runs while loading it (auto-complete)
        watched = {n: pid for n, (pid, _) in self.stubs.items() if n.startswith(tuple(f"{m}_" for m in WATCHED))}
        for name, pid in watched.items():
            if not process_alive(pid):
                return name, pid
        for model in self.models:
            if model in WATCHED and not any(n.startswith(f"{model}_") for n in watched):
                return model, None
        return None

    def watch(self) -> int:
        """Until tritonserver exits: its exit status. Stops it when a watched stub dies (self.died names it)."""
        if not self.stopping:
            self._scan()
        kill_at = None
        while True:
            try:
                rc = self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            else:
                if self.died is None and not self.stopping:
                    self._blame(rc)
                return rc
            if self.stopping and kill_at is None:
                # a client that keeps a gRPC stream open holds Triton 2.51's shutdown past its exit timeout
                kill_at = time.monotonic() + self.exit_timeout + 10
            if kill_at is not None and time.monotonic() > kill_at:
                signal_group(self.proc, signal.SIGKILL)  # its shutdown waits for requests the dead stub never ends
            if self.died is None and not self.stopping:
                dead = self._dead()
                if dead is not None:
                    self.died, pid = dead
                    print(
                        f"[triton-pd] {_stub(self.died, pid)} died and Triton does not restart it: stopping the "
                        f"server (see {self.log_path})",
                        flush=True,
                    )
                    signal_group(self.proc, signal.SIGTERM, group=False)
                    kill_at = time.monotonic() + DEAD_STUB_GRACE_S

    def _blame(self, rc: int) -> None:
        """tritonserver exited on its own: where a watched stub is gone too (checked at once, before the other
        stubs notice their parent's end), name it as the cause. Killing a stub can make Triton 2.51 itself abort
        (its shared-memory mutex, boost::interprocess::lock_exception) within the second between two checks."""
        dead = self._dead()
        if dead is not None:
            self.died, pid = dead
            print(f"[triton-pd] {_stub(self.died, pid)} died, and tritonserver exited with status {rc} (see "
                  f"{self.log_path})", flush=True)  # fmt: skip

    def close(self, deployment_id: str, mailbox: Path) -> None:
        """Kill what is left (stubs left behind by a crash too) and remove the deployment's shared memory."""
        if self.proc.poll() is None:
            signal_group(self.proc, signal.SIGKILL)
            self.proc.wait()
        signal_group(self.proc, signal.SIGKILL)
        cleanup(deployment_id, mailbox, sorted(self.regions))


def _stub(name: str, pid: int | None) -> str:
    """A watched instance's stub in the launcher's messages ("... died"); pid None: the model had none."""
    return f"{name}'s stub (pid {pid})" if pid is not None else f"{name} has no stub: it"


PR_SET_PDEATHSIG = 1  # prctl(2)


PARENT_ENV = "TRITON_PD_STOP_WITH_PID"


def stop_with_process(pid: int, interval: float = 1.0) -> None:
    """Send this process SIGTERM (the ordinary stop) once process `pid` is gone: for a launcher started by a script
    (bench, perf/, tests), which sets PARENT_ENV, so that a killed script takes its servers with it. A process id,
    watched by polling, because a parent-death signal fires when the *thread* that started the child ends, and
    scripts start servers from threads."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(interval)
            if not process_alive(pid):
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="stop-with-parent", daemon=True).start()


def die_with_parent(parent: int, sig: int = signal.SIGTERM):
    """For Popen's preexec_fn: the child gets `sig` when the process that started it dies, however it dies (a
    SIGKILL, an OOM kill), so a launcher never leaves a tritonserver holding its ports (Linux prctl; elsewhere a
    no-op). SIGTERM: tritonserver then stops its stubs and removes their shared memory, as on Ctrl-C. If the
    parent is already gone when the child gets there, the child exits at once. libc is looked up here, in the
    parent: the forked child only makes the call."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_signal() -> None:
        if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0 and os.getppid() != parent:
            os._exit(1)

    return set_signal


def ports_in_use(ports: dict[str, int], address: str = "0.0.0.0") -> list[str]:
    """The options whose port another process listens on (`--http-port 8000`), checked by binding it as
    tritonserver will (at `address`, SO_REUSEADDR: a closed connection's TIME_WAIT does not count)."""
    import socket

    busy = []
    for flag, port in ports.items():
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError:
                busy.append(f"{flag} {port}")
    return busy


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is `pid`, from /proc (/proc/<pid>/task/*/children needs CONFIG_PROC_CHILDREN)."""
    kids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            if int(stat_fields(stat)[1]) == pid:  # the parent pid
                kids.append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            continue
    return kids


def python_stubs(server_pid: int) -> dict[str, tuple[int, str]]:
    """The Python stubs tritonserver `server_pid` runs, from /proc: instance name -> (pid, name of the stub's
    shared-memory region in /dev/shm)."""
    stubs = {}
    for pid in child_pids(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().rstrip(b"\0").split(b"\0")]
        except (OSError, UnicodeDecodeError):
            continue
        # stub, model.py, shm region, shm sizes, parent pid, backend dir, ..., instance name, execution env
        if len(argv) >= 4 and argv[0].endswith("triton_python_backend_stub"):
            stubs[argv[-2]] = (pid, argv[2])
    return stubs


def process_alive(pid: int) -> bool:
    """False once the process is gone or a zombie (tritonserver does not reap a stub that died)."""
    try:
        return stat_fields(f"/proc/{pid}/stat")[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def stat_fields(path: str) -> list[str]:
    """The fields of a /proc/<pid>/stat after the command name (which may hold spaces): state, parent pid, ..."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def signal_group(proc: subprocess.Popen, sig: int, group: bool = True) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


def cleanup(deployment: str, mailbox: Path, stub_regions: tuple[str, ...] | list[str] = ()) -> None:
    """Shared-memory segments and the mailbox of this deployment, even if a stub died without finalize(), and the
    stubs' own regions, which tritonserver removes only when it stops cleanly."""
    shutil.rmtree(mailbox, ignore_errors=True)
    regions = [f"/dev/shm/{r}" for r in stub_regions if r.startswith("triton_python_backend_shm_region")]
    for path in glob.glob(f"/dev/shm/tpd_{deployment}_*") + regions:
        try:
            os.unlink(path)
        except OSError:
            pass
