"""A hybrid (Qwen3-Next) model served end to end: streams that pause and recover, through decode's own cache,
through host memory (K/V and state) and through prefill, equal the offline engine token for token; cancelling
paused streams gives back every KV slot, state page and host page; the metrics show the state pool."""

from __future__ import annotations

import pytest

from backends.common.request import SamplingParams
from tests.hybrid.conftest import hybrid_folder, make_engine, prompt, qwen3_5_moe_saved  # noqa: F401 (fixtures)
from tests.server.client import StreamClient, grpc_generate, grpc_generate_all
from tests.server.conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

N_OUT = 160
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 99}


def params(i: int, n_out: int = N_OUT) -> dict:
    base = {"max_tokens": n_out, "ignore_eos": True}
    return {**base, **SEEDED} if i == 3 else {**base, "temperature": 0}


def prompts():
    return [prompt(300 + i, 50 + 9 * i) for i in range(4)]


@pytest.fixture(scope="module")
def expected(hybrid_folder):  # noqa: F811
    outs = make_engine(hybrid_folder).generate(prompts(), [SamplingParams(**params(i)) for i in range(4)])
    return [o.output_ids for o in outs]


def assert_state_released(server, timeout: float = 10.0) -> None:
    assert server.wait_metric("pd_state_pages_used", lambda v: v == 0, timeout=timeout) == 0
    total = server.metric("pd_state_pages_total")
    assert total > 0 and server.metric("pd_state_pages_free") + server.metric("pd_state_pages_cached") == total


def run_streams(server, n_out: int = N_OUT) -> list:
    return grpc_generate_all(server.grpc_url, prompts(), [params(i, n_out) for i in range(4)])


@pytest.fixture(scope="module")
def tight(hybrid_folder):  # noqa: F811
    s = Server("--model", str(hybrid_folder), "--kv-tokens", "320", "--fault-injection", "stale", name="hybrid")
    yield s
    s.stop()


def test_hybrid_streams_pause_and_recover_exactly(tight, expected):
    results = run_streams(tight)
    for i, (res, want) in enumerate(zip(results, expected)):
        assert res.error is None, res.error
        assert res.finish_reason == "length" and len(res.ids) == N_OUT
        assert res.ids == want, f"stream {i} differs from the offline engine"  # stream 3: seeded sampling
    assert tight.metric("pd_pauses_total") > 0
    # decode's own cache: a whole paused history resumes at once ("local"); one whose tail was trimmed resumes from
    # its last state checkpoint with decode recomputing the few positions after it ("recompute")
    paths = {p: tight.metric("pd_recoveries_total", path=p) for p in ("local", "recompute", "prefill")}
    print("hybrid recoveries by path:", paths)
    assert paths["local"] + paths["recompute"] > 0
    assert tight.metric("pd_host_kv_slots_total") == 0  # the host tier is off by default for a hybrid model
    assert tight.wait_metric("pd_kv_slots_used", lambda v: v == 0) == 0
    assert_state_released(tight)


def test_hybrid_cancel_while_paused_frees_slots_and_state(tight):
    clients = [StreamClient(tight.grpc_url, ids=p, params=params(i, 2000)) for i, p in enumerate(prompts())]
    tight.wait_paused()
    for c in clients:
        c.cancel()
    tight.assert_released(timeout=5.0)
    assert_state_released(tight)
    res = grpc_generate(tight.grpc_url, ids=[5, 6, 7], params={"max_tokens": 4, "temperature": 0})
    assert res.error is None and len(res.ids) == 4


def test_hybrid_prefill_recovery_carries_the_state(hybrid_folder, expected):  # noqa: F811
    """Decode keeps no paused KV or state: every recovery recomputes through prefill and writes K/V and state back
    under a new epoch; the answers are still exact."""
    s = Server(
        "--model", str(hybrid_folder), "--kv-tokens", "320", "--rotation-quantum", "0",
        "--fault-injection", "stale,drop_paused_kv", name="hybrid-forced",
    )  # fmt: skip
    try:
        results = run_streams(s)
        for i, (res, want) in enumerate(zip(results, expected)):
            assert res.error is None, res.error
            assert res.ids == want, f"stream {i}"
        assert s.metric("pd_recoveries_total", path="local") == 0
        assert s.metric("pd_recoveries_total", path="prefill") >= 2
        assert s.metric("pd_stale_messages_total") >= s.metric("pd_recoveries_total", path="prefill")
        assert s.wait_metric("pd_kv_slots_used", lambda v: v == 0) == 0
        assert_state_released(s)
    finally:
        s.stop()


def test_hybrid_host_recoveries_carry_the_state(hybrid_folder, expected):  # noqa: F811
    """With a host tier, paused requests' K/V and state go to host memory and come back from it; the answers equal
    the offline engine's, and host slots and host state pages are all free once the streams end."""
    s = Server("--model", str(hybrid_folder), "--kv-tokens", "320", "--host-kv-tokens", "2048", name="hybrid-host")
    try:
        results = run_streams(s)
        for i, (res, want) in enumerate(zip(results, expected)):
            assert res.error is None, res.error
            assert res.ids == want, f"stream {i}"
        assert s.metric("pd_recoveries_total", path="host") > 0
        assert s.metric("pd_host_state_pages_total") > 0
        assert s.wait_metric("pd_host_state_pages_used", lambda v: v == 0) == 0
        assert s.wait_metric("pd_host_kv_slots_used", lambda v: v == 0) == 0
        assert s.wait_metric("pd_kv_slots_used", lambda v: v == 0) == 0
        assert_state_released(s)
    finally:
        s.stop()


def test_qwen3_5_moe_checkpoint_served_through_host_recoveries_equals_offline(qwen3_5_moe_saved):  # noqa: F811
    """A Qwen3.5 MoE checkpoint in transformers' multimodal layout (tests/hybrid/test_qwen3_5.py: equal to
    transformers offline), served: streams paused and recovered from host memory, greedy and seeded, equal the
    offline engine's token for token, and every slot and page is free afterwards."""
    folder, _ = qwen3_5_moe_saved
    outs = make_engine(folder).generate(prompts(), [SamplingParams(**params(i)) for i in range(4)])
    s = Server("--model", str(folder), "--kv-tokens", "320", "--host-kv-tokens", "2048", name="qwen3.5-moe")
    try:
        for i, (res, want) in enumerate(zip(run_streams(s), outs)):
            assert res.error is None, res.error
            assert res.ids == want.output_ids, f"stream {i}"
        assert s.metric("pd_pauses_total") > 0 and s.metric("pd_recoveries_total", path="host") > 0
        assert s.wait_metric("pd_host_kv_slots_used", lambda v: v == 0) == 0
        assert s.wait_metric("pd_kv_slots_used", lambda v: v == 0) == 0
        assert_state_released(s)
    finally:
        s.stop()
