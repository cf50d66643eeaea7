"""A hybrid (Qwen3-Next) model through the three roles in one process (tests/inprocess/fake_triton.py): streams
that pause and recover through decode's own cache, through host memory (K/V and state) and through prefill equal
the offline engine token for token; cancelling paused streams gives back every KV slot, state page and host page;
the metrics show the state pool. (These ran as real-server tests before: about 2-4 s each here. The roles' code is
the same; a real server with a hybrid model is still started by tests/server/test_speculative.py.)"""

from __future__ import annotations

import pytest

from backends.common.core.request import ReqState, SamplingParams
from tests.hybrid.conftest import hybrid_folder, make_engine, prompt, qwen3_5_moe_saved  # noqa: F401 (fixtures)
from tests.inprocess.fake_triton import Server, generate

N_OUT = 160
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 99}
TIGHT = {"kv_tokens": 320}


def params(i: int, n_out: int = N_OUT) -> dict:
    base = {"max_tokens": n_out, "ignore_eos": True}
    return {**base, **SEEDED} if i == 3 else {**base, "temperature": 0}


def prompts():
    return [prompt(300 + i, 50 + 9 * i) for i in range(4)]


@pytest.fixture(scope="module")
def expected(hybrid_folder):  # noqa: F811
    outs = make_engine(hybrid_folder).generate(prompts(), [SamplingParams(**params(i)) for i in range(4)])
    return [o.output_ids for o in outs]


@pytest.fixture
def serve(serve_model):
    return serve_model


def run_streams(s: Server, n_out: int = N_OUT) -> list:
    answers = [generate(s, p, **params(i, n_out)) for i, p in enumerate(prompts())]
    return [a.wait() for a in answers]


def assert_exact(answers, expected) -> None:
    for i, (a, want) in enumerate(zip(answers, expected)):
        assert a.error is None, a.error
        assert a.finish_reason == "length" and len(a.ids) == N_OUT
        assert a.ids == want, f"stream {i} differs from the offline engine"  # stream 3: seeded sampling


def assert_released(s: Server) -> None:
    assert s.wait_metric("pd_kv_slots_used", lambda v: v == 0) == 0
    assert s.wait_metric("pd_state_pages_used", lambda v: v == 0) == 0
    total = s.metric("pd_state_pages_total")
    assert total > 0 and s.metric("pd_state_pages_free") + s.metric("pd_state_pages_cached") == total
    assert not s.decode.sched.reqs and not s.decode.sched.check_invariants()


def test_hybrid_streams_pause_and_recover_exactly(serve, hybrid_folder, expected):  # noqa: F811
    """Without a host tier, paused streams resume from decode's own cache; the answers are exact."""
    s = serve(hybrid_folder, **TIGHT, host_kv_tokens=0, fault_injection="stale")
    assert_exact(run_streams(s), expected)
    assert s.metric("pd_pauses_total") > 0
    # decode's own cache: a whole paused history resumes at once ("local"); one whose tail was trimmed resumes from
    # its last state checkpoint with decode recomputing the few positions after it ("recompute")
    paths = {p: s.metric("pd_recoveries_total", path=p) for p in ("local", "recompute", "prefill")}
    assert paths["local"] + paths["recompute"] > 0, paths
    assert s.metric("pd_host_kv_slots_total") == 0
    assert_released(s)


def test_hybrid_cancel_while_paused_frees_slots_and_state(serve, hybrid_folder):  # noqa: F811
    import time

    s = serve(hybrid_folder, **TIGHT)  # the host tier on, as by default
    answers = [generate(s, p, **params(i, 2000)) for i, p in enumerate(prompts())]
    t0 = time.monotonic()
    while not s.decode.sched.by_state(ReqState.PAUSED) and time.monotonic() - t0 < 120:
        time.sleep(0.01)
    assert s.decode.sched.by_state(ReqState.PAUSED)
    for a in answers:
        a.cancel()
    for a in answers:
        a.wait()
    assert_released(s)
    assert s.metric("pd_host_kv_slots_total") > 0  # on by default for a hybrid model too
    assert s.wait_metric("pd_host_state_pages_used", lambda v: v == 0) == 0
    ok = generate(s, [5, 6, 7], max_tokens=4, temperature=0).wait()
    assert ok.error is None and len(ok.ids) == 4


def test_hybrid_prefill_recovery_carries_the_state(serve, hybrid_folder, expected):  # noqa: F811
    """Decode keeps no paused KV or state: every recovery recomputes through prefill and writes K/V and state back
    under a new epoch; the answers are still exact."""
    s = serve(hybrid_folder, **TIGHT, rotation_quantum=0, fault_injection="stale,drop_paused_kv")
    assert_exact(run_streams(s), expected)
    assert s.metric("pd_recoveries_total", path="local") == 0
    assert s.metric("pd_recoveries_total", path="prefill") >= 2
    assert s.metric("pd_stale_messages_total") >= s.metric("pd_recoveries_total", path="prefill")
    assert_released(s)


def test_hybrid_host_recoveries_carry_the_state(serve, hybrid_folder, expected):  # noqa: F811
    """With a host tier, paused requests' K/V goes to host memory and comes back from it, and their state waits on
    the device; the answers equal the offline engine's, and host slots and host state pages are all free once the
    streams end."""
    s = serve(hybrid_folder, **TIGHT, host_kv_tokens=2048)
    assert_exact(run_streams(s), expected)
    assert s.metric("pd_recoveries_total", path="host") > 0
    parked = s.metric("pd_state_pages_parked_total", event="parked")
    assert parked == s.metric("pd_pauses_total") > 0
    assert s.metric("pd_host_state_pages_total") > 0
    assert s.wait_metric("pd_host_state_pages_used", lambda v: v == 0) == 0
    assert s.wait_metric("pd_host_kv_slots_used", lambda v: v == 0) == 0
    assert_released(s)


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
def test_qwen3_5_moe_checkpoint_through_host_recoveries_equals_offline(serve, qwen3_5_moe_saved):  # noqa: F811
    """A Qwen3.5 MoE checkpoint in transformers' multimodal layout (tests/hybrid/test_qwen3_5.py: equal to
    transformers offline), through the roles: streams paused and recovered from host memory, greedy and seeded,
    equal the offline engine's token for token, and every slot and page is free afterwards."""
    folder, _ = qwen3_5_moe_saved
    outs = make_engine(folder).generate(prompts(), [SamplingParams(**params(i)) for i in range(4)])
    s = serve(folder, **TIGHT, host_kv_tokens=2048)
    assert_exact(run_streams(s), [o.output_ids for o in outs])
    assert s.metric("pd_pauses_total") > 0 and s.metric("pd_recoveries_total", path="host") > 0
    assert s.wait_metric("pd_host_kv_slots_used", lambda v: v == 0) == 0
    assert_released(s)
