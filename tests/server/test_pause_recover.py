"""Pause and recovery end to end on a real server: a 384-token decode pool and SmolLM2 answers that need far more
than that, streamed over gRPC. Recovery by prefill under new epochs, the restart baseline and deadlines run
in-process (tests/inprocess/test_roles.py), as do the hybrid model's cases (test_hybrid_roles.py)."""

from __future__ import annotations

import pytest

from backends.common.core.request import SamplingParams
from tests.server.client import StreamClient, grpc_generate, grpc_generate_all
from tests.server.conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

TOPICS = ["the history of astronomy", "how bridges are built", "the life cycle of stars", "ocean currents"]
POOL = 384
N_OUT = 80  # with prompts of ~160 tokens, four answers need more than twice the pool


@pytest.fixture(scope="module")
def tight():
    s = Server("--kv-tokens", str(POOL), "--fault-injection", "stale", name="tight")
    yield s
    s.stop()


def prompt_ids(engine, i: int) -> list[int]:
    text = (
        f"Write a long, detailed essay about {TOPICS[i]}. Cover its origins, the key people involved, the "
        "important discoveries, the controversies, and what remains unknown today. "
    ) * 6
    return engine.tokenizer.encode(text)[: 150 + 5 * i]


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


def test_four_streams_on_384_slots_pause_and_recover_exactly(tight, expected):
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
    tight.assert_released(timeout=2.0)
    assert tight.metric("pd_kv_slots_total") == POOL
    assert tight.wait_metric("pd_host_kv_slots_used", lambda v: v == 0) == 0  # every host copy freed


def test_closing_streams_while_paused_frees_everything(tight, engine):
    clients = [StreamClient(tight.grpc_url, ids=prompt_ids(engine, i), params=params(i)) for i in range(4)]
    tight.wait_paused()
    for c in clients:
        c.cancel()
    tight.assert_released(timeout=2.0)
    assert tight.metric("pd_kv_slots_total") == POOL
    assert tight.metric("pd_host_kv_slots_used") == 0  # copies of cancelled requests freed too
    res = grpc_generate(tight.grpc_url, text="Hello", params={"max_tokens": 4, "temperature": 0})
    assert res.error is None and len(res.ids) == 4
