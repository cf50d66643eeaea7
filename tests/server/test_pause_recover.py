"""Pause and recovery end to end: a 1024-token decode pool and answers that need far more than that."""

from __future__ import annotations

import pytest

from backends.common.request import SamplingParams
from tests.server.client import StreamClient, grpc_generate, grpc_generate_all
from tests.server.conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

TOPICS = ["the history of astronomy", "how bridges are built", "the life cycle of stars", "ocean currents"]
N_OUT = 300  # with prompts of ~200 tokens, four answers need twice the 1024-slot pool


@pytest.fixture(scope="module")
def tight():
    s = Server("--kv-tokens", "1024", "--fault-injection", "stale", name="tight")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def forced():
    """Decode keeps no paused KV: every recovery recomputes through prefill under a new epoch. No rotation: every
    turn would be a prefill recompute, which on a 2-core CPU costs minutes (the `tight` server tests rotation)."""
    s = Server(
        "--kv-tokens", "768", "--rotation-quantum", "0", "--fault-injection", "stale,drop_paused_kv", name="forced"
    )  # fmt: skip
    yield s
    s.stop()


def prompt_ids(engine, i: int) -> list[int]:
    text = (
        f"Write a long, detailed essay about {TOPICS[i]}. Cover its origins, the key people involved, the "
        "important discoveries, the controversies, and what remains unknown today. "
    ) * 6
    return engine.tokenizer.encode(text)[: 190 + 5 * i]


SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}


def params(i: int, n_out: int = N_OUT) -> dict:
    base = {"max_tokens": n_out, "ignore_eos": True}
    return {**base, **SEEDED} if i == 3 else {**base, "temperature": 0}


@pytest.fixture(scope="module")
def expected(engine):
    prompts = [prompt_ids(engine, i) for i in range(4)]
    outs = engine.generate(prompts, [SamplingParams(**params(i)) for i in range(4)])
    return prompts, [o.output_ids for o in outs]


def run_streams(server, prompts, n_out: int = N_OUT) -> list:
    return grpc_generate_all(server.grpc_url, prompts, [params(i, n_out) for i in range(len(prompts))])


def test_four_streams_on_1024_slots_pause_and_recover_exactly(tight, expected):
    prompts, want = expected
    results = run_streams(tight, prompts)
    for i, (res, exp) in enumerate(zip(results, want)):
        assert res.error is None, res.error
        assert res.finish_reason == "length"
        assert len(res.ids) == N_OUT  # continuous: nothing lost, nothing twice
        assert res.ids == exp, f"stream {i} differs from the offline engine"  # stream 3: seeded sampling
    assert tight.metric("pd_pauses_total") > 0
    # the defaults rotate turns (--rotation-quantum) and keep paused KV in host memory (--host-kv-tokens)
    assert tight.metric("pd_rotations_total") > 0
    assert tight.metric("pd_recoveries_total", path="host") > 0
    assert tight.metric("pd_host_swapped_tokens_total", direction="in") > 0
    # every recovery's completion was re-delivered under its old epoch: dropped and counted
    recoveries = sum(tight.metric("pd_recoveries_total", path=p) for p in ("host", "prefill"))
    assert tight.metric("pd_stale_messages_total") >= recoveries
    assert tight.wait_metric("pd_kv_slots_used", lambda v: v == 0) == 0
    assert tight.metric("pd_kv_slots_free") + tight.metric("pd_kv_slots_cached") == 1024
    assert tight.wait_metric("pd_host_kv_slots_used", lambda v: v == 0) == 0  # every host copy freed


def test_closing_streams_while_paused_frees_everything(tight, engine):
    clients = [StreamClient(tight.grpc_url, ids=prompt_ids(engine, i), params=params(i)) for i in range(4)]
    tight.wait_paused()
    for c in clients:
        c.cancel()
    tight.assert_released(timeout=2.0)
    assert tight.metric("pd_kv_slots_total") == 1024
    assert tight.metric("pd_host_kv_slots_used") == 0  # copies of cancelled requests freed too
    res = grpc_generate(tight.grpc_url, text="Hello", params={"max_tokens": 4, "temperature": 0})
    assert res.error is None and len(res.ids) == 4


def test_prefill_recovery_epoch_3_still_exact(forced, expected):
    """Every pause recovers through prefill; some request reaches epoch >= 3; all tokens still exact."""
    prompts, want = expected
    results = run_streams(forced, prompts)
    for i, (res, exp) in enumerate(zip(results, want)):
        assert res.error is None, res.error
        assert res.finish_reason == "length" and res.ids == exp, f"stream {i}"
    assert forced.metric("pd_recoveries_total", path="local") == 0
    assert forced.metric("pd_recoveries_total", path="host") == 0
    assert forced.metric("pd_recoveries_total", path="prefill") >= 3
    assert forced.metric("pd_recovery_epoch_max") >= 3
    assert forced.metric("pd_stale_messages_total") >= forced.metric("pd_recoveries_total", path="prefill")
    assert forced.metric("pd_prefill_jobs_total", kind="recovery") >= 3
    assert forced.wait_metric("pd_kv_slots_used", lambda v: v == 0) == 0


def test_restart_baseline_resubmits_ids_and_loses_nothing(expected):
    """--on-decode-oom restart (the comparison baseline): a segment that runs out of KV ends, and master re-submits
    prompt + generated ids. Answers stay whole; greedy ones equal the offline engine's (ids are never re-tokenised,
    so the recomputed context is exactly the one decode lost)."""
    prompts, want = expected
    n = 200  # four ~400-token contexts on 1024 slots still restart; greedy answers are prefixes of the longer ones
    s = Server("--kv-tokens", "1024", "--on-decode-oom", "restart", name="restart")
    try:
        results = run_streams(s, prompts, n)
        for i, (res, exp) in enumerate(zip(results, want)):
            assert res.error is None, res.error
            assert res.finish_reason == "length"
            assert len(res.ids) == n
            if params(i)["temperature"] == 0:
                assert res.ids == exp[:n], f"greedy stream {i} differs from the offline engine after restarts"
        assert s.metric("pd_restarts_total") > 0
        assert s.metric("pd_pauses_total") == 0
        s.assert_released(timeout=10)
    finally:
        s.stop()
