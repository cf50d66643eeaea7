"""`triton-pd repository`: the repository it writes, served by the bundled tritonserver binary started directly
(not through `triton-pd serve`), streams answers through pauses exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import pytest

from backends.cli import build_parser
from backends.deployment import Deployment
from backends.server_process import ROOT, free_ports
from tests.server.client import grpc_generate_all

pytestmark = [pytest.mark.server]

N_OUT = 60  # four answers of 12 + 60 tokens need more than twice the 128-slot pool


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        lines = [ln for ln in r.read().decode().splitlines() if ln.startswith(name + "{") or ln.startswith(name + " ")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_a_stock_tritonserver_serves_the_written_repository_through_pauses(tmp_path):
    from backends import repository
    from backends.common.core.request import SamplingParams
    from backends.common.engine.engine import Engine

    out = tmp_path / "repo"
    http, grpc, metrics = free_ports(3)
    args = ["repository", str(out), "--model", "random:tiny-test", "--kv-tokens", "128", "--host-kv-tokens", "0",
            "--max-batch", "8", "--exit-timeout", "2", "--http-port", str(http), "--grpc-port", str(grpc),
            "--metrics-port", str(metrics)]  # fmt: skip
    a = build_parser().parse_args(args)
    assert a.func(a) == 0
    assert {p.name for p in out.iterdir()} == {"pd_master", "pd_decode", "pd_prefill", "internal_key", "README.md"}
    assert "${" not in (out / "pd_decode" / "config.pbtxt").read_text()
    code = out / "pd_master" / "code"
    assert (code / "backends" / "pd_decode" / "model.py").is_file() and (code / "requirements.lock").is_file()
    assert (
        '"project_root" value: { string_value: "../pd_master/code" }'
        in (out / "pd_prefill" / "config.pbtxt").read_text()
    )
    assert repository.cmd_repository(build_parser().parse_args(args)) == 0  # writing it again is allowed
    (out / "notes.txt").write_text("mine")
    assert repository.cmd_repository(build_parser().parse_args(args)) == 2  # a folder with other files is not
    (out / "notes.txt").unlink()

    # the models run the repository's own copy of the code (this line, added to the copy only, says so in the log)
    marker = f"triton-pd code copy in use: {code}"
    with open(code / "backends" / "__init__.py", "a") as f:
        f.write(f"\nprint({marker!r}, flush=True)\n")
    argv, env = repository.server_command(Deployment.from_args(a, 0), out, a)
    assert argv[0].endswith("tritonserver") and f"--model-repository={out}" in argv
    log = open(tmp_path / "tritonserver.log", "w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, (tmp_path / "tritonserver.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() - t0 < 120, "not ready"
            time.sleep(0.5)
        prompts = [[72 + i, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33] for i in range(4)]
        params = [{"max_tokens": N_OUT, "ignore_eos": True, "temperature": 0} for _ in range(3)]
        params.append({"max_tokens": N_OUT, "ignore_eos": True, "temperature": 0.8, "seed": 7})
        got = grpc_generate_all(f"127.0.0.1:{grpc}", prompts, params, timeout=120)
        engine = Engine("random:tiny-test", dtype="float32", device="cpu", kv_tokens=4096)
        want = engine.generate(prompts, [SamplingParams(**p) for p in params])
        for r, w in zip(got, want):
            assert r.error is None and r.finish_reason == "length", r
            assert r.ids == w.output_ids
        assert metric(metrics, "pd_pauses_total") > 0
        assert (tmp_path / "tritonserver.log").read_text().count(marker) >= 3  # master, decode and prefill stubs
        deadline = time.monotonic() + 5
        names = ("pd_decode_running_requests", "pd_decode_paused_requests", "pd_kv_slots_used")
        while any(metric(metrics, n) for n in names) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [metric(metrics, n) for n in names] == [0, 0, 0]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
