"""Decode's scheduler: request states, KV slot ownership, pause and recovery. Plain Python over integers, no
device and no Triton, so every transition is unit-testable in milliseconds.

    WAITING ─admit─► WAITING_KV ─(prompt KV written, epoch ok)─► RUNNING ─► FINISHED
                                                                  │  ▲
                    (no slot for next token, or its turn is over)  ▼  │ (local radix hit, host swap-in done, or
                                                                 PAUSED ─► RECOVERING   prefill wrote the missing
                                                                                        KV; epoch ok)

A request's KV: slots[i] holds position i for i in [0, len(slots)). A transfer for (rid, epoch) writes positions
[start, end) into slots[start:end]; those slots are not reused until that transfer answers (invariant 5).

Host tier (optional, `host_pool`): when a request pauses, the positions its host copy lacks are copied out
(`Plan.swap_outs`), so that recovery can bring them back with a host-to-device copy (`Plan.swap_ins`, answered
through `on_transfer_done` like a prefill transfer) instead of a prefill recompute. The executor runs every copy on
one FIFO copy stream and orders later writes after the swap-outs (see `Plan`), so a paused request's device slots
can be reused in the same plan. A host copy stays valid while the request lives (its tokens only grow), so a later
pause copies only the new positions; copies of requests that are not paused are reclaimed first when host memory
runs short. Recovery takes the cheapest path (`RecoveryCosts`): local radix hit, host swap-in, prefill recompute.
A copy's host slots stay one run where the host pool allows (it grows in place; a new copy starts past the others'
room to grow), so that a swap is one DMA per run rather than one per earlier pause.
Hybrid models (`state` and `host_pages`): a host copy also owns a host state page. A paused request keeps its live
page on the device (parked), so a swap-out copies only the new K/V and a host recovery only the missing K/V; the
page goes to the host copy's page, with the positions it covers, only when another request needs a page and none
is free (`_unpark`), and a recovery from such a copy brings back the missing K/V and the whole page. Either way
the request resumes at exactly the paused position.

Rotation (`quantum` > 0): when a request has been paused for `turn_wait` seconds (at least `quantum`) and does not
fit, requests that have run for at least `quantum` since they last resumed are paused to make room for it (by
default those holding the fewest positions: the ones furthest along keep running and finish, and each turn swaps
the least K/V back), and paused requests recover strictly in the order they paused. With k requests paused, a turn
lasts about max(quantum, turn_wait / k) and a paused stream waits about max(turn_wait, k * quantum) while the pool is
over-committed: few streams taking turns pay for few turns, and many still get one quantum each.
With a host tier, the next paused request's positions are copied back ahead of its turn into slots that are free
or hold evictable cache (`Plan.swap_ins`, jobs with `prefetch`): it stays paused, and when the copy answers those
positions go to the cache like a paused request's own KV, so at its turn they are a local hit and only the rest is
swapped in while decode waits. Hybrid models too, from a host copy holding the state at the paused position: the
prefetched K/V goes to the cache without a checkpoint, and at its turn the request takes its cached K/V prefix
(checkpoint or not) and the state from the copy's page with the rest.

Liveness: a request never holds more than `max_len` tokens (the pool's size, or less), so whenever nothing runs
and no transfer is in flight, every cached slot is evictable and the head of the queue fits. `add` refuses a
prompt that could never fit, a request that reaches `max_len` ends with "length", and `check_invariants` reports
an idle scheduler with work waiting (it must never happen).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from backends.common.core.kv_pool import KVPool
from backends.common.core.radix_cache import RadixCache
from backends.common.core.request import InferReq, ParamError, ReqState
from backends.common.core.scheduler import KVAccounting, state_accounting
from backends.common.core.state_pages import ZERO, StatePages

PAUSED_PRIORITY = 1  # radix eviction priority of a paused request's KV (finished requests' KV has 0)

_S = ReqState
# Every state change a request may make on decode (the diagram above); `DecodeScheduler._move` refuses the rest.
TRANSITIONS: dict[ReqState, frozenset[ReqState]] = {
    _S.WAITING: frozenset({_S.WAITING_KV, _S.FINISHED}),  # admitted; cancelled or never fits
    _S.WAITING_KV: frozenset({_S.RUNNING, _S.FINISHED}),  # prompt KV written; prefill failed or cancelled
    _S.RUNNING: frozenset({_S.PAUSED, _S.FINISHED}),  # no slot or its turn is over; ended or cancelled
    _S.PAUSED: frozenset({_S.RUNNING, _S.RECOVERING, _S.FINISHED}),  # local hit; host or prefill; cancelled
    _S.RECOVERING: frozenset({_S.RUNNING, _S.FINISHED}),  # KV back; prefill failed or cancelled
    _S.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(slots=True)
class TransferJob:
    """Ask prefill to compute K/V for ids[start:end] (end = len(ids)) and write them into dst_slots."""

    rid: str
    epoch: int
    ids: list[int]
    start: int
    dst_slots: list[int]
    sample: bool  # epoch 0: also sample the first output token; recovery: discard the sample
    # "prefill": prefill computes the positions; "host": copied from host_slots; "recompute": decode computes them
    # itself from its own cache's last state checkpoint (hybrid models, a short trimmed tail)
    source: str = "prefill"
    host_slots: list[int] = field(default_factory=list)  # source "host": host slots of positions [start, end)
    state_page: int = ZERO  # hybrid models: the request's page, into which prefill writes the state at `end`
    host_page: int = ZERO  # hybrid models, source "host": the host state page holding the state at `end`
    # source "host": positions copied back ahead of a paused request's turn; it stays paused and the positions go
    # to the cache when the copy answers (see the module doc)
    prefetch: bool = False

    @property
    def num_positions(self) -> int:
        return len(self.ids) - self.start


@dataclass(slots=True)
class SwapOut:
    """Copy device_slots (positions [start, start + n) of request rid) into host_slots."""

    rid: str
    start: int
    device_slots: list[int]
    host_slots: list[int]
    state_page: int = ZERO  # hybrid models: the live page (the state at start + n) to copy into host_page
    host_page: int = ZERO


@dataclass(slots=True)
class HostCopy:
    """A request's KV in host memory: slots[i] is the host slot of position i; hybrid models: page, the host state
    page, holding the state at position page_at."""

    slots: list[int]
    used_at: float
    page: int = ZERO
    end: int = 0  # host slots [slots[0], end) are meant for its growth (other copies start past them)
    # hybrid models: the position whose state `page` holds (-1: none yet); behind len(slots) while the request's
    # own page waits on the device (`DecodeScheduler.park_state`), the page copied out only when it is taken
    page_at: int = -1


@dataclass(slots=True)
class RecoveryCosts:
    """Estimated seconds to bring back n missing positions by each path; recovery takes the cheapest. The decode
    model derives them from the KV bytes per token and the model size; tests set them directly."""

    host_per_token: float = 1e-6
    prefill_fixed: float = 5e-3
    prefill_per_token: float = 2e-5
    host_fixed: float = 0.0  # hybrid models: one state page's copy

    def host(self, n: int) -> float:
        return self.host_fixed + n * self.host_per_token

    def prefill(self, n: int) -> float:
        return self.prefill_fixed + n * self.prefill_per_token


@dataclass(slots=True)
class Plan:
    """What the executor does, in this order: swap_outs (reading device slots before anything else writes them:
    a decode step waits for them, prefill transfers start after they are done), swap_ins (on the same copy stream,
    after the swap-outs), transfers, then the decode step."""

    decode: list[InferReq] = field(default_factory=list)  # run one decode step; slots[-1] is reserved for it
    transfers: list[TransferJob] = field(default_factory=list)  # prefill computes K/V into decode's slots
    swap_outs: list[SwapOut] = field(default_factory=list)
    swap_ins: list[TransferJob] = field(default_factory=list)  # source "host"; answered by on_transfer_done
    recomputes: list[TransferJob] = field(default_factory=list)  # source "recompute": run by decode, then answered
    paused: list[InferReq] = field(default_factory=list)
    restarted: list[InferReq] = field(default_factory=list)  # on_oom="restart": segments ended
    resumed_local: list[InferReq] = field(default_factory=list)
    ended: list[InferReq] = field(default_factory=list)  # finished by the scheduler ("length": pool capacity)
    failed: list[InferReq] = field(default_factory=list)  # finished with req.error: it can never fit
    rotated: list[InferReq] = field(default_factory=list)  # of `paused`, those paused to give another its turn


@dataclass(slots=True)
class Completion:
    """What the caller must do after a transfer answered."""

    req: InferReq | None
    first_token: int | None = None  # epoch-0 transfer: the sampled first token (already appended)
    failed: str | None = None
    stale: bool = False
    recovered: bool = False
    path: str | None = None  # recovered: "prefill" or "host"


class DecodeScheduler:
    def __init__(
        self,
        pool: KVPool,
        max_running: int = 256,
        pause_policy: str = "latest",
        on_oom: str = "pause",
        reserve_per_running: int = 1,
        max_len: int | None = None,
        host_pool: KVPool | None = None,
        host_pages: KVPool | None = None,
        quantum: float = 0.0,
        turn_wait: float = 0.0,
        costs: RecoveryCosts | None = None,
        clock: Callable[[], float] = time.monotonic,
        state: StatePages | None = None,
        speculative: bool = False,
        checkpoint_every: int = 32,
        recompute_max: int = 128,
        prefetch_margin: int | None = 64,
        prefetch_min: int = 64,
        rotation_victims: str = "smallest",
    ):
        """prefetch_margin: with rotation and a host tier, the next paused request's positions are copied back
        ahead of its turn into free slots, leaving this many free per running request for their growth until
        then (None: no prefetch); prefetch_min: a smaller prefetch (unless it is all that is missing) is not worth
        a copy's overhead. turn_wait: with rotation, how long the longest-paused request waits before it takes
        running requests' place (never less than `quantum`); rotation_victims: which running requests give way
        (see `_rotate`)."""
        if pause_policy not in ("latest", "oldest", "longest"):
            raise ValueError(f"pause_policy must be latest, oldest or longest, got {pause_policy!r}")
        if rotation_victims not in ("smallest", "longest-running"):
            raise ValueError(f"rotation_victims must be smallest or longest-running, got {rotation_victims!r}")
        if on_oom not in ("pause", "restart"):
            raise ValueError(f"on_oom must be pause or restart, got {on_oom!r}")
        if state is not None and host_pool is not None and (host_pages is None or host_pages.num_slots == 0):
            raise ValueError("host_pages: a hybrid model's host tier needs host state pages (one per host copy)")
        self.pool = pool
        self.state = state
        # speculative decoding: a running request with a draft also gets a slot for it, when one is free
        self.speculative = speculative
        # hybrid models: a running request's K/V and a copy of its state go to the cache every `checkpoint_every`
        # computed tokens, so that a paused history whose tail was trimmed still ends at a checkpoint; a tail of
        # at most `recompute_max` positions past it is recomputed by decode itself instead of by prefill
        self.checkpoint_every, self.recompute_max = checkpoint_every, recompute_max
        self.radix = RadixCache(pool, state)
        self.kv = KVAccounting(pool, self.radix)
        self.max_running, self.pause_policy, self.on_oom = max_running, pause_policy, on_oom
        self.reserve_per_running = reserve_per_running
        # tokens one request may hold (prompt + output): never more than the pool, so that any request fits once
        # nothing else holds KV; the caller lowers it to the model's context
        self.max_len = min(pool.num_slots, max_len) if max_len else pool.num_slots
        self.keep_paused_kv = True  # False: a paused request's KV goes straight back to the pool (tests)
        self.host_pool = host_pool if on_oom == "pause" else None
        self.host_pages = host_pages if self.host_pool is not None and state is not None else None
        # hybrid models with a host tier: a paused request's state page waits on the device (parked)
        self.park_state = self.host_pages is not None
        self.parked_pages = {"parked": 0, "unparked": 0}  # pauses that kept the page; pages taken back (`_unpark`)
        self._parked: set[str] = set()  # paused requests whose req.state_page waits on the device
        self._building: Plan | None = None  # the plan schedule() is making: where `_unpark` puts its copy
        self.kv.reclaim = self._unpark
        self.host: dict[str, HostCopy] = {}
        self.quantum = quantum if on_oom == "pause" else 0.0
        self.turn_wait = max(self.quantum, turn_wait) if self.quantum > 0 else 0.0
        self.rotation_victims = rotation_victims
        self.prefetch_margin, self.prefetch_min = prefetch_margin, prefetch_min
        self.num_prefetches = 0
        self._prefetched: dict[str, float] = {}  # rid -> the pause (its paused_at) its one prefetch was made in
        self.costs = costs or RecoveryCosts()
        self.clock = clock
        self.reqs: dict[str, InferReq] = {}  # every request not yet FINISHED, by rid
        self.inflight: dict[tuple[str, int], TransferJob] = {}
        self.orphans: dict[tuple[str, int], InferReq] = {}  # cancelled while a transfer was in flight
        self._arrivals = 0
        self.num_pauses = 0
        self.num_recoveries = {"local": 0, "host": 0, "prefill": 0, "recompute": 0}
        self.num_checkpoints = 0  # hybrid models: state checkpoints taken by running requests
        self.num_rotations = 0
        self.swapped_tokens = {"out": 0, "in": 0, "prefetch": 0}  # "prefetch": also counted in "in"
        # positions a recovery found already in this node's pool ("cached": its prefix cache, prefetched host copies
        # included) and those it fetched, by path
        self.recovered_tokens = {"cached": 0, "host": 0, "prefill": 0, "recompute": 0}
        # why a pause kept no host copy ("host_full") or a recovery skipped it ("host_partial": the copy lacks
        # positions after a host-full pause; "prefill_cheaper": the cost model chose prefill)
        self.host_skips = {"host_full": 0, "host_partial": 0, "prefill_cheaper": 0}
        self.num_stale = 0
        self.max_epoch = 0
        self.num_unfittable = 0  # requests ended by the liveness guard
        # until when (clock) a full schedule() is known to plan one more decode token for every running request and
        # nothing else (`quiet`); any input (arrival, finish, cancel, a failed, stale or prefetch answer) ends it,
        # except an answer that makes its request run (`on_transfer_done`)
        self._quiet_until = -math.inf
        # what the last full plan's rotation and prefetch declined for the paused head, though due, keyed by the
        # head's (rid, paused_at): its turn waits until this time (a running request reaches its quantum; inf: only
        # an input can change it), a declined prefetch until an input
        self._turn_retry: tuple[str, float, float] | None = None
        self._prefetch_declined: tuple[str, float] | None = None

    def _move(self, req: InferReq, to: ReqState) -> None:
        """The one place a request changes state: a move the table does not allow is a bug, raised at once."""
        if to not in TRANSITIONS[req.state]:
            raise IllegalTransition(f"{req.rid}: {req.state.value} -> {to.value} is not a decode transition")
        if req.state is ReqState.PAUSED:  # a parked page now is the live page of a recovery, or freed with it
            self._parked.discard(req.rid)
        req.state = to

    # ---- queries -----------------------------------------------------------------------------------------
    def by_state(self, state: ReqState) -> list[InferReq]:
        return sorted((r for r in self.reqs.values() if r.state is state), key=lambda r: r.arrival)

    def count(self, state: ReqState) -> int:
        return sum(1 for r in self.reqs.values() if r.state is state)

    def counts(self) -> dict[ReqState, int]:
        """Requests per state, every state but FINISHED, in one pass."""
        out = dict.fromkeys((s for s in ReqState if s is not ReqState.FINISHED), 0)
        for r in self.reqs.values():
            out[r.state] += 1
        return out

    def accounting(self) -> tuple[int, int, int]:
        """(free, used by requests and in-flight orphans, held by the radix cache): sums to the pool size."""
        holders = list(self.reqs.values()) + list(self.orphans.values())
        return self.pool.num_free, self.kv.used_by_requests(holders), self.radix.cached_size

    def state_accounting(self) -> tuple[int, int, int]:
        """(free, live pages of requests and in-flight orphans, cache checkpoints): sums to the state pages."""
        return state_accounting(self.radix, list(self.reqs.values()) + list(self.orphans.values()))

    def idle(self) -> bool:
        return not self.reqs and not self.orphans

    # ---- inputs ------------------------------------------------------------------------------------------
    def add(self, req: InferReq) -> None:
        """Queue a request. A prompt that could never fit (prompt + one output token > max_len) is refused with a
        ParamError naming input_ids: queued, it would wait for ever at the head of the queue."""
        if req.rid in self.reqs:
            raise ValueError(f"duplicate request id {req.rid}")
        if req.num_tokens >= self.max_len:
            raise ParamError(
                "input_ids",
                f"the prompt has {req.num_tokens} tokens, but a request on this decode instance can hold at most "
                f"{self.max_len} (its KV pool has {self.pool.num_slots} slots): prompt + 1 output token must fit",
            )
        if req.state is not ReqState.WAITING:
            raise IllegalTransition(f"{req.rid}: added in state {req.state.value}, not waiting")
        req.arrival = self._arrivals
        self._arrivals += 1
        self.reqs[req.rid] = req
        self._quiet_until = -math.inf

    def cancel(self, rid: str, reason: str = "cancelled") -> InferReq | None:
        """End a request now. Slots an in-flight transfer may still write stay reserved until it answers."""
        req = self.reqs.pop(rid, None)
        if req is None:
            return None
        self._quiet_until = -math.inf
        self._drop_host(rid)  # any later use of its host slots is a later copy on the same FIFO stream
        job = self._inflight_of(req)
        if job is not None:
            self.orphans[(req.rid, req.epoch)] = req
        else:
            self._drop_reserved(req)
            self.kv.release(req, keep_in_cache=req.state is ReqState.RUNNING)
        req.finish_reason = reason
        self._move(req, ReqState.FINISHED)
        return req

    def _drop_reserved(self, req: InferReq) -> None:
        """Slots reserved for the next token (and a draft) hold no K/V of the request's tokens: give them back
        before caching the rest."""
        while req.slots and len(req.slots) >= req.num_tokens and len(req.slots) > req.cached_len:
            self.pool.free([req.slots.pop()])

    def finish(self, req: InferReq, reason: str) -> None:
        self._quiet_until = -math.inf
        self._drop_reserved(req)
        self.reqs.pop(req.rid, None)
        self._drop_host(req.rid)
        req.finish_reason = reason
        self._move(req, ReqState.FINISHED)
        self.kv.release(req, keep_in_cache=True)

    def on_transfer_done(
        self, rid: str, epoch: int, ok: bool, first_token: int | None = None, error: str | None = None
    ) -> Completion:
        job = self.inflight.pop((rid, epoch), None)
        orphan = self.orphans.pop((rid, epoch), None)
        if orphan is not None:  # cancelled meanwhile: the transfer has answered, so its slots are safe to reuse
            self._quiet_until = -math.inf
            self.kv.release(orphan, keep_in_cache=False)
            return Completion(None, stale=False)
        req = self.reqs.get(rid)
        if (
            job is None
            or req is None
            or req.epoch != epoch
            or req.state not in ((ReqState.PAUSED,) if job.prefetch else (ReqState.WAITING_KV, ReqState.RECOVERING))
        ):
            self.num_stale += 1  # a message from another round: it changes nothing
            self._quiet_until = -math.inf
            return Completion(req, stale=True)
        if job.prefetch or not ok:
            self._quiet_until = -math.inf
        if job.prefetch:  # still paused: the copied positions become its cached KV (a failed copy: given back)
            self._release_paused(req, keep_in_cache=ok, priority=PAUSED_PRIORITY)
            return Completion(req)
        if not ok:
            self.reqs.pop(rid)
            self._drop_host(rid)
            self.kv.release(req, keep_in_cache=False)
            req.error, req.finish_reason = error or "prefill failed", "error"
            self._move(req, ReqState.FINISHED)
            return Completion(req, failed=req.error)
        req.running_since = self.clock()
        if req.state is ReqState.WAITING_KV:
            self._move(req, ReqState.RUNNING)
            req.output_ids.append(int(first_token))
            self._quiet_while_running(req)
            return Completion(req, first_token=int(first_token))
        self._move(req, ReqState.RUNNING)  # RECOVERING -> RUNNING
        self._quiet_while_running(req)
        self.num_recoveries[job.source] += 1
        return Completion(req, recovered=True, path=job.source)

    def _quiet_while_running(self, req: InferReq) -> None:
        """An answer that made req run leaves the scheduler quiet: req held its slots (and state page) while it
        waited, so no room appeared, and the next decode-only plan takes it up as it does every running request.
        Two things a full plan might do for it end or shorten the quiet state: ending it at max_len (now, when its
        next token would not fit), and pausing it for a paused request's turn that the last plan declined for
        want of requests that had run a quantum (that turn's retry then comes by req's quantum at the latest). A
        turn not yet due stays so: req running can only put it later."""
        if req.num_tokens + 1 >= self.max_len:
            self._quiet_until = -math.inf
        elif self._turn_retry is not None:
            self._quiet_until = min(self._quiet_until, req.running_since + self.quantum)

    def _inflight_of(self, req: InferReq) -> TransferJob | None:
        """The transfer writing the request's slots now: its prompt's, its recovery's, or (paused) a prefetch."""
        waits = (ReqState.WAITING_KV, ReqState.RECOVERING, ReqState.PAUSED)
        return self.inflight.get((req.rid, req.epoch)) if req.state in waits else None

    def _prefetching(self, req: InferReq) -> bool:
        return req.state is ReqState.PAUSED and (req.rid, req.epoch) in self.inflight

    # ---- planning ----------------------------------------------------------------------------------------
    def schedule(self, decode_only: bool = False) -> Plan:
        """The next plan. decode_only (only while `quiet`, which decode's overlapped steps check): one more decode
        token for every running request and nothing else, so it may run over a step whose tokens are unread."""
        plan = Plan()
        if decode_only:
            self._checkpoint_running()
            self._reserve_decode_slots(plan)
            plan.decode = [r for r in self.by_state(ReqState.RUNNING) if len(r.slots) >= r.num_tokens]
            return plan
        self._quiet_until = -math.inf
        self._turn_retry = self._prefetch_declined = None
        self._building = plan
        try:
            self._end_at_capacity(plan)
            self._checkpoint_running()
            self._reserve_decode_slots(plan)
            self._rotate(plan)
            self._recover_paused(plan)
            self._prefetch(plan)
            if not self.by_state(ReqState.PAUSED):  # paused requests take precedence over new admissions
                self._admit_waiting(plan)
            self._ensure_progress(plan)
        finally:
            self._building = None
        plan.decode = [r for r in self.by_state(ReqState.RUNNING) if len(r.slots) >= r.num_tokens]
        self._quiet_until = self._quiet_after(plan)
        return plan

    def quiet(self) -> bool:
        """Whether the next schedule() would be one more decode token for every running request and nothing
        else: the last one planned nothing beyond that, no input came since, and no turn of rotation (or its
        prefetch) falls due yet. Requests may be paused or waiting meanwhile: none of them fits (room only shrinks
        while the running requests grow, until an input frees some), so until one of those happens their
        schedules would change nothing for them. Transfers and host copies may be in flight: what they write
        belongs to requests that are not running. An answer that makes its request run keeps the quiet state (the
        next decode-only plan takes it up); other answers end it."""
        return self.clock() < self._quiet_until

    def _quiet_after(self, plan: Plan) -> float:
        # A full plan takes every action that is due now, so the next one is decode only until an input or a due
        # time (tests/pd_decode/conftest.py checks this on every full plan of the scheduler tests). Transfers and
        # copies in flight do not end it (their answers do), nor do the plan's own pauses, turns and recoveries.
        # A request failed or restarted at its end frees what the plan's earlier stages could have used.
        if plan.failed or plan.restarted:
            return -math.inf
        paused = self._paused_in_order()
        if self.quantum <= 0 or not paused:
            return math.inf
        # a turn needs the head to have waited turn_wait and a running request to have run a quantum; its
        # prefetch starts half a quantum before the head's wait is over
        head, running = paused[0], self.by_state(ReqState.RUNNING)
        due = head.paused_at + self.turn_wait
        if running:
            due = max(due, min(r.running_since for r in running) + self.quantum)
        key = (head.rid, head.paused_at)
        if self._turn_retry is not None and self._turn_retry[:2] == key:
            due = max(due, self._turn_retry[2])  # a turn this plan declined waits for what can change that
        if (self.prefetch_margin is not None and self.host_pool is not None
                and self._prefetched.get(head.rid) != head.paused_at and self._prefetch_declined != key):  # fmt: skip
            due = min(due, head.paused_at + self.turn_wait - self.quantum / 2)
        return due

    def _ensure_progress(self, plan: Plan) -> None:
        """Liveness, enforced: if after planning nothing runs and nothing is in flight while requests wait, every
        cached slot was evictable and the head still did not fit, so it never will. It ends with an error naming
        why, rather than leaving decode idle with work waiting. (max_len makes this unreachable; it is the guard.)"""
        if not self.stalled() or self.pool.num_free + self.radix.evictable_size < self.pool.num_slots:
            return  # something still holds slots (a leak: check_invariants reports it); failing a request won't help
        head = (self.by_state(ReqState.PAUSED) or self.by_state(ReqState.WAITING))[0]
        need = head.num_tokens + 1 if head.state is ReqState.WAITING else head.num_tokens
        self.finish(head, "error")
        head.error = (
            f"request {head.rid} needs {need} KV slots and can never fit: the pool has {self.pool.num_slots}, "
            "all of them free or evictable, with nothing else running"
        )
        self.num_unfittable += 1
        plan.failed.append(head)

    def _end_at_capacity(self, plan: Plan) -> None:
        """A request that holds max_len tokens can take no more: it ends with "length" (as at the model's context)
        instead of waiting for a slot that cannot exist. Decode's finish check normally ends it one step earlier."""
        for req in list(self.reqs.values()):
            if (
                req.state in (ReqState.RUNNING, ReqState.PAUSED)
                and req.num_tokens >= self.max_len
                and not self._prefetching(req)
            ):
                self.finish(req, "length")
                plan.ended.append(req)

    def _alloc(self, n: int) -> list[int] | None:
        return self.kv.alloc(n)

    def _available(self) -> int:
        return self.pool.num_free + self.radix.evictable_size

    def _reserve_decode_slots(self, plan: Plan) -> None:
        """One slot per running request for its next token; pause victims until that fits. The cache gives up
        what the whole batch lacks in one eviction pass, not one pass per request."""
        running = self.by_state(ReqState.RUNNING)
        short = sum(1 for r in running if len(r.slots) < r.num_tokens) - self.pool.num_free
        if short > 0:
            self.radix.evict(short)
        for req in running:
            if req.state is not ReqState.RUNNING or len(req.slots) >= req.num_tokens:
                continue
            while (slot := self._alloc(1)) is None:
                victim = self._pick_victim()
                self._pause(victim, plan)
                if victim is req:
                    break
            if slot is not None:
                req.slots += slot
        if self.speculative:  # a draft's slot only from free ones: it never pauses or evicts anybody
            for req in running:
                if req.state is ReqState.RUNNING and req.draft is not None and len(req.slots) == req.num_tokens:
                    slot = self.pool.alloc(1)
                    if slot is None:
                        break
                    req.slots += slot

    def _checkpoint_running(self) -> None:
        """Hybrid models: every `checkpoint_every` computed tokens a running request's K/V moves to the cache
        (still locked by it) with a copy of its state at that position, when a state page is free."""
        if self.state is None or self.checkpoint_every <= 0:
            return
        for req in self.reqs.values():
            n = len(req.slots)
            if (
                req.state is ReqState.RUNNING
                and n == req.num_tokens - 1
                and n - req.cached_len >= self.checkpoint_every
            ):
                if self.state.num_free == 0:
                    return
                self.kv.cache_unfinished(req)
                self.num_checkpoints += 1

    def _pick_victim(self) -> InferReq:
        running = self.by_state(ReqState.RUNNING)
        if self.quantum > 0:  # rotating: the one that has run longest since it last resumed gives way
            return min(running, key=lambda r: (r.running_since, -r.arrival))
        if self.pause_policy == "oldest":
            return running[0]
        if self.pause_policy == "longest":
            return max(running, key=lambda r: (r.num_tokens, r.arrival))
        return running[-1]

    def _pause(self, req: InferReq, plan: Plan) -> None:
        self._drop_reserved(req)
        if self.on_oom == "restart":
            self.finish(req, "restart")
            plan.restarted.append(req)
            return
        park = self.park_state and self.keep_paused_kv
        if self.host_pool is not None and self.keep_paused_kv:
            self._swap_out(req, plan, state=not park)
        # KV stays findable as unreferenced radix entries, evicted after finished requests' entries; a parked page
        # stays with the request (no checkpoint at the paused end: its K/V may be evicted, its page waits here)
        if park:
            self._parked.add(req.rid)
            self.parked_pages["parked"] += 1
            self._release_paused(req, keep_in_cache=True, priority=PAUSED_PRIORITY)
        else:
            self.kv.release(req, keep_in_cache=self.keep_paused_kv, priority=PAUSED_PRIORITY)
        self._move(req, ReqState.PAUSED)
        req.paused_at = self.clock()
        req.num_pauses += 1
        self.num_pauses += 1
        plan.paused.append(req)

    def _reserve(self) -> int:
        """Slots kept back, when recovering or admitting, for the next tokens of requests that run or soon will."""
        return self.reserve_per_running * self._running_soon()

    def _running_soon(self) -> int:
        """Requests that run or soon will: running, recovering, or waiting for their prompt's K/V."""
        soon = (ReqState.RUNNING, ReqState.RECOVERING, ReqState.WAITING_KV)
        return sum(1 for r in self.reqs.values() if r.state in soon)

    def _paused_in_order(self) -> list[InferReq]:
        """Paused requests in the order they recover: oldest arrival first, or, when rotating, oldest pause."""
        paused = self.by_state(ReqState.PAUSED)
        if self.quantum > 0:
            paused.sort(key=lambda r: (r.paused_at, r.arrival))
        return paused

    def _recover_paused(self, plan: Plan) -> None:
        """Try every paused request in order. Without rotation one that does not fit does not block later ones;
        with rotation the order is strict (first paused, first resumed), which is what bounds every wait."""
        for req in self._paused_in_order():
            if self._prefetching(req):
                if self.quantum > 0:
                    return
                continue
            need_kv = req.num_tokens - 1  # positions [0, L-1); the last token is the next decode input
            # a match trades evictable entries for positions one to one: only entries that others lock can make
            # room, so when even those could not, skip the walk of a history of thousands of tokens (on an H200 a
            # prefetched head was matched at every step)
            if need_kv + 1 - self.radix.locked_bound(req.all_ids) > self._available() - self._reserve():
                if self.quantum > 0:
                    return
                continue
            if req.rid in self._parked:  # its page waited on the device: only K/V can be missing
                done = self._recover_parked(req, need_kv, plan)
                if done is None:  # does not fit yet
                    if self.quantum > 0:
                        return
                    continue
                if done:
                    continue  # else its page was given up: the paths below, as for any paused request
            # exact: the state comes from the host copy's page, so any cached K/V prefix will do; its live page is
            # taken before the match locks anything (no free page raises, as the checkpointed match's does)
            exact = self._exact_host_copy(req, need_kv)
            page = self.kv.alloc_state() if exact else ZERO
            self.kv.match(req, need_kv, kv_only=exact)
            if exact:
                req.state_page = page
            missing = need_kv - len(req.slots)
            # the missing positions, plus the next token's slot, must fit beside the running requests' reserve
            own = self._alloc(missing) if missing + 1 <= self._available() - self._reserve() else None
            if own is None:
                self.kv.release(req, keep_in_cache=False)
                if self.quantum > 0:
                    return
                continue
            req.slots += own
            self.recovered_tokens["cached"] += need_kv - missing
            if missing == 0 and not exact:
                self._resume_local(req, plan)
                continue
            self._start_recovery(req)
            host = self._host_source(req, need_kv, missing)
            if host is not None:  # (always, when exact)
                job = self._transfer(req, need_kv, sample=False, source="host")
                job.host_slots = host.slots[job.start : need_kv]
                if self.state is not None:  # the whole page comes from the host: no queued copy may run after
                    job.state_page, job.host_page = req.state_page, host.page
                    self.state.written_elsewhere(req.state_page)
                self.swapped_tokens["in"] += len(job.host_slots)
                self.recovered_tokens["host"] += missing
                plan.swap_ins.append(job)
            elif self.state is not None and missing <= self.recompute_max:
                self.recovered_tokens["recompute"] += missing
                plan.recomputes.append(self._transfer(req, need_kv, sample=False, source="recompute"))
            else:
                self.recovered_tokens["prefill"] += missing
                plan.transfers.append(self._transfer(req, need_kv, sample=False))

    def _prefetch(self, plan: Plan) -> None:
        """Rotating with a host tier: half a quantum before the next paused request's turn, if it still does not
        fit, copy its missing positions back, as many as fit in the free and evictable slots beside the reserve
        and `prefetch_margin` per request that runs or soon will, so that at its turn decode waits only for the
        rest. One try per pause (positions evicted again before its turn are not fetched twice), at least
        `prefetch_min` positions; it evicts cached entries as a recovery would (its own prefix is locked first) and
        never pauses anybody. Hybrid models: only from a host copy with the state at the paused position (its turn
        takes the K/V prefix without a checkpoint and that page, `_exact_host_copy`); the K/V alone is fetched."""
        if self.quantum <= 0 or self.host_pool is None or self.prefetch_margin is None:
            return
        paused = self._paused_in_order()
        if not paused or self.clock() - paused[0].paused_at < self.turn_wait - self.quantum / 2:
            return
        head = paused[0]
        if self._prefetched.get(head.rid) == head.paused_at:
            return
        need_kv = head.num_tokens - 1
        copy = self.host.get(head.rid)
        if self.state is not None:
            usable = self._exact_host_copy(head, need_kv)
        else:
            usable = copy is not None and len(copy.slots) >= need_kv
        if not usable:
            self._prefetch_declined = (head.rid, head.paused_at)  # no copy to fetch from until an input
            return
        keep = (self.reserve_per_running + self.prefetch_margin) * self._running_soon()
        # the room before the match is an upper bound (it counts the head's own cached prefix as evictable)
        if self._available() - keep < min(self.prefetch_min, need_kv):
            self._prefetch_declined = (head.rid, head.paused_at)  # room only shrinks as the running ones grow
            return
        # one try per pause, taken or not: a match walks thousands of positions of the tree, too dear for every
        # step (on an H200 it tripled the scheduler's time)
        self._prefetched[head.rid] = head.paused_at
        self.kv.match(head, need_kv, kv_only=self.state is not None)  # (no live page: the K/V alone is fetched)
        room = self._available() - keep
        n = min(need_kv - len(head.slots), room)
        own = self._alloc(n) if n >= min(self.prefetch_min, need_kv - len(head.slots)) and n > 0 else None
        if own is None:
            self._release_paused(head, keep_in_cache=False)
            return
        head.slots += own
        head.epoch += 1
        self.max_epoch = max(self.max_epoch, head.epoch)
        job = self._transfer(head, len(head.slots), sample=False, source="host")
        job.host_slots, job.prefetch = copy.slots[job.start : len(head.slots)], True
        copy.used_at = self.clock()
        self.num_prefetches += 1
        self.swapped_tokens["in"] += n
        self.swapped_tokens["prefetch"] += n
        plan.swap_ins.append(job)

    def _resume(self, req: InferReq) -> None:
        self._move(req, ReqState.RUNNING)
        req.running_since = self.clock()

    def _resume_local(self, req: InferReq, plan: Plan) -> None:
        """A paused request whose every position is in the pool runs again at once, with a slot for its next token
        when one is free (else `_reserve_decode_slots` finds it one or pauses someone)."""
        self._resume(req)
        self.num_recoveries["local"] += 1
        plan.resumed_local.append(req)
        slot = self._alloc(1)
        if slot is not None:
            req.slots += slot

    def _start_recovery(self, req: InferReq) -> None:
        """A new epoch: whatever a transfer of an earlier round still says about the request is stale."""
        req.epoch += 1
        self.max_epoch = max(self.max_epoch, req.epoch)
        self._move(req, ReqState.RECOVERING)

    # ---- state pages kept on the device while paused (`park_state`) -------------------------------------------
    def _release_paused(self, req: InferReq, keep_in_cache: bool, priority: int = 0) -> None:
        """Give back a paused request's K/V (a match, a prefetch) as `KVAccounting.release` does, keeping its
        parked state page, if it has one, with the request rather than handing it to the cache or the pool (a
        page that a match gave it goes as release sends it)."""
        if req.rid not in self._parked:
            self.kv.release(req, keep_in_cache=keep_in_cache, priority=priority)
            return
        page, req.state_page = req.state_page, ZERO
        self.kv.release(req, keep_in_cache=keep_in_cache, priority=priority)
        req.state_page = page

    def _recover_parked(self, req: InferReq, need_kv: int, plan: Plan) -> bool | None:
        """A paused request whose state page waited on the device: its cached K/V prefix, and the rest from its
        host copy (no state to copy either way). True: resumed or swapping in; None: the missing positions do
        not fit beside the running requests' reserve yet (the page stays); False: the page was given up (no host
        copy of the missing positions, or prefill is cheaper), for the paths that rebuild the state."""
        copy = self.host.get(req.rid)
        self.kv.match(req, need_kv, kv_only=True)
        missing = need_kv - len(req.slots)
        host = copy is not None and len(copy.slots) == need_kv
        if missing and not (host and missing * self.costs.host_per_token <= self.costs.prefill(missing)):
            self._parked.discard(req.rid)
            self.kv.release(req, keep_in_cache=False)  # the match back (its slots stay cached), the page freed
            self.host_skips["host_partial" if not host else "prefill_cheaper"] += 1
            return False
        own = self._alloc(missing) if missing + 1 <= self._available() - self._reserve() else None
        if own is None:
            self._release_paused(req, keep_in_cache=False)
            return None
        req.slots += own
        self.recovered_tokens["cached"] += need_kv - missing
        if missing == 0:
            self._resume_local(req, plan)
            return True
        self._start_recovery(req)
        job = self._transfer(req, need_kv, sample=False, source="host")  # the K/V alone: job.host_page stays ZERO
        job.host_slots = copy.slots[job.start : need_kv]
        copy.used_at = self.clock()
        self.swapped_tokens["in"] += len(job.host_slots)
        self.recovered_tokens["host"] += missing
        plan.swap_ins.append(job)
        return True

    def _unpark(self) -> int | None:
        """`KVAccounting.reclaim`: no state page is free, so the parked page of the paused request whose turn is
        furthest off goes to the caller, its state first copied to its host copy's page (a swap-out in the plan
        being made, which runs before anything of that plan writes the page). Without a whole host copy the
        state is dropped, and that request's recovery rebuilds it from a checkpoint. None outside schedule()."""
        plan = self._building
        if plan is None:
            return None
        parked = [r for r in self._paused_in_order() if r.rid in self._parked]
        if not parked:
            return None
        req = parked[-1]
        self._parked.discard(req.rid)
        page, req.state_page = req.state_page, ZERO
        copy = self.host.get(req.rid)
        n = req.num_tokens - 1
        if copy is not None and copy.page != ZERO and len(copy.slots) == n:
            plan.swap_outs.append(SwapOut(req.rid, n, [], [], page, copy.page))
            copy.page_at = n
        self.parked_pages["unparked"] += 1
        return page

    # ---- host tier -----------------------------------------------------------------------------------------
    def _exact_host_copy(self, req: InferReq, need_kv: int) -> bool:
        """Hybrid models: the request's host copy has every position and its page the state at need_kv, and the
        host path is the cheaper for any number of missing positions, so its recovery takes the K/V of its prefix
        from the cache without a state checkpoint (prefetched positions have none) and the state from the copy."""
        copy = self.host.get(req.rid) if self.state is not None else None
        if copy is None or len(copy.slots) != need_kv or copy.page == ZERO:
            return False
        if copy.page_at != need_kv and req.rid not in self._parked:
            return False  # the host page is behind and the state is not on the device either
        c = self.costs
        return c.host(0) <= c.prefill(0) and c.host(need_kv) <= c.prefill(need_kv)  # both lines: in between too

    def _host_source(self, req: InferReq, need_kv: int, missing: int) -> HostCopy | None:
        """The host copy to swap in from, when it has every position (hybrid models: and the state at exactly
        need_kv) and is the cheaper path."""
        copy = self.host.get(req.rid)
        if copy is None:
            return None
        if len(copy.slots) < need_kv or (self.state is not None and (len(copy.slots) != need_kv or
                                                                      copy.page_at != need_kv)):  # fmt: skip
            self.host_skips["host_partial"] += 1
            return None
        if self.costs.host(missing) > self.costs.prefill(missing):
            self.host_skips["prefill_cheaper"] += 1
            return None
        copy.used_at = self.clock()
        return copy

    def _swap_out(self, req: InferReq, plan: Plan, state: bool = True) -> None:
        """Copy the positions the request's host copy lacks (hybrid models: and, with `state`, the live page, the
        state at the paused end; without, the copy still gets a host page, for `_unpark`); host memory full: keep
        none (counted)."""
        n = len(req.slots)  # positions [0, n) hold K/V (the reserved slot was dropped)
        copy = self.host.get(req.rid)
        have = len(copy.slots) if copy is not None else 0
        if have >= n:
            return
        slots = self._host_extend(req, copy, n - have)
        page = ZERO
        if slots is not None and self.host_pages is not None:
            page = copy.page if copy is not None and copy.page != ZERO else self._host_page(keep=req.rid)
            if page is None:
                self.host_pool.free(slots)
                slots = None
        if slots is None:
            self.host_skips["host_full"] += 1
            self._drop_host(req.rid)  # useless without the new positions; give the room to others
            return
        if copy is None:
            want = min(len(req.prompt_ids) + req.params.max_tokens, self.max_len)
            copy = self.host[req.rid] = HostCopy([], self.clock(), end=slots[0] + max(want, len(slots)))
        copy.page = page
        if state and page != ZERO:
            plan.swap_outs.append(SwapOut(req.rid, have, req.slots[have:n], slots, req.state_page, page))
            copy.page_at = n
        else:
            plan.swap_outs.append(SwapOut(req.rid, have, req.slots[have:n], slots))
        copy.slots += slots
        copy.used_at = self.clock()
        self.swapped_tokens["out"] += len(slots)

    def _host_extend(self, req: InferReq, copy: HostCopy | None, k: int) -> list[int] | None:
        """k more host slots for the request's copy, in one run with what it has where possible (a swap is then
        one DMA per run, not one per pause): right after its last slot; for a new copy, past every other copy's
        room to grow, with room for the whole answer (prompt + max_tokens). Else any free slots."""
        pool = self.host_pool
        if copy is not None and copy.slots:
            got = pool.alloc_at(copy.slots[-1] + 1, k)
            if got is not None:
                return got
        elif copy is None:
            want = max(k, min(len(req.prompt_ids) + req.params.max_tokens, self.max_len))
            start = max((c.end for c in self.host.values()), default=0)
            if start + want > pool.num_slots:
                start = pool.find_run(want)
            got = pool.alloc_at(start, k) if start is not None else None
            if got is not None:
                return got
        return self._host_alloc(k, keep=req.rid)

    def _host_alloc(self, n: int, keep: str, pool: KVPool | None = None) -> list[int] | None:
        """n host slots (or host state pages, from `pool`); when short, reclaim copies of requests that are not
        paused and not swapping in (least recently used first): the running ones can be copied out again when
        they pause."""
        pool = pool or self.host_pool
        if n > pool.num_slots:
            return None
        if pool.num_free < n:
            swapping_in = {rid for (rid, _), job in self.inflight.items() if job.source == "host"}
            spare = [
                (c.used_at, rid)
                for rid, c in self.host.items()
                if rid != keep and rid not in swapping_in and self.reqs[rid].state is not ReqState.PAUSED
            ]
            for _, rid in sorted(spare):
                if pool.num_free >= n:
                    break
                self._drop_host(rid)
        return pool.alloc(n)

    def _host_page(self, keep: str) -> int | None:
        got = self._host_alloc(1, keep, self.host_pages)
        return None if got is None else got[0]

    def _drop_host(self, rid: str) -> None:
        """The request ends (or its host copy is reclaimed): its host copy, if any, is freed."""
        if rid not in self.reqs:
            self._prefetched.pop(rid, None)
        copy = self.host.pop(rid, None)
        if copy is not None:
            self.host_pool.free(copy.slots)
            if copy.page != ZERO:
                self.host_pages.free([copy.page])

    def host_accounting(self) -> tuple[int, int]:
        """(free, held by host copies) of the host pool: sums to its size. (0, 0) without a host tier."""
        if self.host_pool is None:
            return 0, 0
        return self.host_pool.num_free, sum(len(c.slots) for c in self.host.values())

    # ---- rotation ------------------------------------------------------------------------------------------
    def _rotate(self, plan: Plan) -> None:
        """Give the longest-paused request its turn: once it has waited `turn_wait` and does not fit, pause
        requests that have run a quantum since they resumed until it does. Which ones (`rotation_victims`):
        "smallest", the fewest positions first (the one that alone makes room if there is one, else the smallest
        until they do), so the requests furthest along keep running and finish and what comes back at the next
        turn is the least K/V; "longest-running", the longest since it resumed first (every stream advances at the
        same pace). Nobody is paused when the eligible ones would not free enough: that would cost a turn and bring
        nothing."""
        if self.quantum <= 0:
            return
        paused = self._paused_in_order()
        now = self.clock()
        if not paused or now - paused[0].paused_at < self.turn_wait:
            return
        head = paused[0]
        if self._prefetching(head):  # its slots are being written: its turn comes once the copy has answered
            self._turn_retry = (head.rid, head.paused_at, math.inf)
            return
        need_kv = head.num_tokens - 1
        self.kv.match(head, need_kv, kv_only=head.rid in self._parked or self._exact_host_copy(head, need_kv))
        deficit = need_kv - len(head.slots) + 1 - (self._available() - self._reserve())
        self._release_paused(head, keep_in_cache=False)
        if deficit <= 0:  # it fits: _recover_paused resumes it in this plan
            return
        running = [r for r in self.reqs.values() if r.state is ReqState.RUNNING]
        eligible = [r for r in running if now - r.running_since >= self.quantum]
        smallest = self.rotation_victims == "smallest"
        if smallest:
            eligible.sort(key=lambda r: (len(r.slots), -r.arrival))
        else:
            eligible.sort(key=lambda r: (r.running_since, r.arrival))
        # its own slots, and the cached ones only it locks (a hybrid request's checkpoints move its K/V into the
        # cache as it runs): all evictable once it is paused
        gains = [len(r.slots) - r.cached_len + self.radix.locked_only_by(r.last_node) + self.reserve_per_running
                 for r in eligible]  # fmt: skip
        one = next((i for i, g in enumerate(gains) if g >= deficit), None) if smallest else None
        if one is not None:
            victims = [eligible[one]]
        else:
            victims, gain = [], 0
            for r, g in zip(eligible, gains):
                if gain >= deficit:
                    break
                victims.append(r)
                gain += g
            if gain < deficit:  # until one more running request has run its quantum
                later = [r.running_since + self.quantum for r in running if now - r.running_since < self.quantum]
                self._turn_retry = (head.rid, head.paused_at, min(later, default=math.inf))
                return
        for r in victims:
            self._pause(r, plan)
            plan.rotated.append(r)
            self.num_rotations += 1

    def _admit_waiting(self, plan: Plan) -> None:
        active = len(self.reqs) - self.count(ReqState.WAITING)
        for req in self.by_state(ReqState.WAITING):
            if active >= self.max_running:
                return
            self.kv.match(req, req.num_tokens - 1)  # prefill computes at least the last prompt token
            missing = req.num_tokens - len(req.slots)
            if missing + 1 > self._available() - self._reserve():
                self.kv.release(req, keep_in_cache=False)
                return  # FIFO for new admissions
            own = self._alloc(missing)
            if own is None:
                self.kv.release(req, keep_in_cache=False)
                return
            req.slots += own
            self._move(req, ReqState.WAITING_KV)
            plan.transfers.append(self._transfer(req, req.num_tokens, sample=True))
            active += 1

    def _transfer(self, req: InferReq, end: int, sample: bool, source: str = "prefill") -> TransferJob:
        start = req.cached_len
        job = TransferJob(req.rid, req.epoch, req.all_ids[:end], start, req.slots[start:end], sample, source)
        if self.state is not None and source == "prefill":  # prefill writes the state at `end`: no copy into it
            job.state_page = req.state_page
            self.state.written_elsewhere(req.state_page)
        self.inflight[(req.rid, req.epoch)] = job
        return job

    # ---- invariants ----------------------------------------------------------------------------------------
    def stalled(self) -> bool:
        """True when requests wait but nothing can make them progress: nothing runs, no transfer is in flight.
        Right after schedule() this must be False (the liveness invariant)."""
        if not self.reqs or self.inflight:
            return False
        return not any(r.state is ReqState.RUNNING for r in self.reqs.values())

    def check_invariants(self, liveness: bool = True) -> list[str]:
        """Violations of the pool accounting, slot ownership and liveness invariants, as messages (empty: none).
        Liveness holds right after schedule() (between a request ending and the next schedule() it need not).
        Cheap enough to run after every step in tests and whenever decode is idle in production."""
        out = []
        free, used, cached = self.accounting()
        if free + used + cached != self.pool.num_slots:
            out.append(f"accounting: free {free} + used {used} + cached {cached} != {self.pool.num_slots}")
        holders = list(self.reqs.values()) + list(self.orphans.values())
        held = [s for r in holders for s in r.slots[r.cached_len :]]
        if len(held) != len(set(held)):
            out.append("ownership: a slot is held by two requests")
        if any(self.pool.is_free(s) for s in held):
            out.append("ownership: a request holds a free slot")
        for r in self.reqs.values():
            holds = r.slots or r.last_node is not None
            if r.state in (ReqState.WAITING, ReqState.PAUSED) and holds and not self._prefetching(r):
                out.append(f"{r.rid}: {r.state.value} but holds KV")
            top = r.num_tokens + (1 if self.speculative else 0)
            if r.state is ReqState.RUNNING and not r.num_tokens - 1 <= len(r.slots) <= top:
                out.append(f"{r.rid}: running with {len(r.slots)} slots for {r.num_tokens} tokens")
            if r.num_tokens > self.max_len:
                out.append(f"{r.rid}: {r.num_tokens} tokens, more than max_len {self.max_len}")
        if self.radix.protected_size and not any(r.last_node is not None for r in holders):
            out.append(f"radix: {self.radix.protected_size} slots locked with no request holding a prefix")
        if self.state is not None:
            sfree, live, ckpts = self.state_accounting()
            if sfree + live + ckpts != self.state.num_pages:
                out.append(f"state accounting: free {sfree} + live {live} + cached {ckpts} != {self.state.num_pages}")
            for rid in self._parked:
                r = self.reqs.get(rid)
                if r is None or r.state is not ReqState.PAUSED or r.state_page == ZERO:
                    out.append(f"{rid}: parked, but {'ended' if r is None else r.state.value} or without a page")
            for r in self.reqs.values():
                holds = r.state_page != ZERO
                if r.state is ReqState.PAUSED and holds == (r.rid in self._parked):
                    continue  # a paused request holds a page exactly while it is parked
                if holds != (r.state in (ReqState.RUNNING, ReqState.WAITING_KV, ReqState.RECOVERING)):
                    out.append(f"{r.rid}: {r.state.value} {'with' if holds else 'without'} a state page")
        if self.host_pool is not None:
            hfree, hheld = self.host_accounting()
            if hfree + hheld != self.host_pool.num_slots:
                out.append(f"host accounting: free {hfree} + held {hheld} != {self.host_pool.num_slots}")
            hslots = [s for c in self.host.values() for s in c.slots]
            if len(hslots) != len(set(hslots)) or any(self.host_pool.is_free(s) for s in hslots):
                out.append("host ownership: a host slot is held twice or while free")
            if self.host_pages is not None:
                pages = [c.page for c in self.host.values()]
                if ZERO in pages or len(pages) != len(set(pages)) or any(self.host_pages.is_free(p) for p in pages):
                    out.append("host state pages: a copy without its own page, or a page held twice or while free")
                if self.host_pages.num_free + len(pages) != self.host_pages.num_slots:
                    out.append(f"host state accounting: free {self.host_pages.num_free} + held {len(pages)} != "
                               f"{self.host_pages.num_slots}")  # fmt: skip
            for rid, c in self.host.items():
                if rid not in self.reqs:
                    out.append(f"host: a copy of {rid}, which has ended")
                elif len(c.slots) >= self.reqs[rid].num_tokens:
                    out.append(f"host: the copy of {rid} has more positions than the request has KV")
        if liveness and self.stalled():
            counts = {s.value: n for s, n in self.counts().items()}
            out.append(f"liveness: nothing runs and nothing is in flight, but requests wait ({counts})")
        return out

    # ---- after a decode step -----------------------------------------------------------------------------
    def after_decode(self, req: InferReq, token: int) -> None:
        """The decode step computed K/V for the reserved slot and sampled `token`."""
        req.output_ids.append(int(token))
