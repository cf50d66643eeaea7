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
the least K/V back), and paused requests recover strictly in the order they paused. With k requests paused, turns
come about every max(quantum, turn_wait / k) and a paused stream waits about turn_wait while the pool is
over-committed: few streams taking turns pay for few turns. While at most `turns_per_wait` are paused, up to that
many turns come in any `turn_wait` seconds; with more paused, a sustained overload, one turn per `turn_wait`: each
paused stream then waits about k * turn_wait and runs longer once resumed, so that the K/V swapped back in at each
turn is paid for by more tokens instead of thrashing (perf/scenario.py overload-sim and perf/soak.py policies:
throughput against plain and restart, swap-ins per output token).
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

from backends.common.core.kv_pool import KVPool
from backends.common.core.radix_cache import RadixCache
from backends.common.core.request import InferReq, ReqState
from backends.common.core.scheduler import KVAccounting, state_accounting
from backends.common.core.state_pages import StatePages

from .admission import Admission
from .host_copy import HostCopies
from .invariants import TRANSITIONS, IllegalTransition, Invariants
from .pause_recovery import PauseRecovery
from .plan import PAUSED_PRIORITY, Completion, HostCopy, Plan, RecoveryCosts, SwapOut, TransferJob
from .rotation import Rotation

__all__ = [
    "PAUSED_PRIORITY", "TRANSITIONS", "Completion", "DecodeScheduler", "HostCopy", "IllegalTransition", "Plan",
    "RecoveryCosts", "SwapOut", "TransferJob",
]  # fmt: skip


class DecodeScheduler(Admission, PauseRecovery, Rotation, HostCopies, Invariants):
    """Decode's scheduler: its state (requests, pools, cache, host copies, counters), the inputs that change it
    (add, cancel, finish, a transfer's answer) and `schedule`, which plans the next iteration from the stages of
    its parts: admission (admission.py), pause and recovery (pause_recovery.py), rotation (rotation.py), the host
    copies (host_copy.py); invariants.py checks the whole."""

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
        turns_per_wait: int = 4,
    ):
        """prefetch_margin: with rotation and a host tier, the next paused request's positions are copied back
        ahead of its turn into free slots, leaving this many free per running request for their growth until
        then (None: no prefetch); prefetch_min: a smaller prefetch (unless it is all that is missing) is not worth
        a copy's overhead. turn_wait: with rotation, how long the longest-paused request waits before it takes
        running requests' place (never less than `quantum`); rotation_victims: which running requests give way
        (see `_rotate`); turns_per_wait: with rotation and at most this many requests paused, at most this many
        turns in any `turn_wait` seconds; with more paused, one (0: no bound); so that with k requests paused each
        waits about turn_wait while k <= turns_per_wait, and k * turn_wait beyond."""
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
        if turns_per_wait < 0:
            raise ValueError(f"turns_per_wait must be >= 0, got {turns_per_wait}")
        self.turns_per_wait = turns_per_wait
        self._last_turn = -math.inf  # when the last turn paused requests for a paused one
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

    def _inflight_of(self, req: InferReq) -> TransferJob | None:
        """The transfer writing the request's slots now: its prompt's, its recovery's, or (paused) a prefetch."""
        waits = (ReqState.WAITING_KV, ReqState.RECOVERING, ReqState.PAUSED)
        return self.inflight.get((req.rid, req.epoch)) if req.state in waits else None

    def _prefetching(self, req: InferReq) -> bool:
        return req.state is ReqState.PAUSED and (req.rid, req.epoch) in self.inflight

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

    def after_decode(self, req: InferReq, token: int) -> None:
        """The decode step computed K/V for the reserved slot and sampled `token`."""
        req.output_ids.append(int(token))
