"""Many short streams at once: the pattern under which Triton 2.51's pd_master stub corrupted its heap and died.

Before pd_master held on to its drained BLS response iterators until the stub had dropped its own reference
(DrainedStreams), the stub freed each iterator's numpy arrays from a thread without the GIL; with 12-16 clients
opening short streams, the stub failed after 95 to about 1,200 requests ("Cannot create a circular NumPy array
'base' dependency", then "stub died"). Also 256 concurrent streams under the default stream limit."""

from __future__ import annotations

import threading

import pytest

from .client import StreamClient
from .conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

CLIENTS = 16
REQUESTS_EACH = 80  # 1,280 requests: the stub failed after 95 to about 1,200 of them


def test_many_short_streams_all_answered_and_server_stays_up(tiny_server):
    s = tiny_server
    results: list[tuple[int, object]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for n in range(REQUESTS_EACH):
            want = 3 + (i + n) % 5
            c = StreamClient(
                s.grpc_url,
                text=f"Client {i} asks question number {n}:",
                params={"max_tokens": want, "temperature": 0, "ignore_eos": True},
            )
            r = None
            try:
                r = c.read(timeout=120)
            finally:
                # a plain close waits for the server to end the stream: one that is stuck would hang the test
                c.close() if r is not None and r.finish_reason is not None else c.cancel()
            with lock:
                results.append((want, r))
            if r.error is not None:
                return  # the first failure is enough; the assertions below report it

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held_at_end = s.metric("pd_master_drained_streams_held")
    errors = [r.error for _, r in results if r.error is not None]
    assert not errors, f"{len(errors)} of {len(results)} requests failed, first: {errors[0]}"
    assert len(results) == CLIENTS * REQUESTS_EACH
    assert all(len(r.ids) == want and r.finish_reason == "length" for want, r in results)
    assert s.proc.poll() is None, "the server stopped"
    s.assert_released(timeout=5.0)  # no request left on decode in any state, no KV slot in use
    assert s.metric("pd_requests_total", outcome="error") == 0
    # the protection itself: every relay queried past its own stream's end, so nothing waits to be let go
    assert held_at_end == 0
    assert s.metric("pd_master_drained_streams_held") == 0


STREAMS = 256


def test_256_concurrent_streams_with_the_default_stream_limit():
    """256 clients at once under the defaults (--max-batch 256, so --max-streams 256 and a Python backend pool of
    320 threads, where it was 64 streams before): all decode streams open at once, every answer is complete, the
    server stays up, and master lets go of every drained stream without a timed hold. (At 512 streams tritonserver
    2.51 itself crashed in one of three runs: see sizing.default_max_streams.) On random:tiny-test with answers of
    60 tokens, so that most streams are open when the last one arrives (with 24 tokens the first answers ended
    before the last streams opened, and 97 were open at once); SmolLM2's steps took twice the time. How many are
    open at once depends on how fast 256 client threads get their streams out on a busy 2-core host (118 once, with
    other work on the host), so the peak is checked against the old limit of 64, the regression this guards."""
    s = Server("--model", "random:tiny-test", "--kv-tokens", "16384", name="streams512")
    try:
        peak, stop = [0.0], threading.Event()

        def watch() -> None:  # decode's requests in any state: the streams master has open at once
            while not stop.wait(0.2):
                try:
                    n = sum(
                        s.metric(m)
                        for m in ("pd_decode_running_requests", "pd_decode_queued_requests",
                                  "pd_decode_paused_requests", "pd_decode_recovering_requests")
                    )  # fmt: skip
                except Exception:
                    continue
                peak[0] = max(peak[0], n)

        watcher = threading.Thread(target=watch)
        watcher.start()
        clients = [
            StreamClient(
                s.grpc_url,
                text=f"Stream {i} of many:",
                params={"max_tokens": 60 + i % 3, "temperature": 0, "ignore_eos": True},
            )
            for i in range(STREAMS)
        ]
        results = [None] * STREAMS

        def read(i: int) -> None:
            results[i] = clients[i].read(timeout=400)

        readers = [threading.Thread(target=read, args=(i,)) for i in range(STREAMS)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        stop.set()
        watcher.join()
        for c in clients:
            c.close()
        errors = [r.error for r in results if r.error is not None]
        assert not errors, f"{len(errors)} of {STREAMS} failed, first: {errors[0]}"
        assert all(len(r.ids) == 60 + i % 3 and r.finish_reason == "length" for i, r in enumerate(results))
        assert peak[0] > 64, f"at most {peak[0]:.0f} decode streams were open at once"  # the old limit
        assert s.proc.poll() is None, "the server stopped"
        s.assert_released(timeout=10.0)
        assert s.wait_metric("pd_master_drained_streams_held", lambda v: v == 0, timeout=5.0) == 0
        # master counts a request out after its last answer is sent: the client can see the answer first
        assert s.wait_metric("pd_master_inflight_requests", lambda v: v == 0, timeout=5.0) == 0
    finally:
        s.stop()
