"""Deadline expiry during a pause, a prefill instance killed during recovery, master's or decode's stub killed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backends.server_process import ROOT
from tests.server.client import StreamClient, grpc_generate
from tests.server.conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]


def long_prompt(i: int, repeat: int = 12) -> str:
    return f"Essay {i}: describe the geology, climate, flora and fauna of a distant planet in detail. " * repeat


def start_streams(server, n: int, max_tokens: int, repeat: int = 12) -> tuple[list, list]:
    results = [None] * n

    def go(i):
        results[i] = grpc_generate(
            server.grpc_url,
            text=long_prompt(i, repeat),
            params={"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        )

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def prefill_stub_pids(server) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"{server.workdir}/models/pd_prefill/"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_prefill_killed_during_recovery():
    """random:tiny-test (the model does not matter here); every prefill job waits 3 s first, so the recovery job is
    still held when its stub is killed, and paused KV is dropped (no host tier either), so recovery needs prefill."""
    s = Server("--model", "random:tiny-test", "--kv-tokens", "640", "--host-kv-tokens", "0",
               "--fault-injection", "drop_paused_kv,slow_prefill", name="killprefill")  # fmt: skip
    try:
        threads, results = start_streams(s, 3, 300, repeat=2)  # byte tokens: prompts of about 180
        t0 = time.monotonic()
        while s.metric("pd_prefill_jobs_total", kind="recovery") < 1 and time.monotonic() - t0 < 120:
            time.sleep(0.02)
        assert s.metric("pd_prefill_jobs_total", kind="recovery") >= 1
        pids = prefill_stub_pids(s)
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=300)
        failed = [r for r in results if r.error is not None]
        assert failed, "a request in recovery should fail when its prefill instance dies"
        assert all("prefill" in r.error for r in failed), [r.error for r in failed]
        assert all(r.finish_reason == "length" and len(r.ids) == 300 for r in results if r.error is None)
        s.assert_released(timeout=5.0)
        assert s.healthy()
        # Triton 2.51 does not restart a killed Python stub: with the only prefill instance gone, a new request
        # must fail fast with the cause, and master and decode must stay clean
        t0 = time.monotonic()
        again = grpc_generate(s.grpc_url, text="Hello", params={"max_tokens": 3, "temperature": 0})
        assert time.monotonic() - t0 < 10
        assert again.error is not None and "pd_prefill" in again.error and "not healthy" in again.error
        s.assert_released(timeout=5.0)
        # master counts a request out after its last answer is sent: the client can see the answer first
        assert s.wait_metric("pd_master_inflight_requests", lambda v: v == 0, timeout=5.0) == 0
    finally:
        s.stop()


@pytest.mark.parametrize("role", ["pd_master", "pd_decode"])
def test_master_or_decode_stub_death_stops_the_server(role):
    """Triton 2.51 neither restarts a dead stub nor fails what it held: with master or decode gone, every client
    stream through it would hang (measured: no response for 40 s, while new requests failed at once). The launcher
    notices, stops tritonserver and exits non-zero; the open stream ends with an error."""
    # tiny-test writes a token in a few milliseconds: the answer is as long as its context allows and the stubs are
    # found before it starts, so that it cannot end before the kill (CI once saw 400 tokens end first)
    s = Server("--model", "random:tiny-test", "--kv-tokens", "4096", name=f"kill-{role}")
    try:
        out = subprocess.run(["pgrep", "-f", f"{s.workdir}/models/{role}/"], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()]
        assert len(pids) == 1
        out = subprocess.run(["pgrep", "-f", f"{s.workdir}/models/"], capture_output=True, text=True)
        regions = [Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[2].decode() for p in out.stdout.split()]
        assert len(regions) == 3 and all(Path("/dev/shm", r).exists() for r in regions)
        max_tokens = 4000
        c = StreamClient(s.grpc_url, text=long_prompt(0, 2), params={"max_tokens": max_tokens, "ignore_eos": True})
        assert c.read(until_tokens=2, timeout=60).error is None
        os.kill(pids[0], signal.SIGKILL)
        assert s.proc.wait(timeout=90) == 1
        log = Path(s.log.name).read_text()
        assert f"{role}_0_0's stub (pid {pids[0]}) died" in log, log[-2000:]
        # a killed tritonserver leaves its stubs' shared-memory regions behind; the launcher removes them
        assert not [r for r in regions if Path("/dev/shm", r).exists()]
        r = c.read(timeout=30)
        assert r.error is not None and r.finish_reason is None and len(r.ids) < max_tokens, (r.error, len(r.ids))
        c.cancel()
    finally:
        s.stop()


def test_a_killed_launcher_takes_its_tritonserver_and_stubs_with_it():
    """However `triton-pd serve` dies (SIGKILL here, as an OOM kill or a hard stop would), the kernel sends its
    tritonserver SIGTERM (a parent-death signal), which stops the stubs too: nothing is left holding the ports.
    Before, tritonserver ran on in a session of its own and held its ports for minutes."""
    from backends.supervisor import ports_in_use, process_alive, python_stubs

    s = Server("--model", "random:tiny-test", "--kv-tokens", "512", name="orphan")
    try:
        out = subprocess.run(["pgrep", "-P", str(s.proc.pid), "tritonserver"], capture_output=True, text=True)
        (server_pid,) = [int(p) for p in out.stdout.split()]
        stubs = [pid for pid, _ in python_stubs(server_pid).values()]
        regions = [Path("/dev/shm", r) for _, r in python_stubs(server_pid).values()]
        assert len(stubs) == 3 and all(r.exists() for r in regions), (stubs, regions)
        ports = {"http": s.http, "grpc": s.grpc, "metrics": s.metrics}
        assert len(ports_in_use(ports)) == 3
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(timeout=10)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60 and any(process_alive(p) for p in [server_pid, *stubs]):
            time.sleep(0.2)
        assert not [p for p in [server_pid, *stubs] if process_alive(p)], "left running after the launcher died"
        assert ports_in_use(ports) == []
        assert not [r for r in regions if r.exists()]  # a clean stop: tritonserver removed its stubs' memory
    finally:
        s.stop()
        # what the killed launcher would have removed on its way out: the deployment's mailbox
        config = (s.workdir / "models" / "pd_master" / "config.pbtxt").read_text()
        mailbox = re.search(r'"mailbox_dir":"([^"]+)"', config)
        if mailbox:
            shutil.rmtree(mailbox.group(1), ignore_errors=True)


def test_a_killed_bench_takes_the_servers_it_started_with_it(tmp_path):
    """A script that starts servers through ServerProcess (bench, perf/, these tests) and is killed (SIGKILL, a
    `timeout`, Ctrl-C on its parent) no longer leaves `triton-pd serve` and its tritonserver running: the launcher
    gets a parent-death signal and stops its server."""
    from backends.supervisor import process_alive

    script = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from backends.server_process import ServerProcess; "
        "from pathlib import Path; "
        "s = ServerProcess(['--model', 'random:tiny-test', '--kv-tokens', '512', '--exit-timeout', '2'], "
        "Path(sys.argv[2]) / 'serve.out', workdir=Path(sys.argv[2]) / 'work'); "
        "print(s.proc.pid, s.http, flush=True); time.sleep(600)"
    )
    bench = subprocess.Popen([sys.executable, "-c", script, str(ROOT), str(tmp_path)], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    launcher = None
    try:
        launcher, http = (int(x) for x in bench.stdout.readline().split())
        assert process_alive(launcher)
        bench.kill()
        bench.wait(timeout=10)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60 and process_alive(launcher):
            time.sleep(0.2)
        assert not process_alive(launcher), "the launcher outlived the script that started it"
        from backends.supervisor import ports_in_use

        assert ports_in_use({"http": http}) == []
    finally:
        bench.kill()
        if launcher is not None and process_alive(launcher):  # the failure this test is about: stop it here
            os.kill(launcher, signal.SIGTERM)


def test_a_client_holding_a_stream_open_does_not_hold_the_stop_for_ever():
    """Triton 2.51's shutdown waits for a gRPC stream a client keeps open, past its exit timeout (measured: the
    launcher was still waiting after 60 s). The launcher kills it `--exit-timeout` + 10 s after the stop began."""
    s = Server("--model", "random:tiny-test", "--kv-tokens", "512", "--exit-timeout", "2", name="held")
    try:
        c = StreamClient(s.grpc_url, text="hi", params={"max_tokens": 2, "ignore_eos": True})
        assert c.read(timeout=60).error is None  # answered; the client never closes its stream
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=40) == 0
        assert time.monotonic() - t0 < 2 + 10 + 8, time.monotonic() - t0
        c.cancel()
    finally:
        s.stop()
