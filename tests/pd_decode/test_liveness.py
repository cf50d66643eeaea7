"""Liveness of decode's scheduler: never idle with work waiting (issue: decode deadlocked with its whole pool in the
radix cache, a paused request that could never fit and queued requests behind it)."""

from __future__ import annotations

import random

import pytest

from backends.common.core.kv_pool import KVPool
from backends.common.core.request import InferReq, ParamError, ReqState, SamplingParams
from backends.pd_decode.scheduler import DecodeScheduler


def req(rid, ids, max_tokens=1000):
    return InferReq(rid, list(ids), SamplingParams(max_tokens=max_tokens))


def run_and_finish(s, r, token=7):
    """Admit r, answer its prompt transfer, end it so that its KV goes to the radix cache."""
    s.add(r)
    for job in s.schedule().transfers:
        s.on_transfer_done(job.rid, job.epoch, True, first_token=token)
    s.finish(r, "stop")


def deadlocked_state():
    """The state seen on the H200 replay, in small: the whole pool held by the radix cache (shared prompt blocks and
    a paused request's history), one paused request longer than the pool, and queued requests whose prompts hit
    the cached blocks."""
    s = DecodeScheduler(KVPool(64))
    block = list(range(1000, 1024))  # a 24-token prompt block that later turns share
    run_and_finish(s, req("turn1", block))  # its 24 prompt positions cached
    paused = req("long", range(5000, 5010))
    s.add(paused)
    # it ran until it held the pool alone: 40 positions cached with paused priority, 70 tokens of history
    paused.output_ids = list(range(6000, 6060))
    slots = s.pool.alloc(40)
    s.radix.insert(paused.all_ids[:40], slots, priority=1)
    paused.state = ReqState.PAUSED
    queued = [req(f"turn2-{i}", block + [2000 + i] * 4) for i in range(3)]
    for q in queued:
        s.add(q)
    assert s.pool.num_free == 0 and s.radix.cached_size == 64
    return s, paused, queued


def test_paused_request_longer_than_the_pool_ends_and_queue_moves():
    s, paused, queued = deadlocked_state()
    assert any("more than max_len" in v for v in s.check_invariants())
    plan = s.schedule()
    assert plan.ended == [paused] and paused.finish_reason == "length"
    # the queued requests are admitted: their prompt blocks come from the cache, only the tails are sent
    assert {j.rid for j in plan.transfers} == {q.rid for q in queued}
    assert all(j.start == 24 for j in plan.transfers)
    assert not s.stalled() and s.check_invariants() == []


def test_prompt_that_can_never_fit_is_refused_and_names_the_field():
    s = DecodeScheduler(KVPool(64))
    with pytest.raises(ParamError) as e:
        s.add(req("huge", range(64)))
    assert e.value.field == "input_ids" and "at most 64" in str(e.value)
    s.add(req("fits", range(63)))  # prompt + 1 output token = the pool
    plan = s.schedule()
    assert [j.rid for j in plan.transfers] == ["fits"]


def test_max_len_also_follows_the_model_context():
    s = DecodeScheduler(KVPool(64), max_len=32)
    with pytest.raises(ParamError):
        s.add(req("a", range(32)))
    s.add(req("b", range(31)))


def test_request_alone_at_pool_capacity_ends_with_length_instead_of_pausing_itself():
    s = DecodeScheduler(KVPool(48))
    r = req("a", range(40))
    s.add(r)
    for job in s.schedule().transfers:
        s.on_transfer_done(job.rid, job.epoch, True, first_token=1)
    ended = []
    for _ in range(20):
        plan = s.schedule()
        assert plan.paused == []  # alone, a pause could never be recovered from
        ended += plan.ended
        for x in plan.decode:
            s.after_decode(x, 2)
        assert s.check_invariants() == []
        if ended:
            break
    assert ended == [r] and r.finish_reason == "length" and r.num_tokens == 48
    assert s.idle() and s.pool.num_free + s.radix.cached_size == 48


def test_liveness_guard_fails_the_head_with_a_reason_when_nothing_else_can():
    """If a request could still not fit with everything evictable (max_len broken by a bug), the guard ends it with
    an error naming why, and the next request is served."""
    s = DecodeScheduler(KVPool(32))
    s.max_len = 10**9  # simulate the bug the guard exists for
    big, small = req("big", range(40)), req("small", range(100, 105))
    s.add(big)
    s.add(small)
    plan = s.schedule()
    assert plan.failed == [big] and "can never fit" in big.error and "32" in big.error
    assert big.finish_reason == "error" and big.rid not in s.reqs and s.num_unfittable == 1
    plan = s.schedule()
    assert [j.rid for j in plan.transfers] == ["small"]


def test_check_invariants_reports_a_stall_and_a_leaked_lock():
    s = DecodeScheduler(KVPool(32))
    s.add(req("a", range(5)))
    assert any(v.startswith("liveness") for v in s.check_invariants())  # before schedule: waiting, nothing runs
    s.schedule()
    assert s.check_invariants() == []
    run_and_finish(s, req("b", range(100, 110)))
    _, node = s.radix.match_prefix(list(range(100, 110)))
    s.radix.lock(node)  # nobody holds it: a leak
    for job in list(s.inflight.values()):
        s.on_transfer_done(job.rid, job.epoch, True, first_token=1)
    s.finish(s.reqs["a"], "stop")
    assert any(v.startswith("radix") for v in s.check_invariants())


def conversation_workload(rng: random.Random, n: int, pool: int):
    """Multi-turn conversations: each turn's prompt is the previous turn's prompt + answer + a new message, so
    prompts share long prefixes; some conversations outgrow the pool."""
    convs: list[list[int]] = []
    out = []
    for _ in range(n):
        if convs and rng.random() < 0.6:
            c = rng.randrange(len(convs))
            convs[c] = convs[c] + [rng.randrange(50_000) for _ in range(rng.randrange(8, 60))]
        else:
            convs.append([rng.randrange(50_000) for _ in range(rng.randrange(20, 200))])
            c = len(convs) - 1
        out.append((convs[c][:], rng.randrange(4, 60)))
        convs[c] += [rng.randrange(50_000) for _ in range(out[-1][1])]  # the answer joins the conversation
    return out


@pytest.mark.quiet_probe(every=25)  # long replays on a large tree: a sample of their plans is probed
@pytest.mark.parametrize("seed", range(6))
def test_conversation_replay_never_stalls(seed):
    """Requests arrive over time with heavy prefix sharing, transfers answer after a delay, and every request ends:
    finished, or refused at once because its prompt can never fit. After every schedule() nothing is stalled."""
    rng = random.Random(seed)
    pool = 512
    s = DecodeScheduler(KVPool(pool), max_running=16)
    work = conversation_workload(rng, 120, pool)
    pending: list[tuple[int, object]] = []
    ended: dict[str, str] = {}
    refused = 0
    t = 0
    while (work or s.reqs or pending) and t < 20_000:
        if work and rng.random() < 0.3:
            ids, n_out = work.pop(0)
            r = req(f"q{t}", ids, max_tokens=n_out)
            try:
                s.add(r)
            except ParamError:
                refused += 1
                assert len(ids) >= pool
        if s.reqs and rng.random() < 0.01:
            s.cancel(rng.choice(list(s.reqs)))
        plan = s.schedule()
        assert not s.stalled(), s.check_invariants()
        pending += [(t + rng.randrange(1, 6), job) for job in plan.transfers]
        for r in plan.ended + plan.failed:
            ended[r.rid] = r.finish_reason
        for _, job in [p for p in pending if p[0] <= t]:
            c = s.on_transfer_done(job.rid, job.epoch, True, first_token=1)
            if c.first_token is not None and len(c.req.output_ids) >= c.req.params.max_tokens:
                s.finish(c.req, "length")
        pending = [p for p in pending if p[0] > t]
        for r in plan.decode:
            s.after_decode(r, 2)
            if len(r.output_ids) >= r.params.max_tokens:
                s.finish(r, "length")
        assert s.check_invariants(liveness=False) == []
        t += 1
    assert not work and not s.reqs and not pending, f"stuck after {t} steps: {s.reqs}"
    assert all(reason == "length" for reason in ended.values())
    assert s.num_unfittable == 0
    free, used, cached = s.accounting()
    assert used == 0 and free + cached == pool
