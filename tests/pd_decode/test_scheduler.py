"""Decode's scheduler without a model or Triton: every transition and invariant of the pause/recover design."""

from __future__ import annotations

import math
import random

import pytest

from backends.common.core.kv_pool import KVPool
from backends.common.core.request import InferReq, ReqState, SamplingParams
from backends.pd_decode.scheduler import DecodeScheduler


def mk(sched, rid, n_prompt, base=0, **kw):
    req = InferReq(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=1000, **kw))
    sched.add(req)
    return req


def check(sched: DecodeScheduler):
    """Accounting sums to the pool, WAITING/PAUSED hold no KV, RUNNING holds L-1 or L slots, no slot held twice or
    while free (the scheduler's own run-time check; liveness is checked where a test has just scheduled)."""
    assert sched.check_invariants(liveness=False) == []


def admit_and_run(sched, reqs, token=7):
    """Schedule, answer every prompt transfer, return the plan."""
    plan = sched.schedule()
    for job in plan.transfers:
        sched.on_transfer_done(job.rid, job.epoch, True, first_token=token)
    return plan


def step(sched, token=5):
    """One decode iteration: schedule, then 'compute' every planned decode."""
    plan = sched.schedule()
    for req in plan.decode:
        sched.after_decode(req, token)
    check(sched)
    return plan


def test_admission_transfers_exact_positions_then_runs():
    s = DecodeScheduler(KVPool(64))
    r = mk(s, "a", 10)
    plan = s.schedule()
    assert r.state is ReqState.WAITING_KV and len(plan.transfers) == 1
    job = plan.transfers[0]
    assert (job.start, len(job.ids), job.epoch, job.sample) == (0, 10, 0, True)
    assert job.dst_slots == r.slots and len(r.slots) == 10
    c = s.on_transfer_done("a", 0, True, first_token=42)
    assert c.first_token == 42 and r.state is ReqState.RUNNING and r.output_ids == [42]
    plan = step(s)
    assert plan.decode == [r] and len(r.slots) == 11 and r.output_ids == [42, 5]


def test_prefix_hit_on_admission_sends_only_missing_positions():
    s = DecodeScheduler(KVPool(64))
    a = mk(s, "a", 10)
    admit_and_run(s, [a])
    s.finish(a, "stop")  # its KV goes into the radix cache
    b = mk(s, "b", 14)  # shares the first 10 prompt tokens
    job = s.schedule().transfers[0]
    assert job.start == 10 and job.dst_slots == b.slots[10:14]
    check(s)


def test_full_prompt_hit_still_computes_last_token():
    s = DecodeScheduler(KVPool(64))
    a = mk(s, "a", 10)
    admit_and_run(s, [a])
    s.finish(a, "stop")
    mk(s, "b", 10)
    job = s.schedule().transfers[0]
    assert job.start == 9 and len(job.dst_slots) == 1  # prefill must produce the first token's logits


def fill(n_slots=40, n_reqs=3, prompt=8, **kw):
    s = DecodeScheduler(KVPool(n_slots), **kw)
    reqs = [mk(s, f"r{i}", prompt, base=100 * i) for i in range(n_reqs)]
    admit_and_run(s, reqs)
    check(s)
    return s, reqs


def test_pause_latest_admitted_first_and_kv_goes_to_cache():
    s, reqs = fill()
    paused = []
    for _ in range(30):
        plan = step(s)
        paused += plan.paused
        if paused:
            break
    victim = paused[0]
    assert victim is reqs[-1] and victim.state is ReqState.PAUSED and victim.num_pauses == 1
    assert victim.slots == [] and s.num_pauses == 1
    # its KV stayed findable in the radix cache, unreferenced; only the tail slots that the running requests'
    # next tokens needed were taken from it
    slots, _ = s.radix.match_prefix(victim.all_ids[: victim.num_tokens - 1])
    assert victim.num_tokens - 1 - len(reqs) <= len(slots) < victim.num_tokens - 1
    assert s.radix.evictable_size >= len(slots)


@pytest.mark.parametrize("policy,expected", [("oldest", 0), ("longest", 1)])
def test_pause_policy_configurable(policy, expected):
    s = DecodeScheduler(KVPool(40), pause_policy=policy)
    reqs = [mk(s, "r0", 8), mk(s, "r1", 10, base=100), mk(s, "r2", 8, base=200)]
    admit_and_run(s, reqs)
    for _ in range(30):
        plan = step(s)
        if plan.paused:
            assert plan.paused[0] is reqs[expected]
            return
    pytest.fail("no pause")


def test_local_hit_resumes_at_once_without_prefill():
    s, reqs = fill(n_slots=64)
    step(s)
    victim = reqs[1]
    s._pause(victim, s.schedule())  # a short squeeze: nothing else needed its cached KV
    assert victim.state is ReqState.PAUSED
    need = victim.num_tokens - 1  # positions before the next decode input
    plan = step(s)
    assert victim in plan.resumed_local and victim.state is ReqState.RUNNING
    assert plan.transfers == [] and s.num_recoveries["local"] == 1 and victim.epoch == 0
    assert s.recovered_tokens == {"cached": need, "host": 0, "prefill": 0, "recompute": 0}
    assert victim in plan.decode  # resumes decoding in the same iteration
    assert reqs[0].state is ReqState.RUNNING


def test_prefill_recovery_new_epoch_only_missing_positions():
    s, reqs = fill()
    while not (plan := step(s)).paused:
        pass
    victim = plan.paused[0]
    kept = 5
    # evict most of the victim's cached KV: keep its first `kept` positions cached under another holder
    s.radix.evict(s.radix.evictable_size)
    s.finish(reqs[0], "stop")
    s.radix.evict(s.radix.evictable_size)
    assert s.radix.match_prefix(victim.all_ids)[0] == []
    # re-cache a prefix of the victim's history, as if another request shared it
    pre = s.pool.alloc(kept)
    s.radix.insert(victim.all_ids[:kept], pre)
    plan = step(s)
    job = next(j for j in plan.transfers if j.rid == victim.rid)
    assert victim.state is ReqState.RECOVERING and victim.epoch == 1 and job.epoch == 1 and not job.sample
    assert job.start == kept and len(job.ids) == victim.num_tokens - 1  # [m, L-1): not the last token
    assert job.dst_slots == victim.slots[kept:]
    # the cached prefix counted as a local hit, the rest as prefill's
    assert s.recovered_tokens == {"cached": kept, "host": 0, "prefill": victim.num_tokens - 1 - kept, "recompute": 0}
    c = s.on_transfer_done(victim.rid, 1, True)
    assert c.recovered and victim.state is ReqState.RUNNING and s.num_recoveries["prefill"] == 1
    out_before = list(victim.output_ids)
    plan = step(s)
    assert victim in plan.decode and victim.output_ids == out_before + [5]


def test_stale_epoch_changes_nothing_and_is_counted():
    s, reqs = fill()
    while not (plan := step(s)).paused:
        pass
    victim = plan.paused[0]
    s.finish(reqs[0], "stop")
    s.radix.evict(s.radix.evictable_size)
    plan = step(s)
    assert victim.state is ReqState.RECOVERING and victim.epoch == 1
    state = (victim.state, list(victim.slots), list(victim.output_ids))
    for bad_epoch in (0, 2, 7):
        c = s.on_transfer_done(victim.rid, bad_epoch, True, first_token=99)
        assert c.stale and (victim.state, victim.slots, victim.output_ids) == state
    assert s.num_stale == 3
    s.on_transfer_done("nobody", 0, True, first_token=1)
    assert s.num_stale == 4
    assert s.on_transfer_done(victim.rid, 1, True).recovered
    check(s)


def test_no_head_of_line_blocking_and_paused_before_new():
    s = DecodeScheduler(KVPool(60))
    big = mk(s, "big", 30)
    small = mk(s, "small", 6, base=500)
    admit_and_run(s, [big, small])
    # pause both by hand, then drop their cached KV
    plan = s.schedule()
    for r in (big, small):
        s._pause(r, plan)
    s.radix.evict(s.radix.evictable_size)
    hog = s.pool.alloc(40)  # leave 20 free: big (30) cannot recover, small (6) can
    newcomer = mk(s, "new", 4, base=900)
    plan = s.schedule()
    assert big.state is ReqState.PAUSED and small.state is ReqState.RECOVERING
    assert newcomer.state is ReqState.WAITING  # paused requests go first
    s.pool.free(hog)
    check(s)


def test_cancel_during_transfer_defers_slot_release():
    s = DecodeScheduler(KVPool(32))
    r = mk(s, "a", 10)
    job = s.schedule().transfers[0]
    free_before = s.pool.num_free
    s.cancel("a")
    assert r.state is ReqState.FINISHED and s.pool.num_free == free_before  # prefill may still write them
    assert all(not s.pool.is_free(x) for x in job.dst_slots)
    check(s)
    s.on_transfer_done("a", 0, True, first_token=3)
    assert s.pool.num_free == 32 and s.idle()


def test_pause_before_first_token():
    s = DecodeScheduler(KVPool(21))
    a, b = mk(s, "a", 10), mk(s, "b", 10, base=100)
    plan = s.schedule()  # admits a only: b would leave no room for a's next token
    assert [j.rid for j in plan.transfers] == ["a"]
    s.on_transfer_done("a", 0, True, first_token=1)
    hog = s.pool.alloc(s.pool.num_free)  # decode fills up between admission and the first step
    plan = s.schedule()
    assert plan.paused == [a] and a.output_ids == [1]
    s.pool.free(hog)
    plan = step(s)
    assert a.state is ReqState.RUNNING and s.num_recoveries["local"] == 1
    assert b.state in (ReqState.WAITING, ReqState.WAITING_KV)
    check(s)


def test_failed_transfer_fails_request_and_frees_slots():
    s = DecodeScheduler(KVPool(32))
    r = mk(s, "a", 10)
    s.schedule()
    c = s.on_transfer_done("a", 0, False, error="prefill instance died")
    assert c.failed == "prefill instance died" and r.state is ReqState.FINISHED and r.finish_reason == "error"
    assert s.pool.num_free == 32 and s.idle()


def test_restart_mode_ends_victim_segment():
    s, reqs = fill(on_oom="restart")
    while not (plan := step(s)).restarted:
        pass
    victim = plan.restarted[0]
    assert victim.finish_reason == "restart" and victim.rid not in s.reqs and s.num_pauses == 0
    check(s)


def test_cancel_of_every_state_returns_all_slots():
    s, reqs = fill()
    while not step(s).paused:
        pass
    mk(s, "late", 5, base=999)
    s.schedule()
    for rid in list(s.reqs):
        s.cancel(rid)
    for rid, epoch in list(s.inflight):
        s.on_transfer_done(rid, epoch, True, first_token=0)
    s.radix.clear()
    assert s.idle() and s.pool.num_free == s.pool.num_slots


@pytest.mark.parametrize("seed", range(12))
def test_random_simulation_keeps_invariants(seed):
    """Random arrivals, cancels, delayed transfer answers and decode steps on a tiny pool."""
    rng = random.Random(seed)
    s = DecodeScheduler(KVPool(96), max_running=6)
    pending = []  # transfers not yet answered
    outputs: dict[str, list[int]] = {}
    n = 0
    for _ in range(400):
        if rng.random() < 0.15 and len(s.reqs) < 10:
            r = mk(s, f"q{n}", rng.randrange(2, 20), base=rng.choice([0, 1000 * n]))
            n += 1
        if rng.random() < 0.05 and s.reqs:
            s.cancel(rng.choice(list(s.reqs)))
        plan = s.schedule()
        pending += plan.transfers
        rng.shuffle(pending)
        while pending and rng.random() < 0.6:
            job = pending.pop()
            s.on_transfer_done(job.rid, job.epoch, rng.random() > 0.05, first_token=rng.randrange(50))
        for r in plan.decode:
            before = list(r.output_ids)
            s.after_decode(r, rng.randrange(50))
            assert r.output_ids[:-1] == before  # never goes backwards, never skips
            if len(r.output_ids) > 12 and rng.random() < 0.3:
                s.finish(r, "length")
        for r in s.reqs.values():
            prev = outputs.get(r.rid, [])
            assert r.output_ids[: len(prev)] == prev
            outputs[r.rid] = list(r.output_ids)
        check(s)
    for job in pending:
        s.on_transfer_done(job.rid, job.epoch, True, first_token=0)
    for rid in list(s.reqs):
        s.cancel(rid)
    for rid, epoch in list(s.inflight):
        s.on_transfer_done(rid, epoch, True, first_token=0)
    s.radix.clear()
    assert s.pool.num_free == s.pool.num_slots and not s.orphans


def test_paused_kv_outlives_finished_kv_in_cache():
    """A finished request's cached KV is evicted before a paused request's, so a short squeeze hits locally."""
    s = DecodeScheduler(KVPool(48))
    a, b = mk(s, "a", 10), mk(s, "b", 10, base=100)
    admit_and_run(s, [a, b])
    step(s)
    s._pause(b, s.schedule())
    s.finish(a, "stop")  # newer than b's entries, but lower priority
    hog = s.pool.alloc(s.pool.num_free)
    s.radix.evict(a.num_tokens - 1)
    assert len(s.radix.match_prefix(b.all_ids[: b.num_tokens - 1])[0]) == b.num_tokens - 1
    s.pool.free(hog)
    plan = step(s)
    assert b in plan.resumed_local


def test_quiet_until_an_input_or_a_due_turn_and_decode_only_plans_nothing_else():
    """`quiet` (decode's overlapped steps plan over an unread step only then): after a full plan, the pausing one
    included (it took every action then due), while a paused request cannot fit; not after other inputs (arrival,
    finish, cancel), nor once a rotation turn falls due. An answer that makes its request run keeps it: the next
    decode-only plan takes that request up, and with paused requests the quiet spell ends when it has run a quantum
    (it may then give its place to one). schedule(decode_only=True) reserves the decode slots and does nothing for
    the others. (tests/pd_decode/conftest.py checks each quiet full plan's successor.)"""
    now = [0.0]
    s = DecodeScheduler(KVPool(24), quantum=0.1, turn_wait=0.3, clock=lambda: now[0])
    a, b = mk(s, "a", 8), mk(s, "b", 8, base=100)
    admit_and_run(s, [a, b])
    assert s.quiet()  # the prompts' answers made a and b run: nothing else is due
    plan = s.schedule(decode_only=True)
    assert plan.decode == [a, b]
    for r in plan.decode:
        s.after_decode(r, 5)
    while b.state is not ReqState.PAUSED:
        step(s)
    assert a.state is ReqState.RUNNING and s.quiet()  # that plan paused b, and nothing else is due
    step(s)  # decode only: b cannot fit beside a
    assert s.quiet()
    plan = s.schedule(decode_only=True)
    assert plan.decode == [a] and not (plan.paused or plan.transfers or plan.swap_ins or plan.resumed_local)
    assert b.state is ReqState.PAUSED and s.quiet()
    s.after_decode(a, 5)
    c = mk(s, "c", 4, base=200)
    assert not s.quiet()  # an arrival: the next full plan decides about it
    step(s)
    assert c.state is ReqState.WAITING and s.quiet()  # paused requests go first: c waits, nothing else to plan
    now[0] = b.paused_at + 0.3  # b's turn is due (a has run a quantum since it last resumed)
    assert not s.quiet()
    plan = step(s)
    assert b.state is ReqState.RECOVERING and a.state is ReqState.PAUSED and s.num_rotations == 1
    assert s.quiet()  # b's recovery is in flight, a's turn is not due yet
    now[0] += 0.01
    (job,) = plan.transfers
    s.on_transfer_done(job.rid, job.epoch, True)
    assert b.state is ReqState.RUNNING and s.quiet()  # its answer keeps the scheduler quiet until a's turn
    assert s._quiet_until == a.paused_at + s.turn_wait
    assert s.schedule(decode_only=True).decode == [b]
    s.cancel("c")
    assert not s.quiet()


def test_an_answer_that_makes_a_request_run_brings_a_declined_turn_forward():
    """A turn the last plan declined for want of requests that had run a quantum waits for one to have (or for an
    input): a request that an answer makes run is one more, so the quiet spell ends by its quantum at the latest;
    and one whose next token would not fit max_len ends it at once (a full plan ends that request)."""
    now = [0.0]
    s = DecodeScheduler(KVPool(64), quantum=0.1, turn_wait=0.3, clock=lambda: now[0])
    mk(s, "a", 8)
    b = mk(s, "b", 8, base=100)
    plan = s.schedule()
    assert {j.rid for j in plan.transfers} == {"a", "b"} and s.quiet()
    s._turn_retry = ("p", 0.0, math.inf)  # as `_rotate` leaves it when no running request frees enough
    s._quiet_until = math.inf
    now[0] = 0.05
    ja, jb = plan.transfers
    s.on_transfer_done(ja.rid, ja.epoch, True, first_token=7)
    assert s.quiet() and s._quiet_until == 0.05 + s.quantum
    s.max_len = b.num_tokens + 2  # b's first token takes it within a token of max_len
    s.on_transfer_done(jb.rid, jb.epoch, True, first_token=7)
    assert not s.quiet()
