"""Decode's scheduler with state pages, without a model: pause keeps the state as the checkpoint at the paused
request's end, a local recovery copies it back, a prefill recovery gets its state from the transfer (and no copy
may overwrite it afterwards), and cancelling in any state gives every page back."""

from __future__ import annotations

import random

import pytest

from backends.common.core.kv_pool import KVPool
from backends.common.core.request import InferReq, ReqState, SamplingParams
from backends.common.core.state_pages import ZERO, StatePages
from backends.pd_decode.scheduler import DecodeScheduler, Plan


def mk(s, rid, n, base=0):
    req = InferReq(rid, [base + i for i in range(n)], SamplingParams(max_tokens=1000))
    s.add(req)
    return req


def sched(slots=64, pages=8, **kw):
    return DecodeScheduler(KVPool(slots), state=StatePages(pages), **kw)


def check(s):
    assert s.check_invariants(liveness=False) == []


def run_to_running(s):
    plan = s.schedule()
    for job in plan.transfers:
        assert job.state_page == s.reqs[job.rid].state_page != ZERO
        s.on_transfer_done(job.rid, job.epoch, True, first_token=7)
    s.state.take_ops()
    return plan


def step(s):
    plan = s.schedule()
    for r in plan.decode:
        s.after_decode(r, 5)
    check(s)
    return plan


def test_prompt_transfer_writes_the_state_and_no_copy_runs_into_its_page():
    s = sched()
    a = mk(s, "a", 10)
    plan = s.schedule()
    (job,) = plan.transfers
    assert job.state_page == a.state_page and job.state_page != ZERO
    assert s.state.take_ops() == []  # the queued zeroing of the page was dropped: prefill writes the whole page
    check(s)


def test_pause_then_local_recovery_copies_the_checkpoint_back():
    """A paused request whose cached K/V survives whole (a rotation pause: nothing trims it in the same plan)."""
    s = sched(slots=40)
    a, b = mk(s, "a", 8), mk(s, "b", 8, base=100)
    run_to_running(s)
    for _ in range(3):
        step(s)
    victim, other = b, a
    s._pause(victim, Plan())
    assert victim.state_page == ZERO and len(s.radix.checkpoints) == 1
    (ckpt,) = s.radix.checkpoints
    assert len(s.radix.match_prefix(victim.all_ids[: victim.num_tokens - 1])[0]) == victim.num_tokens - 1
    s.cancel(other.rid)  # room again: the victim resumes from its own checkpoint
    s.state.take_ops()
    plan = s.schedule()
    assert victim in plan.resumed_local and victim.state is ReqState.RUNNING
    assert s.state.take_ops() == [(victim.state_page, ckpt.state)]
    check(s)


def test_a_pause_that_trims_the_paused_tail_loses_its_checkpoint():
    """Out of slots, the victim's own K/V gives the slot: its tail is trimmed, so its end-of-history state no longer
    matches any cached position and recovery goes to prefill (a dense model would recompute the trimmed tail)."""
    s = sched(slots=24)
    a, b = mk(s, "a", 8), mk(s, "b", 8, base=100)
    run_to_running(s)
    while not any(r.state is ReqState.PAUSED for r in (a, b)):
        step(s)
    victim = a if a.state is ReqState.PAUSED else b
    assert victim.state_page == ZERO and not s.radix.checkpoints and s.state_accounting() == (7, 1, 0)
    check(s)


def test_prefill_recovery_after_the_checkpoint_is_gone_carries_the_state():
    s = sched(slots=24, recompute_max=0)
    a, b = mk(s, "a", 8), mk(s, "b", 8, base=100)
    run_to_running(s)
    while not any(r.state is ReqState.PAUSED for r in (a, b)):
        step(s)
    victim = a if a.state is ReqState.PAUSED else b
    other = b if victim is a else a
    s.radix.evict_state(10)  # the paused request's state checkpoint is dropped; its K/V stays cached
    s.cancel(other.rid)
    plan = s.schedule()
    (job,) = plan.transfers
    assert victim.state is ReqState.RECOVERING and job.epoch == 1
    assert job.start == 0 and job.state_page == victim.state_page  # K/V without its state is not reused
    assert s.state.take_ops() == []
    check(s)
    c = s.on_transfer_done(victim.rid, 1, True)
    assert c.recovered and victim.state is ReqState.RUNNING


def test_running_requests_checkpoint_and_a_trimmed_tail_is_recomputed_by_decode():
    """Every 8 computed tokens (here) a running request's state is checkpointed; a pause that trims its tail
    then recovers from the last checkpoint with decode recomputing the few positions after it."""
    s = sched(slots=40, pages=12, checkpoint_every=8)
    a, b = mk(s, "a", 8), mk(s, "b", 8, base=100)
    run_to_running(s)
    for _ in range(10):
        step(s)
    assert s.num_checkpoints >= 2 and len(s.radix.checkpoints) >= 2
    while not any(r.state is ReqState.PAUSED for r in (a, b)):
        step(s)
    victim = a if a.state is ReqState.PAUSED else b
    other = b if victim is a else a
    s.cancel(other.rid)
    s.state.take_ops()
    plan = s.schedule()
    (job,) = plan.recomputes
    assert not plan.transfers and victim.state is ReqState.RECOVERING and job.source == "recompute"
    assert 0 < job.num_positions <= 8 and job.start == victim.cached_len and job.start % 8 == 0
    ckpt = victim.last_node.state
    assert s.state.take_ops() == [(victim.state_page, ckpt)]  # decode restores the checkpoint, then computes on
    c = s.on_transfer_done(victim.rid, job.epoch, True)
    assert c.recovered and c.path == "recompute" and s.num_recoveries["recompute"] == 1
    check(s)


@pytest.mark.parametrize("seed", range(3))
def test_random_cancels_pauses_and_transfers_give_every_page_back(seed):
    rng = random.Random(seed)
    s = sched(slots=96, pages=10, max_running=4)
    reqs = [mk(s, f"r{i}", rng.randrange(3, 20), base=1000 * i) for i in range(10)]
    pending = []
    for _ in range(300):
        plan = s.schedule()
        pending += plan.transfers + plan.recomputes
        s.state.take_ops()
        for r in plan.decode:
            s.after_decode(r, rng.randrange(50))
        if pending and rng.random() < 0.6:
            job = pending.pop(rng.randrange(len(pending)))
            s.on_transfer_done(job.rid, job.epoch, rng.random() < 0.95, first_token=3)
        if rng.random() < 0.05:
            live = [r for r in reqs if r.rid in s.reqs]
            if live:
                s.cancel(rng.choice(live).rid)
        check(s)
    for r in list(s.reqs.values()):
        s.cancel(r.rid)
    for job in pending:
        s.on_transfer_done(job.rid, job.epoch, True, first_token=3)
    free, live, ckpts = s.state_accounting()
    assert live == 0 and free + ckpts == 10
    s.radix.clear()
    assert s.state_accounting() == (10, 0, 0) and s.pool.num_free == 96


def test_a_hybrid_host_tier_needs_host_state_pages():
    with pytest.raises(ValueError, match="host_pages"):
        DecodeScheduler(KVPool(16), host_pool=KVPool(16), state=StatePages(4))
    s = DecodeScheduler(KVPool(16), host_pool=KVPool(16), host_pages=KVPool(2), state=StatePages(4))
    assert s.host_pages.num_slots == 2 and s.check_invariants(liveness=False) == []
