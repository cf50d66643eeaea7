"""Liveness and cancellation on a real server: a prompt that can never fit is refused, a request that fills the
pool ends with "length", the progress watchdog reports a stall, and a client closing its stream (gRPC or HTTP)
ends its request within a second wherever it is: queued, running, recovering, or in prefill."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from backends.pd_prefill.model import SLOW_RECOVERY_SECONDS
from tests.server.client import StreamClient, grpc_generate
from tests.server.conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

POOL = 400


@pytest.fixture(scope="module")
def slow():
    """Every prefill batch waits 3 s first (watching for cancellations; 10 s with a recovery job), paused KV is
    dropped so that recovery goes through prefill, at most 2 requests decode at once, and decode reports a stall
    after 1 s without progress. No rotation: these tests drive requests into given states (a request paused until
    another finishes), which turns taken every 0.1 s would reshuffle; rotation has its own tests
    (test_pause_recover, test_host_tier)."""
    s = Server(
        "--kv-tokens", str(POOL), "--max-batch", "2", "--stall-seconds", "1", "--rotation-quantum", "0",
        "--fault-injection", "slow_prefill,slow_recovery,drop_paused_kv",
        name="liveness",
    )  # fmt: skip
    yield s
    s.stop()


def ids(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


def wait_for(server, name, predicate, timeout, **labels) -> None:
    """Fails unless the metric satisfies predicate within timeout seconds."""
    v = server.wait_metric(name, predicate, timeout=timeout, **labels)
    assert predicate(v), f"{name}{labels} = {v} after {timeout} s"


def test_prompt_that_can_never_fit_is_refused_naming_the_field(slow):
    res = grpc_generate(slow.grpc_url, ids=ids(POOL, 300), params={"max_tokens": 4})
    assert res.error is not None and res.error.split(": ", 1)[1].startswith("input_ids"), res.error
    assert f"at most {POOL}" in res.error
    slow.assert_released(timeout=2.0)


def test_request_that_fills_the_pool_ends_with_length(slow):
    res = grpc_generate(slow.grpc_url, ids=ids(POOL - 20, 300), params={"max_tokens": 100, "ignore_eos": True})
    assert res.error is None and res.finish_reason == "length" and len(res.ids) == 20
    slow.assert_released(timeout=2.0)


def test_watchdog_reports_no_progress_with_work_waiting(slow):
    before = slow.metric("pd_decode_stalls_total")
    res = grpc_generate(slow.grpc_url, text="Hello", params={"max_tokens": 4, "temperature": 0})
    assert res.error is None and len(res.ids) == 4
    assert slow.metric("pd_decode_stalls_total") >= before + 1  # 3 s in prefill, nothing else moved
    log = (slow.workdir / "tritonserver.log").read_text(errors="replace")
    assert "no progress for" in log and "waiting_kv 1" in log
    assert slow.wait_metric("pd_decode_stalled_seconds", lambda v: v == 0) == 0


def test_cancel_while_in_prefill_ends_it_in_prefill_within_a_second(slow):
    before = slow.metric("pd_prefill_cancelled_total")
    c = StreamClient(slow.grpc_url, text="Hello again", params={"max_tokens": 50})
    wait_for(slow, "pd_decode_queued_requests", lambda v: v == 1, 5)
    time.sleep(0.5)  # inside prefill's 3 s
    c.cancel()
    wait_for(slow, "pd_prefill_cancelled_total", lambda v: v == before + 1, 1.0)
    wait_for(slow, "pd_decode_queued_requests", lambda v: v == 0, 1.0)
    slow.assert_released(timeout=1.0)
    assert slow.wait_metric("pd_master_inflight_requests", lambda v: v == 0, timeout=1.0) == 0


def test_cancel_reaches_queued_running_and_recovering_requests(slow):
    """A and B decode (max-batch 2) and C waits for a batch row. Cancel C (queued). B is paused when the pool fills
    and, with its KV dropped, recovers through prefill once A is done; cancel it while prefill recomputes it."""
    cancelled_before = slow.metric("pd_prefill_cancelled_total")
    recoveries_before = slow.read_metrics({"r": ("pd_prefill_jobs_total", {"kind": "recovery"})})["r"]
    a = StreamClient(slow.grpc_url, ids=ids(150, 1000), params={"max_tokens": 120, "ignore_eos": True})
    b = StreamClient(slow.grpc_url, ids=ids(150, 2000), params={"max_tokens": 300, "ignore_eos": True})
    wait_for(slow, "pd_decode_running_requests", lambda v: v == 2, 30)
    c = StreamClient(slow.grpc_url, ids=ids(20, 3000), params={"max_tokens": 50})
    wait_for(slow, "pd_decode_queued_requests", lambda v: v == 1, 5)
    c.cancel()
    wait_for(slow, "pd_decode_queued_requests", lambda v: v == 0, 1.0)
    wait_for(slow, "pd_decode_recovering_requests", lambda v: v == 1, 120)
    assert a.read(timeout=60).finish_reason == "length" and len(a.result.ids) == 120
    # B's recovery job has reached prefill (counted on arrival), which holds it for SLOW_RECOVERY_SECONDS (10 s)
    wait_for(slow, "pd_prefill_jobs_total", lambda v: v == recoveries_before + 1, 10, kind="recovery")
    b.cancel()
    slow.assert_released(timeout=1.0)  # the request ends within a second
    # ... and prefill dropped the job instead of computing it: counted only when prefill drops it, inside its 10 s
    # hold or while it computes (a notice after the job finished is not counted). On a loaded 2-core machine the
    # notice's way through master, decode's mailbox and prefill's poll took over 1 s once, over 2.5 s in a `make
    # test` of 2026-12-05 and, in another, more than the 3 s the hold then lasted (the test alone: well within)
    wait_for(slow, "pd_prefill_cancelled_total", lambda v: v == cancelled_before + 1, SLOW_RECOVERY_SECONDS)
    assert slow.wait_metric("pd_master_inflight_requests", lambda v: v == 0, timeout=1.0) == 0
    a.close()
    # running: cancel a decoding stream
    d = StreamClient(slow.grpc_url, text="Count to a thousand:", params={"max_tokens": 300, "ignore_eos": True})
    assert d.read(until_tokens=3, timeout=60).error is None
    d.cancel()
    slow.assert_released(timeout=1.0)
    assert slow.wait_metric("pd_master_inflight_requests", lambda v: v == 0, timeout=1.0) == 0


def http_stream(server, body: dict) -> socket.socket:
    """A generate_stream request on a raw socket: Triton sends the HTTP headers with the first response, so
    http.client could not return before the first token."""
    data = json.dumps(body).encode()
    host, port = server.http_url.split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    head = (
        "POST /v2/models/pd_master/generate_stream HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_http_disconnect_while_running_ends_the_request_within_a_second(slow):
    body = {"text_input": "Tell me a story", "stream": True}
    sock = http_stream(slow, {**body, "sampling_parameters": json.dumps({"max_tokens": 300, "ignore_eos": True})})
    got = b""
    while got.count(b"data:") < 3:
        got += sock.recv(4096)
    assert b" 200 " in got.split(b"\r\n", 1)[0] and slow.metric("pd_decode_running_requests") == 1
    sock.close()
    slow.assert_released(timeout=1.0)
    assert slow.wait_metric("pd_master_inflight_requests", lambda v: v == 0, timeout=1.0) == 0


def test_http_disconnect_before_the_first_token_ends_it_at_its_first_response(slow):
    """Triton 2.51's HTTP frontend notices a closed connection only when it writes to it (measured: a request
    whose client left during its 3 s prefill stayed in flight until then). The request ends as soon as its first
    response is written: within a second of prefill's answer, and nothing is left."""
    body = {"text_input": "Tell me a story", "stream": True}
    sock = http_stream(slow, {**body, "sampling_parameters": json.dumps({"max_tokens": 300, "ignore_eos": True})})
    wait_for(slow, "pd_decode_queued_requests", lambda v: v == 1, 5)
    time.sleep(0.3)
    sock.close()
    wait_for(slow, "pd_master_inflight_requests", lambda v: v == 0, 3.0 + 1.0)  # prefill's 3 s, then 1 s
    slow.assert_released(timeout=1.0)


def test_still_serves_and_nothing_is_left(slow):
    res = grpc_generate(slow.grpc_url, text="Hello", params={"max_tokens": 3, "temperature": 0})
    assert res.error is None and len(res.ids) == 3
    slow.assert_released(timeout=2.0)
    assert slow.metric("pd_decode_invariant_violations_total") == 0
    assert not list(Path("/dev/shm").glob(f"triton-pd-*/{'*'}:*")), "prefill notices left behind"


def test_replay_ends_on_stuck_streams_and_cancels_them(slow):
    """The replay benchmark never waits for ever: silent streams are counted 'stuck' and cancelled, the run's
    wall-clock limit ends the rest as 'unfinished', and the server is left with nothing."""
    from backends import replay as rp

    reqs = [rp.TraceRequest(0.0, 12, 8), rp.TraceRequest(0.1, 12, 8)]
    prompts = [ids(12, 5000), ids(12, 6000)]
    t0 = time.monotonic()
    # waiting for a first token is a queue wait: bounded by the per-request timeout
    recs, _, wall = rp.replay(slow.grpc_url, None, reqs, prompts, timeout=1.0, stuck_after=0.5, run_limit=30)
    assert [r.error_kind for r in recs] == ["timeout", "timeout"] and wall < 10, (recs, wall)
    slow.assert_released(timeout=5.0)
    summary = rp.summarize(recs, [], wall)
    assert summary["errors_by_kind"] == {"timeout": 2} and "limit of 1 s" in summary["error_messages"]["timeout"][0][0]
    recs, _, wall = rp.replay(slow.grpc_url, None, reqs, prompts, stuck_after=60, run_limit=1.0)
    assert {r.error_kind for r in recs} == {"unfinished"} and wall < 15 and time.monotonic() - t0 < 30
    slow.assert_released(timeout=5.0)


def test_replay_counts_a_stream_that_goes_silent_as_stuck(slow):
    """Tokens flow, then nothing: a request paused with its KV dropped waits for its turn and then 10 s for
    prefill's recovery, longer than stuck_after. The stream is cancelled and counted 'stuck'; the other finishes."""
    from backends import replay as rp

    reqs = [rp.TraceRequest(0.0, 150, 120), rp.TraceRequest(0.0, 150, 300)]
    prompts = [ids(150, 7000), ids(150, 8000)]
    recs, _, wall = rp.replay(slow.grpc_url, None, reqs, prompts, timeout=120, stuck_after=2.0, run_limit=120)
    kinds = sorted(str(r.error_kind) for r in recs)
    assert kinds == ["None", "stuck"], [(r.error_kind, r.error, len(r.token_times)) for r in recs]
    stuck = next(r for r in recs if r.error_kind == "stuck")
    assert 0 < len(stuck.token_times) < 300 and "no response for" in stuck.error
    slow.assert_released(timeout=5.0)
