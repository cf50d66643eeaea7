"""Many short streams at once: the pattern under which Triton 2.51's pd_master stub corrupted its heap and died.

Before pd_master held on to its drained BLS response iterators (DrainedStreams), the stub freed each iterator's
numpy arrays from a thread without the GIL; with 12-16 clients opening short streams, the stub failed after 95 to
about 1,200 requests ("Cannot create a circular NumPy array 'base' dependency", then "stub died")."""

from __future__ import annotations

import threading

import pytest

from .client import StreamClient
from .conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

CLIENTS = 16
REQUESTS_EACH = 100


@pytest.fixture(scope="module")
def churn_server():
    s = Server("--kv-tokens", "4096", name="churn")
    yield s
    s.stop()


def test_many_short_streams_all_answered_and_server_stays_up(churn_server):
    s = churn_server
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
            try:
                r = c.read(timeout=120)
            finally:
                c.client.stop_stream()
                c.client.close()
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
    # the protection itself: master held the streams that had just ended, then let them all go
    assert held_at_end > 0
    assert s.wait_metric("pd_master_drained_streams_held", lambda v: v == 0, timeout=15.0) == 0
