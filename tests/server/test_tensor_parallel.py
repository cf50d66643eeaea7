"""Tensor parallelism through a real tritonserver (random:tiny-test on the CPU). `--decode-tp 2` with prefill TP 1
writing each KV head into the decode rank that holds it: answers equal the offline engine's through pauses
recovered by prefill, and close-all frees everything; a killed worker rank fails the decode instance naming the
rank, and the server stops. `--prefill-tp 2` into a decode of one rank: the same answers, and no pool left."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from backends.common.core.request import SamplingParams
from backends.common.engine.engine import Engine
from tests.server.client import StreamClient, grpc_generate_all
from tests.server.conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

POOL = 160
N_OUT = 60  # three answers of 24 + 60 tokens need more than the pool: pauses, recovered by prefill


def prompts() -> list[list[int]]:
    return [[(13 * j + 7 * i + 3) % 300 for j in range(24)] for i in range(3)]


def test_decode_tp2_answers_exactly_through_prefill_recovery_and_a_killed_rank_stops_it():
    e = Engine("random:tiny-test", kv_tokens=1024, backend="torch")
    try:
        want = [o.output_ids for o in e.generate(prompts(), SamplingParams(max_tokens=N_OUT, temperature=0))]
    finally:
        e.close()
    s = Server("--model", "random:tiny-test", "--kv-tokens", str(POOL), "--decode-tp", "2", "--fault-injection",
               "drop_paused_kv", name="tp2")  # fmt: skip
    try:
        params = {"max_tokens": N_OUT, "temperature": 0, "ignore_eos": True}
        results = grpc_generate_all(s.grpc_url, prompts(), [params] * 3)
        for i, (res, exp) in enumerate(zip(results, want)):
            assert res.error is None, res.error
            assert res.ids == exp, f"stream {i} differs from the offline engine"
        assert s.metric("pd_pauses_total") > 0
        assert s.metric("pd_recoveries_total", path="prefill") > 0  # prefill TP 1 into the TP-2 pool
        s.assert_released(timeout=5.0)

        workers = subprocess.run(["pgrep", "-f", "backends.common.engine.tp_worker"], capture_output=True,
                                 text=True).stdout.split()  # fmt: skip
        mine = [int(p) for p in workers if _is_descendant(int(p), s.proc.pid)]  # this server's
        assert len(mine) == 1, (workers, mine)
        os.kill(mine[0], signal.SIGKILL)
        c = StreamClient(s.grpc_url, ids=[(5 * j + 1) % 300 for j in range(20)], params=params)  # a new prompt
        res = c.read(timeout=60)
        c.cancel()
        assert res.error is not None and len(res.ids) < N_OUT
        assert s.proc.wait(timeout=90) == 1  # the launcher stops tritonserver and exits non-zero
        logs = s.log_tail(20000)
        assert "pd_decode_0_0's stub" in logs and "died" in logs, logs[-2000:]
        assert f"tensor-parallel rank 1 of 2 (pid {mine[0]}) exited with code -9" in logs, logs[-2000:]
    finally:
        s.stop()


def _is_descendant(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def test_prefill_tp2_hands_off_into_a_decode_of_one_rank_exactly():
    """--prefill-tp 2 with decode on one rank: each recovery's K/V comes from both prefill ranks' pools into
    decode's; answers equal the offline engine's, everything is released, and the stop leaves no pool behind."""
    n_out = 120  # longer than N_OUT: with prefill split two ways (slower on a busy host) answers still overlap
    e = Engine("random:tiny-test", kv_tokens=1024, backend="torch")
    try:
        want = [o.output_ids for o in e.generate(prompts(), SamplingParams(max_tokens=n_out, temperature=0))]
    finally:
        e.close()
    before = {f for f in os.listdir("/dev/shm") if f.startswith("tpd_")}
    s = Server("--model", "random:tiny-test", "--kv-tokens", str(POOL), "--prefill-tp", "2", "--host-kv-tokens",
               "0", "--fault-injection", "drop_paused_kv", name="ptp2")  # fmt: skip
    try:
        params = {"max_tokens": n_out, "temperature": 0, "ignore_eos": True}
        results = grpc_generate_all(s.grpc_url, prompts(), [params] * 3)
        assert [(r.error, r.ids) for r in results] == [(None, w) for w in want]
        assert s.metric("pd_recoveries_total", path="prefill") > 0
        s.assert_released(timeout=5.0)
    finally:
        s.stop()
    # the workers' pools (".r1"; only the tests of this module make them) went with the server
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("tpd_") and ".r" in f]
