"""The launcher's supervisor in-process, against a stand-in tritonserver: a Python process whose children carry a
Python stub's command line (stub, model.py, shm region, ..., instance name, env) and which, like tritonserver,
never reaps a child that died. No real server is needed to show when the supervisor stops one."""

import os
import signal
import sys
import textwrap
import time

import pytest

from backends.supervisor import Supervisor, process_alive, python_stubs

FAKE_SERVER = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
    stub, model, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    for name in names:
        if os.fork() == 0:
            os.execv(stub, [stub, model, f"triton_python_backend_shm_region_{name}", "1", "2", str(os.getppid()),
                            "/b/python", "", name, "DEFAULT"])
    while True:
        time.sleep(1)  # never waits for a child: a dead stub stays a zombie, as under tritonserver 2.51
    """
)


@pytest.fixture
def server(tmp_path):
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    made = []

    def start(*names: str) -> Supervisor:
        stub, model = tmp_path / "triton_python_backend_stub", tmp_path / "model.py"
        if not stub.exists():
            stub.symlink_to(sys.executable)  # a stub's command line, run by Python: it sleeps in model.py
            model.write_text("import time\ntime.sleep(300)\n")
        cmd = [sys.executable, "-c", FAKE_SERVER, str(stub), str(model), *names]
        sup = Supervisor(cmd, dict(os.environ), tmp_path / "log", 0, exit_timeout=1.0)
        made.append(sup)
        t0 = time.monotonic()
        while len(python_stubs(sup.proc.pid)) < len(names):
            assert time.monotonic() - t0 < 20, "the stand-in stubs did not start"
            time.sleep(0.05)
        return sup

    yield start
    for sup in made:
        sup.close("test", tmp_path / "mailbox")
    signal.signal(signal.SIGTERM, handlers[0])
    signal.signal(signal.SIGINT, handlers[1])


def kill_and_wait(pid: int) -> None:
    """SIGKILL a stand-in stub and wait until it is a zombie or gone (the signal is delivered asynchronously: on a
    busy host the stub may still run a while)."""
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while process_alive(pid):
        assert time.monotonic() - t0 < 10
        time.sleep(0.01)


NAMES = ("pd_master_0_0", "pd_decode_0_0", "pd_prefill_0_0")
# while it loads a model, Triton runs a stub named by the model alone (auto-complete) and ends it
LOADING = "pd_decode"


def test_stubs_are_found_by_instance_name_with_their_regions(server):
    sup = server(*NAMES)
    stubs = python_stubs(sup.proc.pid)
    assert sorted(stubs) == sorted(NAMES)
    assert all(region == f"triton_python_backend_shm_region_{n}" for n, (_, region) in stubs.items())
    assert all(process_alive(pid) for pid, _ in stubs.values())


@pytest.mark.parametrize("seen_first", [True, False])
def test_a_dead_decode_stub_stops_the_server_even_if_it_died_before_the_first_scan(server, seen_first):
    sup = server(*NAMES)
    pid = python_stubs(sup.proc.pid)["pd_decode_0_0"][0]
    if seen_first:
        sup._scan()
    kill_and_wait(pid)
    # the zombie has no command line: a scan from now on cannot recognise it
    assert "pd_decode_0_0" not in python_stubs(sup.proc.pid)
    rc = sup.watch()
    assert rc == 0  # the stand-in exits 0 on SIGTERM: the supervisor asked it to stop
    assert sup.died == ("pd_decode_0_0" if seen_first else "pd_decode")
    assert not process_alive(sup.proc.pid)


def test_a_server_that_aborts_right_after_a_decode_stub_died_names_the_stub(server, capsys):
    """Killing a stub can make Triton 2.51 itself abort at once (boost::interprocess::lock_exception): the
    supervisor, which checks its stubs once a second, then names the dead stub as the cause of the exit instead
    of reporting only tritonserver's status; a server that exits with every stub alive names none."""
    sup = server(*NAMES)
    sup._scan()
    pid = sup.stubs["pd_decode_0_0"][0]
    kill_and_wait(pid)
    os.kill(sup.proc.pid, signal.SIGABRT)  # the server aborts after its stub died, before the supervisor's check
    assert sup.watch() == -signal.SIGABRT
    assert sup.died == "pd_decode_0_0"
    assert f"pd_decode_0_0's stub (pid {pid}) died, and tritonserver exited" in capsys.readouterr().out
    other = server(*NAMES)
    other._scan()
    os.kill(other.proc.pid, signal.SIGABRT)
    assert other.watch() == -signal.SIGABRT and other.died is None


def test_a_dead_prefill_stub_or_a_loading_stub_that_ended_does_not_stop_the_server(server):
    sup = server(*NAMES, LOADING)
    sup._scan()
    kill_and_wait(sup.stubs["pd_prefill_0_0"][0])
    kill_and_wait(sup.stubs[LOADING][0])
    assert sup._dead() is None
    sup.stopping.append(signal.SIGTERM)  # what Ctrl-C does, without the signal
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.watch() == 0 and sup.died is None


def test_close_removes_the_regions_of_every_stub_seen(server, tmp_path):
    sup = server(*NAMES)
    sup._scan()
    paths = [f"/dev/shm/triton_python_backend_shm_region_{n}" for n in NAMES]
    for path in paths:
        open(path, "w").close()
    try:
        sup.close("test", tmp_path / "mailbox")
        assert sup.proc.poll() is not None
        assert not [p for p in paths if os.path.exists(p)]
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
