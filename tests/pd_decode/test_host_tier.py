"""Decode's host KV tier, recovery by cost and rotation, without a model: a simulated executor applies every plan
(swap-outs, swap-ins, prefill writes, decode steps) to dicts standing for the device pool and host memory, and checks
before each decode step that every position of every running request holds exactly the K/V of its own prefix. With
state pages (a hybrid model) it also applies the queued page copies and decode's recomputes in the decode loop's
order, and checks that each running request's page holds the state after exactly its computed positions."""

from __future__ import annotations

import random

import pytest

from backends.common.core.kv_pool import KVPool
from backends.common.core.request import InferReq, ReqState, SamplingParams
from backends.common.core.scheduler import StateError
from backends.common.core.state_pages import ZERO, StatePages
from backends.pd_decode.scheduler import DecodeScheduler, Plan, RecoveryCosts


def kv_of(ids, i):
    """The K/V of position i depends on the whole prefix ids[: i + 1], as a real model's does."""
    return hash(tuple(ids[: i + 1]))


def state_of(ids, n):
    """The linear-attention state after positions [0, n): a function of that prefix alone (n = 0: the zero state)."""
    return ("state", hash(tuple(ids[:n])))


def next_token(ids):
    return 1000 + (sum(ids[-3:]) * 31 + len(ids)) % 997


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Sim:
    """Runs a DecodeScheduler like decode's loop does; transfers and swap-ins answer one step after they start."""

    def __init__(self, pool, host=None, quantum=0.0, costs=None, max_tokens=40, state_pages=0, host_pages=0, **kw):
        self.clock = Clock()
        self.s = DecodeScheduler(
            KVPool(pool),
            host_pool=KVPool(host) if host else None,
            host_pages=KVPool(host_pages) if host_pages else None,
            state=StatePages(state_pages) if state_pages else None,
            quantum=quantum,
            costs=costs,
            clock=self.clock,
            **kw,
        )
        self.device, self.hostmem = {}, {}
        self.pages, self.host_pages = {}, {}  # state pages: device and host
        self.pending = []  # (job) answered at the next step
        self.max_tokens = max_tokens
        self.token_times: dict[str, list[float]] = {}
        self.done: dict[str, list[int]] = {}
        self.plans = []

    def add(self, rid, n_prompt, base=0):
        req = InferReq(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=self.max_tokens))
        self.s.add(req)
        self.token_times[rid] = []
        return req

    def _answer_pending(self):
        pending, self.pending = self.pending, []
        for job in pending:
            c = self.s.on_transfer_done(job.rid, job.epoch, True, first_token=next_token(job.ids) if job.sample else 0)
            if c.first_token is not None:
                self._token(c.req)

    def _token(self, req):
        self.token_times[req.rid].append(self.clock.t)
        if len(req.output_ids) >= self.max_tokens:
            self.s.finish(req, "length")
            self.done[req.rid] = list(req.output_ids)

    def step(self, dt=0.01):
        self.clock.t += dt
        self._answer_pending()
        plan = self.s.schedule()
        self.plans.append(plan)
        state = self.s.state
        for out in plan.swap_outs:  # first: they read slots and pages that later writes may reuse
            assert len(out.device_slots) == len(out.host_slots)
            for d, h in zip(out.device_slots, out.host_slots):
                self.hostmem[h] = self.device[d]
            if out.host_page != ZERO:
                self.host_pages[out.host_page] = self.pages[out.state_page]
        if state is not None:  # the page copies the plan queued (decode: `apply_state_ops`)
            for dst, src in state.take_ops():
                self.pages[dst] = state_of([], 0) if src == ZERO else self.pages[src]
        for job in plan.recomputes:  # decode computes the tail from the checkpoint the match restored
            req = self.s.reqs[job.rid]
            want = state_of(job.ids, job.start)
            assert self.pages[req.state_page] == want, f"{job.rid}: recompute from a wrong state"
            for k, d in enumerate(job.dst_slots):
                self.device[d] = kv_of(job.ids, job.start + k)
            self.pages[req.state_page] = state_of(job.ids, len(job.ids))
            self.s.on_transfer_done(job.rid, job.epoch, True)
        for job in plan.swap_ins:
            for d, h in zip(job.dst_slots, job.host_slots):
                self.device[d] = self.hostmem[h]
            if job.host_page != ZERO:
                self.pages[job.state_page] = self.host_pages[job.host_page]
            self.pending.append(job)
        for job in plan.transfers:
            for k, d in enumerate(job.dst_slots):
                self.device[d] = kv_of(job.ids, job.start + k)
            if job.state_page != ZERO:  # prefill writes the state at the job's end
                self.pages[job.state_page] = state_of(job.ids, len(job.ids))
            self.pending.append(job)
        for req in plan.decode:
            ids = req.all_ids
            for i in range(req.num_tokens - 1):  # every position the step reads holds its own prefix's K/V
                assert self.device.get(req.slots[i]) == kv_of(ids, i), f"{req.rid} position {i} corrupt"
            self.device[req.slots[req.num_tokens - 1]] = kv_of(ids, req.num_tokens - 1)
            if state is not None:  # ... and its page the state after exactly its computed positions
                assert self.pages.get(req.state_page) == state_of(ids, req.num_tokens - 1), f"{req.rid}: state"
                self.pages[req.state_page] = state_of(ids, req.num_tokens)
            self.s.after_decode(req, next_token(ids))
            self._token(req)
        assert self.s.check_invariants(liveness=False) == []
        return plan

    def run(self, limit=5000):
        for _ in range(limit):
            if self.s.idle():
                return
            self.step()
        pytest.fail(f"not done after {limit} steps: {self.s.counts()}")

    def max_gap(self, rid):
        t = self.token_times[rid]
        return max(b - a for a, b in zip(t, t[1:]))


def reference(prompts, max_tokens=40):
    """The same requests with a pool that never runs out."""
    sim = Sim(pool=10_000, max_tokens=max_tokens)
    for rid, n, base in prompts:
        sim.add(rid, n, base)
    sim.run()
    return sim.done


def test_pause_swaps_out_and_recovery_swaps_in_from_host():
    sim = Sim(pool=60, host=200, max_tokens=40)
    for i in range(3):
        sim.add(f"r{i}", 10, base=100 * i)
    sim.s.keep_paused_kv = True
    sim.run()
    s = sim.s
    assert s.num_pauses >= 1 and s.swapped_tokens["out"] >= 10
    assert s.num_recoveries["host"] >= 1 and s.num_recoveries["prefill"] == 0
    assert any(p.swap_ins for p in sim.plans)
    assert sim.done == reference([(f"r{i}", 10, 100 * i) for i in range(3)])
    assert s.host_accounting() == (200, 0)  # every host copy freed when its request ended
    free, used, cached = s.accounting()
    assert used == 0 and free + cached == 60


def test_host_copy_is_incremental_across_pauses():
    sim = Sim(pool=70, host=300, quantum=0.05, max_tokens=60)
    for i in range(3):
        sim.add(f"r{i}", 8, base=100 * i)
    sim.run()
    s = sim.s
    outs = [o for p in sim.plans for o in p.swap_outs]
    per_req = {}
    for o in outs:  # each swap-out continues where that request's copy ended
        assert o.start == per_req.get(o.rid, 0)
        per_req[o.rid] = o.start + len(o.host_slots)
    assert s.num_rotations >= 2 and len(outs) > len(per_req)
    assert s.swapped_tokens["out"] == sum(per_req.values())


def test_host_full_falls_back_to_prefill_with_a_counted_reason():
    sim = Sim(pool=60, host=5, max_tokens=40)  # no copy fits
    for i in range(3):
        sim.add(f"r{i}", 10, base=100 * i)
    sim.run()
    s = sim.s
    assert s.host_skips["host_full"] >= 1 and s.num_recoveries["host"] == 0
    assert s.num_recoveries["local"] + s.num_recoveries["prefill"] >= 1
    assert sim.done == reference([(f"r{i}", 10, 100 * i) for i in range(3)])
    assert s.host_accounting() == (5, 0)


def test_cost_model_chooses_prefill_when_it_is_cheaper():
    costs = RecoveryCosts(host_per_token=1.0, prefill_fixed=0.0, prefill_per_token=0.001)
    sim = Sim(pool=60, host=200, costs=costs, max_tokens=40)
    sim.s.keep_paused_kv = True
    for i in range(3):
        sim.add(f"r{i}", 10, base=100 * i)
    sim.run()
    s = sim.s
    assert s.num_recoveries["host"] == 0 and s.host_skips["prefill_cheaper"] >= 1
    assert s.num_recoveries["prefill"] + s.num_recoveries["local"] >= 1
    assert sim.done == reference([(f"r{i}", 10, 100 * i) for i in range(3)])


def _swapped_request(sim):
    """Run until some request is paused with a host copy and its device KV has been reused by others."""
    for _ in range(500):
        sim.step()
        for r in sim.s.by_state(ReqState.PAUSED):
            if r.rid in sim.s.host:
                return r
    pytest.fail("nothing was paused with a host copy")


def test_cancel_while_swapped_frees_host_and_device():
    sim = Sim(pool=60, host=200, max_tokens=40)
    for i in range(3):
        sim.add(f"r{i}", 10, base=100 * i)
    victim = _swapped_request(sim)
    assert sim.s.cancel(victim.rid) is victim
    assert victim.rid not in sim.s.host
    sim.run()
    assert sim.s.host_accounting() == (200, 0)
    free, used, cached = sim.s.accounting()
    assert used == 0 and free + cached == 60
    assert set(sim.done) == {"r0", "r1", "r2"} - {victim.rid}


def first_swap_in(sim):
    """Three requests that outgrow the pool, stepped until a plan swaps one in: that swap-in's job."""
    for i in range(3):
        sim.add(f"r{i}", 10, base=100 * i)
    for _ in range(500):
        plan = sim.step()
        if plan.swap_ins:
            return plan.swap_ins[0]
    pytest.fail("no swap-in")


def cancel_during_copy(sim, job, pool: int, host: int) -> None:
    """Cancel job's request while its copy is in flight: its slots stay held (an orphan) until the copy answers,
    then everything is free again."""
    req = sim.s.cancel(job.rid)
    assert req.state is ReqState.FINISHED and (job.rid, job.epoch) in sim.s.orphans
    assert all(not sim.s.pool.is_free(d) for d in job.dst_slots)  # the copy may still be writing them
    sim.run()
    assert not sim.s.orphans and sim.s.host_accounting() == (host, 0)
    free, used, cached = sim.s.accounting()
    assert used == 0 and free + cached == pool


def test_cancel_during_swap_in_keeps_its_slots_until_the_copy_answers():
    sim = Sim(pool=60, host=200, max_tokens=40)
    cancel_during_copy(sim, first_swap_in(sim), pool=60, host=200)


def seed_like(quantum, host, **kw):
    """The seed scenario scaled down: a pool that holds one long answer at a time, three answers that each grow
    to almost all of it (a step is 10 ms of the fake clock)."""
    sim = Sim(pool=100, host=host, quantum=quantum, max_tokens=90, **kw)
    for i in range(3):
        sim.add(f"s{i}", 5, base=100 * i)
    sim.run()
    return sim


def test_rotation_bounds_the_largest_gap_and_keeps_answers_identical():
    plain = seed_like(quantum=0.0, host=400)
    fair = seed_like(quantum=0.05, host=400)
    ref = reference([(f"s{i}", 5, 100 * i) for i in range(3)], max_tokens=90)
    assert plain.done == ref and fair.done == ref
    plain_gap = max(plain.max_gap(r) for r in ref)
    fair_gap = max(fair.max_gap(r) for r in ref)
    # without rotation a paused answer waits for another to finish (tens of steps); with it, about three quanta at
    # most (two others ahead, each resumed for a quantum, plus the swap-in steps)
    assert plain_gap >= 0.4, plain_gap
    assert fair_gap <= 3 * 0.05 + 0.015 and fair_gap * 2.5 < plain_gap, (plain_gap, fair_gap)
    assert fair.s.num_rotations > 0 and fair.s.num_recoveries["host"] > 0
    assert fair.s.host_accounting() == (400, 0)


def test_a_longer_turn_wait_pays_for_fewer_turns_within_its_bound():
    """--rotation-wait: the longest-paused request takes its turn once it has waited turn_wait (never less than a
    quantum). With two paused, a turn then lasts about turn_wait / 2 instead of a quantum: fewer turns, fewer
    tokens swapped back in, the largest gap about turn_wait (plus up to a quantum for a victim that has just
    resumed), and the same answers."""
    ref = reference([(f"s{i}", 5, 100 * i) for i in range(3)], max_tokens=90)
    quick = seed_like(quantum=0.05, host=400)
    clamped = seed_like(quantum=0.05, host=400, turn_wait=0.01)  # below a quantum: a quantum
    longer = seed_like(quantum=0.05, host=400, turn_wait=0.2)
    assert quick.done == ref and clamped.done == ref and longer.done == ref
    assert clamped.s.num_rotations == quick.s.num_rotations
    assert longer.s.num_rotations <= 0.6 * quick.s.num_rotations, (longer.s.num_rotations, quick.s.num_rotations)
    assert longer.s.swapped_tokens["in"] <= 0.7 * quick.s.swapped_tokens["in"]
    gap = max(longer.max_gap(r) for r in ref)
    assert 0.2 <= gap <= 0.2 + 0.05 + 0.015, gap
    assert longer.s.host_accounting() == (400, 0)


def crowd(turns_per_wait, n=12):
    """A sustained overload scaled down: twelve answers of 5 + 60 tokens on a pool that holds about three of them,
    so about nine are paused at once (a step is 10 ms of the fake clock). Returns the sim and each turn's (time,
    requests paused when it came)."""
    sim = Sim(pool=200, host=2000, quantum=0.03, turn_wait=0.1, max_tokens=60, turns_per_wait=turns_per_wait)
    for i in range(n):
        sim.add(f"c{i}", 5, base=100 * i)
    turns = []
    for _ in range(20000):
        if sim.s.idle():
            break
        paused = len(sim.s.by_state(ReqState.PAUSED))
        if sim.step().rotated:
            turns.append((sim.clock.t, paused))
    assert sim.s.idle(), sim.s.counts()
    return sim, turns


def test_the_turns_bound_spaces_turns_and_swaps_back_less_under_a_crowd():
    """--rotation-turns: with many paused, a turn every turn_wait / k swaps an answer's K/V back in at almost every
    step. Bounded (turns_per_wait 2): while more than 2 are paused, turns come at least turn_wait apart, and with 2
    or fewer at least turn_wait / 2; each resumed answer runs longer, fewer tokens are swapped in, the answers are
    the same and each paused one still gets its turns."""
    free, bounded = crowd(0), crowd(2)
    ref = reference([(f"c{i}", 5, 100 * i) for i in range(12)], max_tokens=60)
    (fs, ft), (bs, bt) = free, bounded
    assert fs.done == ref and bs.done == ref
    spacing = [(b - a, k) for (a, _), (b, k) in zip(bt, bt[1:])]
    assert all(d >= (0.1 if k > 2 else 0.05) - 1e-9 for d, k in spacing), spacing
    assert any(k > 2 for _, k in spacing)  # the crowd's rule was exercised
    assert min(b - a for (a, _), (b, _) in zip(ft, ft[1:])) < 0.05  # without the bound turns come closer
    assert len(bt) >= 10 and len(bt) <= 0.6 * len(ft), (len(bt), len(ft))
    assert bs.s.swapped_tokens["in"] <= 0.6 * fs.s.swapped_tokens["in"], (bs.s.swapped_tokens, fs.s.swapped_tokens)
    assert max(bs.max_gap(r) for r in ref) <= 12 * 0.1  # about k * turn_wait at most
    assert bs.s.host_accounting() == (2000, 0) and fs.s.host_accounting() == (2000, 0)


def test_a_few_paused_streams_take_turns_as_often_as_unbounded():
    """The seed scenario's shape at small scale (four answers on a pool for two, so at most two paused, fewer than
    turns_per_wait): the bound changes nothing: the same turns at the same times, each paused stream waiting about
    turn_wait."""
    runs = []
    for turns_per_wait in (0, 4):
        sim = Sim(pool=300, host=2000, quantum=0.03, turn_wait=0.1, max_tokens=120, turns_per_wait=turns_per_wait)
        for i in range(4):
            sim.add(f"f{i}", 10, base=1000 * i)
        turns = []
        for _ in range(20000):
            if sim.s.idle():
                break
            if sim.step().rotated:
                turns.append(sim.clock.t)
        runs.append((sim, turns))
    (free, ft), (bounded, bt) = runs
    ref = reference([(f"f{i}", 10, 1000 * i) for i in range(4)], max_tokens=120)
    assert free.done == bounded.done == ref
    assert len(bt) >= 5 and bt == ft
    assert max(bounded.max_gap(r) for r in ref) <= 0.1 + 0.05


def test_smallest_victims_let_the_longest_answer_run_and_swap_back_less():
    """--rotation-victims smallest (the default) against longest-running, the seed scenario at 1/20 (a pool for
    1.5 answers, three answers, turns of 0.3 s): the request furthest along keeps running, so the run takes no
    more steps and a turn swaps back the shorter answer's K/V (25% fewer tokens here, 46% fewer at full size in a
    timed simulation); the answers are the same and every gap stays within a turn."""
    runs = {}
    for victims in ("longest-running", "smallest"):
        sim = Sim(pool=410, host=1640, quantum=0.1, turn_wait=0.3, max_tokens=265, rotation_victims=victims)
        for i in range(3):
            sim.add(f"s{i}", 10, base=1000 * i)
        sim.run(limit=2000)
        runs[victims] = sim
    fair, small = runs["longest-running"], runs["smallest"]
    assert small.done == fair.done == reference([(f"s{i}", 10, 1000 * i) for i in range(3)], max_tokens=265)
    assert len(small.plans) <= len(fair.plans)
    swapped = small.s.swapped_tokens["in"], fair.s.swapped_tokens["in"]
    assert swapped[0] <= 0.8 * swapped[1], swapped
    assert max(small.max_gap(r) for r in small.done) <= 0.3 + 0.1 + 0.03
    assert small.s.host_accounting() == (1640, 0)


@pytest.mark.parametrize("host", [None, 400])
def test_hybrid_rotation_bounds_the_largest_gap_as_for_a_dense_model(host):
    """A running hybrid request moves its K/V into the cache every 32 tokens (its state checkpoints), so most of
    what it holds is cached and locked only by it: rotation must count that as freed by a pause, or it never finds
    room and a paused answer waits for another to finish (seen on an H200: 0 rotations, a 6.7 s gap)."""
    fair = seed_like(quantum=0.05, host=host, state_pages=40, host_pages=16 if host else 0)
    ref = reference([(f"s{i}", 5, 100 * i) for i in range(3)], max_tokens=90)
    assert fair.done == ref
    gap = max(fair.max_gap(r) for r in ref)
    assert fair.s.num_rotations >= 10 and gap <= 3 * 0.05 + 0.015, (fair.s.num_rotations, gap)
    assert fair.s.num_recoveries["host" if host else "recompute"] > 0


def test_each_host_copy_stays_one_run_of_host_slots_as_it_grows():
    """A request pauses many times under rotation and its host copy grows at each pause: with a roomy host pool
    every copy is one run of consecutive host slots (one DMA per swap, not one per pause), and answers are exact."""
    sim = Sim(pool=100, host=400, quantum=0.05, max_tokens=90)
    for i in range(3):
        sim.add(f"s{i}", 5, base=100 * i)
    most_runs = 0
    for _ in range(5000):
        if sim.s.idle():
            break
        sim.step()
        for c in sim.s.host.values():
            most_runs = max(most_runs, 1 + sum(1 for a, b in zip(c.slots, c.slots[1:]) if b != a + 1))
    assert sim.s.idle() and sim.s.num_rotations >= 10 and sim.s.swapped_tokens["out"] > 95
    assert most_runs == 1, most_runs
    assert sim.done == reference([(f"s{i}", 5, 100 * i) for i in range(3)], max_tokens=90)
    assert sim.s.host_accounting() == (400, 0)


def waited_swap_in_tokens(sim) -> int:
    """Tokens swapped in at a paused request's turn (decode waits for them), not ahead of it."""
    return sum(len(j.host_slots) for p in sim.plans for j in p.swap_ins if not j.prefetch)


def test_prefetch_moves_most_of_a_turns_swap_in_ahead_of_it():
    """Rotation copies the next paused request's positions back into free slots before its turn: answers stay
    exact, the largest gap stays bounded, and the swap-ins decode waits for at a turn carry fewer tokens."""
    ref = reference([(f"s{i}", 5, 100 * i) for i in range(3)], max_tokens=90)
    without = seed_like(quantum=0.05, host=400, prefetch_margin=None)
    ahead = seed_like(quantum=0.05, host=400, prefetch_margin=4, prefetch_min=8)
    assert without.done == ref and ahead.done == ref
    assert without.s.num_prefetches == 0 and ahead.s.num_prefetches >= 10
    assert ahead.s.swapped_tokens["prefetch"] > 0
    assert waited_swap_in_tokens(ahead) < 0.7 * waited_swap_in_tokens(without), (
        waited_swap_in_tokens(ahead),
        waited_swap_in_tokens(without),
    )
    # and it costs nothing else: no running request is paused for lack of the slots a prefetch took, and what
    # is prefetched is used, not evicted and fetched again (seen on an H200 before each pause got one prefetch)
    assert ahead.s.num_pauses == without.s.num_pauses
    assert ahead.s.swapped_tokens["in"] <= 1.05 * without.s.swapped_tokens["in"]
    assert max(ahead.max_gap(r) for r in ref) <= 3 * 0.05 + 0.015
    assert ahead.s.host_accounting() == (400, 0)
    free, used, cached = ahead.s.accounting()
    assert used == 0 and free + cached == 100


def test_hybrid_prefetch_moves_a_turns_kv_ahead_and_takes_the_state_from_its_parked_page():
    """A hybrid model's next paused request gets its K/V back ahead of its turn too (into the cache, without a
    state checkpoint); at its turn it takes that K/V prefix and the rest, and the state from its own page, which
    waited on the device (no state copy either way). The
    simulation checks every position's K/V and every page's state at each step: answers stay exact, the gap
    bounded, and decode waits for fewer tokens at a turn."""
    ref = reference([(f"s{i}", 5, 100 * i) for i in range(3)], max_tokens=90)
    hybrid_kw = dict(quantum=0.05, host=400, state_pages=40, host_pages=16)
    without = seed_like(prefetch_margin=None, **hybrid_kw)
    ahead = seed_like(prefetch_margin=4, prefetch_min=8, **hybrid_kw)
    assert without.done == ref and ahead.done == ref
    assert without.s.num_prefetches == 0 and ahead.s.num_prefetches >= 10
    jobs = [j for p in ahead.plans for j in p.swap_ins]
    assert all(j.host_page == ZERO for j in jobs if j.prefetch)  # the K/V alone ahead of the turn
    at_turn = [j for j in jobs if not j.prefetch]
    # its page waited on the device: the K/V alone at the turn too, and nothing of the state went out
    assert at_turn and all(j.host_page == ZERO for j in at_turn)
    assert all(o.host_page == ZERO for p in ahead.plans for o in p.swap_outs)
    assert ahead.s.parked_pages["parked"] == ahead.s.num_pauses > 0 and ahead.s.parked_pages["unparked"] == 0
    assert waited_swap_in_tokens(ahead) < 0.7 * waited_swap_in_tokens(without), (
        waited_swap_in_tokens(ahead),
        waited_swap_in_tokens(without),
    )
    assert ahead.s.num_pauses == without.s.num_pauses
    assert max(ahead.max_gap(r) for r in ref) <= 3 * 0.05 + 0.015
    assert ahead.s.host_accounting() == (400, 0) and ahead.s.host_pages.num_free == 16
    free, live, ckpts = ahead.s.state_accounting()
    assert live == 0 and free + ckpts == 40


@pytest.mark.no_quiet_probe  # counts the cache's matches: the probe's copy would add to them
def test_prefetch_tries_once_per_pause():
    """A prefetch matches the request's tokens in the tree (thousands of positions on a real pool): one try per
    pause, taken or not, never one per step (on an H200 that tripled the scheduler's time)."""
    counts = {}
    for margin in (None, 4):
        sim = Sim(pool=100, host=400, quantum=0.05, max_tokens=90, prefetch_margin=margin, prefetch_min=8)
        calls = [0]
        match = sim.s.kv.match

        def counted(req, limit, kv_only=False, match=match, calls=calls):
            calls[0] += 1
            match(req, limit, kv_only)

        sim.s.kv.match = counted
        for i in range(3):
            sim.add(f"s{i}", 5, base=100 * i)
        sim.run()
        counts[margin] = (calls[0], sim.s.num_pauses, sim.s.num_prefetches)
    (plain_calls, _, _), (calls, pauses, prefetches) = counts[None], counts[4]
    assert prefetches > 0 and calls - plain_calls <= pauses, counts


def test_cancel_during_prefetch_keeps_its_slots_until_the_copy_answers():
    sim = Sim(pool=100, host=400, quantum=0.05, max_tokens=90, prefetch_margin=4, prefetch_min=8)
    for i in range(3):
        sim.add(f"s{i}", 5, base=100 * i)
    for _ in range(2000):
        plan = sim.step()
        jobs = [j for j in plan.swap_ins if j.prefetch]
        if jobs:
            break
    else:
        pytest.fail("no prefetch")
    job = jobs[0]
    assert sim.s.reqs[job.rid].state is ReqState.PAUSED
    cancel_during_copy(sim, job, pool=100, host=400)
    ref = reference([(f"s{i}", 5, 100 * i) for i in range(3)], max_tokens=90)
    assert sim.done == {k: v for k, v in ref.items() if k != job.rid}


def test_rotation_without_host_tier_recovers_through_prefill_or_cache():
    sim = seed_like(quantum=0.05, host=None)
    assert sim.done == reference([(f"s{i}", 5, 100 * i) for i in range(3)], max_tokens=90)
    assert sim.s.num_rotations > 0 and sim.s.num_recoveries["host"] == 0


def test_rotation_never_pauses_without_making_room():
    """A request that has not run a quantum is not paused, even when one waits."""
    sim = Sim(pool=100, host=400, quantum=10.0, max_tokens=90)
    for i in range(3):
        sim.add(f"s{i}", 5, base=100 * i)
    sim.run()
    assert sim.s.num_rotations == 0  # every run ends well before a 10 s quantum


def random_load(sim, rng, max_tokens=30) -> None:
    """Requests arriving at random for 200 steps, 2% of steps cancelling one, run to idle: every answer not
    cancelled equals the reference's, and every host slot is free again."""
    prompts, cancelled = [], set()
    for step in range(3000):
        if step < 200 and rng.random() < 0.15:
            rid = f"q{step}"
            n, base = rng.randint(3, 25), rng.choice([0, 0, 500, 1000 * step])
            prompts.append((rid, n, base))
            sim.add(rid, n, base)
        if rng.random() < 0.02 and sim.s.reqs:
            rid = rng.choice(sorted(sim.s.reqs))
            sim.s.cancel(rid)
            cancelled.add(rid)
        if step > 200 and sim.s.idle():
            break
        sim.step()
    assert sim.s.idle()
    ref = reference(prompts, max_tokens=max_tokens)
    assert {k: v for k, v in ref.items() if k not in cancelled} == {
        k: v for k, v in sim.done.items() if k not in cancelled
    }
    assert set(sim.done) | cancelled == set(ref)
    assert sim.s.host_accounting() == (sim.s.host_pool.num_slots, 0)


@pytest.mark.parametrize("seed", range(6))
def test_random_load_with_host_tier_rotation_and_cancels(seed):
    rng = random.Random(seed)
    sim = Sim(pool=120, host=rng.choice([30, 150, 600]), quantum=rng.choice([0.0, 0.03]), max_tokens=30,
              prefetch_margin=rng.choice([None, 1, 4]), prefetch_min=rng.choice([1, 8]),
              rotation_victims=rng.choice(["smallest", "longest-running"]))  # fmt: skip
    random_load(sim, rng)
    free, used, cached = sim.s.accounting()
    assert used == 0 and free + cached == 120


# ---- hybrid models: the host copy holds the state at its end ---------------------------------------------------
def hybrid(pool=60, host=200, host_pages=4, state_pages=12, **kw):
    return Sim(pool=pool, host=host, host_pages=host_pages, state_pages=state_pages, **kw)


def test_hybrid_host_copy_without_a_state_page_is_not_kept():
    """Host state pages run out (one, held by a paused request): the next pause keeps no host copy (host_full),
    its recovery goes another way, and every answer is still right."""
    sim = hybrid(pool=60, host=400, host_pages=1, max_tokens=40)
    for i in range(4):
        sim.add(f"r{i}", 10, base=100 * i)
    sim.run()
    assert sim.s.host_skips["host_full"] >= 1
    assert sim.done == reference([(f"r{i}", 10, 100 * i) for i in range(4)])


def test_hybrid_cancel_during_swap_frees_host_pages_at_once():
    """A request cancelled while its swap-in is in flight gives its host page back at once; its device page (the
    copy's target, or its parked page) stays held by the orphan until the copy answers."""
    sim = hybrid(max_tokens=40)
    job = first_swap_in(sim)
    held = sim.s.host_pages.num_slots - sim.s.host_pages.num_free
    sim.s.cancel(job.rid)
    assert sim.s.host_pages.num_slots - sim.s.host_pages.num_free == held - 1  # its host page is free at once
    page = sim.s.orphans[(job.rid, job.epoch)].state_page
    assert page != ZERO and not sim.s.state.pool.is_free(page)  # still written (the K/V at least)
    assert job.state_page != page  # parked: the state is on the device already, not in the copy
    sim.run()
    free, live, ckpts = sim.s.state_accounting()
    assert live == 0 and free + ckpts == sim.s.state.num_pages
    assert not sim.s.orphans and sim.s.host_pages.num_free == 4 and sim.s.host_accounting() == (200, 0)


def test_hybrid_paused_state_waits_on_the_device_and_goes_out_only_when_a_page_is_needed():
    """A pause copies only new K/V out and keeps the request's state page on the device;
    its host recovery copies only the missing K/V back. With fewer pages than requests, a page is taken from the
    paused request whose turn is furthest off: its state first goes to its host copy's page (a state-only swap-out
    in the same plan), and its recovery then brings that page back. The simulation checks every page's state."""
    roomy = hybrid(pool=60, host=400, host_pages=8, state_pages=12, max_tokens=40, quantum=0.03)
    for i in range(3):
        roomy.add(f"r{i}", 10, base=100 * i)
    roomy.run()
    outs = [o for p in roomy.plans for o in p.swap_outs]
    ins = [j for p in roomy.plans for j in p.swap_ins]
    assert roomy.s.parked_pages["parked"] == roomy.s.num_pauses > 0 and roomy.s.parked_pages["unparked"] == 0
    assert outs and all(o.host_page == ZERO for o in outs)
    assert ins and all(j.host_page == ZERO for j in ins) and roomy.s.num_recoveries["host"] >= 1
    assert roomy.done == reference([(f"r{i}", 10, 100 * i) for i in range(3)], max_tokens=40)
    free, live, ckpts = roomy.s.state_accounting()
    assert live == 0 and free + ckpts == roomy.s.state.num_pages and not roomy.s._parked
    assert roomy.s.host_accounting() == (roomy.s.host_pool.num_slots, 0)


def test_a_parked_page_is_taken_back_when_no_page_is_left():
    """Every request got its page at admission and a parked one keeps it, so pages do not run short while
    admissions wait for paused requests; should one be needed anyway, `KVAccounting.alloc_state` takes the parked
    page of the paused request whose turn is furthest off: its state goes to its host copy's page first (a
    state-only swap-out in the plan being made), it recovers from there, and every answer stays exact."""
    sim = hybrid(pool=60, host=600, host_pages=8, state_pages=12, max_tokens=40, quantum=0.03)
    for i in range(3):
        sim.add(f"r{i}", 10, base=100 * i)
    while len(sim.s._parked) < 1:
        sim.step()
    s = sim.s
    held = []  # every free page and checkpoint taken, as a burst of admissions would
    while (page := s.state.alloc()) is not None or s.radix.evict_state(1):
        held += [page] if page is not None else []
    with pytest.raises(StateError):  # outside schedule() nobody gives a page up
        s.kv.alloc_state()
    victim = s._paused_in_order()[-1]
    page, n = victim.state_page, victim.num_tokens - 1
    s._building = plan = Plan()
    assert s.kv.alloc_state() == page
    s._building = None
    assert victim.rid not in s._parked and victim.state_page == ZERO and s.parked_pages["unparked"] == 1
    (out,) = plan.swap_outs
    assert (out.rid, out.state_page, out.device_slots, out.host_slots) == (victim.rid, page, [], [])
    assert out.host_page == s.host[victim.rid].page != ZERO and s.host[victim.rid].page_at == n
    sim.host_pages[out.host_page] = sim.pages[page]  # the executor's copy
    for p in held + [page]:
        s.state.free(p)
    sim.run()
    assert any(j.rid == victim.rid and j.host_page != ZERO for p in sim.plans for j in p.swap_ins)
    assert sim.done == reference([(f"r{i}", 10, 100 * i) for i in range(3)], max_tokens=40)


@pytest.mark.parametrize("seed", range(8))
def test_hybrid_random_load_with_host_tier_rotation_and_cancels(seed):
    rng = random.Random(seed)
    pages = rng.choice([5, 6, 16])  # few: checkpoints are dropped, and pages of paused requests reused at once
    sim = hybrid(pool=120, host=rng.choice([30, 150, 600]), host_pages=rng.choice([1, 3, 8]), state_pages=pages,
                 quantum=rng.choice([0.0, 0.03]), max_tokens=30, max_running=4)  # fmt: skip
    random_load(sim, rng)
    assert sim.s.num_recoveries["host"] > 0
    assert sim.s.host_pages.num_free == sim.s.host_pages.num_slots
    free, live, ckpts = sim.s.state_accounting()
    assert live == 0 and free + ckpts == pages


# ---- the executor's copies (backends/pd_decode/host_tier.py) on CPU tensors ------------------------------------


class StateCfg:  # a state store's shape: 2 linear layers, conv 6 x 3, 2 heads of 4 x 4 (tests/kernels too)
    conv_dim, linear_conv_kernel_dim, linear_num_value_heads, linear_key_head_dim = 6, 4, 2, 4
    linear_value_head_dim, linear_layers = 4, [0, 1]

    def state_floats_per_page(self):
        return 2 * (6 * 3 + 2 * 4 * 4)


def test_host_kv_round_trip_with_fragmented_host_slots(monkeypatch):
    import torch

    from backends.pd_decode import host_tier
    from backends.pd_decode.scheduler import SwapOut, TransferJob

    monkeypatch.setattr(host_tier, "CHUNK", 5)  # several staging chunks per copy
    from backends.common.model.kv_store import KVStore

    dev = torch.randn(3, 2, 40, 2, 4)  # [layers, K/V, slots, heads, dim]
    host = host_tier.HostKV(KVStore(dev), 32)
    assert host.bytes_per_slot == 3 * 2 * 2 * 4 * 4 and host.nbytes == 32 * host.bytes_per_slot
    src = [7, 3, 30, 31, 12, 0, 19, 18, 17, 25, 26, 27, 9]
    hs = [20, 19, 18, 2, 3, 4, 31, 0, 1, 10, 11, 12, 5]  # descending, ascending and lone runs
    want = dev[:, :, src].clone()
    host.swap_out([SwapOut("a", 0, src, hs)])
    dev.zero_()
    dst = [39, 38, 1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22]
    job = TransferJob("a", 1, [], 0, dst, False, "host", hs)
    assert host.swap_in([job]) == [job]  # synchronous on the CPU
    assert torch.equal(dev[:, :, dst], want)
    untouched = [s for s in range(40) if s not in dst]
    assert dev[:, :, untouched].abs().sum() == 0


def test_host_kv_round_trip_carries_the_state_page_bit_exact():
    import torch

    from backends.common.model.kv_store import KVStore, StateStore
    from backends.pd_decode import host_tier
    from backends.pd_decode.scheduler import SwapOut, TransferJob

    dev = torch.randn(2, 2, 20, 2, 4)
    state = StateStore(StateCfg(), torch.randn(5, StateCfg().state_floats_per_page()))
    host = host_tier.HostKV(KVStore(dev), 16, state, num_pages=3)
    assert host.nbytes == 16 * host.bytes_per_slot + 3 * state.bytes_per_page
    want_kv, want_state = dev[:, :, [4, 5, 6]].clone(), state.buffer[2].clone()
    host.swap_out([SwapOut("a", 0, [4, 5, 6], [9, 10, 11], state_page=2, host_page=1)])
    dev.zero_()
    state.buffer.zero_()
    job = TransferJob("a", 1, [], 0, [0, 1, 2], False, "host", [9, 10, 11], state_page=4, host_page=1)
    assert host.swap_in([job]) == [job]
    assert torch.equal(dev[:, :, [0, 1, 2]], want_kv) and torch.equal(state.buffer[4], want_state)
    assert not state.buffer[[0, 1, 2, 3]].any()  # only the job's page was written


def test_runs_and_host_order():
    from backends.pd_decode.host_tier import by_host_slot, runs

    assert runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    d, h = by_host_slot([10, 11, 12, 13], [7, 6, 5, 1])
    assert h.tolist() == [1, 5, 6, 7] and d.tolist() == [13, 12, 11, 10] and runs(h) == [(0, 1, 1), (1, 5, 3)]


# ---- the state machine --------------------------------------------------------------------------------------------


def test_illegal_moves_are_refused():
    from backends.pd_decode.scheduler import TRANSITIONS, IllegalTransition

    s = DecodeScheduler(KVPool(16))
    for src, allowed in TRANSITIONS.items():
        for dst in ReqState:
            req = InferReq(f"{src.value}-{dst.value}", [1, 2], SamplingParams())
            req.state = src
            if dst in allowed:
                s._move(req, dst)
                assert req.state is dst
            else:
                with pytest.raises(IllegalTransition):
                    s._move(req, dst)
                assert req.state is src
    done = InferReq("done", [1, 2], SamplingParams())
    done.state = ReqState.FINISHED
    with pytest.raises(IllegalTransition):
        s.add(done)


def test_random_load_takes_every_transition_of_the_table(monkeypatch):
    """The table is not wider than the scheduler needs: randomized runs take every move it allows."""
    from backends.pd_decode import scheduler as sched_mod

    seen = set()
    move = sched_mod.DecodeScheduler._move

    def spy(self, req, to):
        seen.add((req.state, to))
        move(self, req, to)

    monkeypatch.setattr(sched_mod.DecodeScheduler, "_move", spy)
    for seed in range(6):
        test_random_load_with_host_tier_rotation_and_cancels(seed)
    s = DecodeScheduler(KVPool(16))  # a prompt transfer that fails (the random runs' prefill never does)
    s.add(InferReq("f", [1, 2, 3], SamplingParams()))
    job = s.schedule().transfers[0]
    assert s.on_transfer_done(job.rid, job.epoch, False, error="boom").failed == "boom"
    allowed = {(a, b) for a, bs in sched_mod.TRANSITIONS.items() for b in bs}
    assert seen == allowed, sorted((a.value, b.value) for a, b in allowed - seen)


def test_host_kv_buffer_is_resident_when_made_on_the_cpu():
    """The host tier takes its memory when decode starts, not page by page as slots are first used (which a soak
    reads as RSS growth): making a 64 MB tier raises the process's resident memory by about that much. Measured in
    a fresh interpreter: in pytest's own process, memory freed by earlier tests may already be resident (the
    difference was 0 bytes in a full run)."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import torch
from backends.common.model.kv_store import KVStore
from backends.pd_decode import host_tier

def rss():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith("VmRSS:"))

dev = torch.zeros(2, 2, 8, 4, 64)  # 4 KB a slot
before = rss()
host = host_tier.HostKV(KVStore(dev), 16384)
print(host.nbytes, rss() - before)
"""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    nbytes, grew = map(int, out.stdout.split())
    assert nbytes == 64 << 20
    assert grew >= 0.9 * nbytes, (grew, nbytes)
