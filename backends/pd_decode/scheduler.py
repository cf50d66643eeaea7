"""Decode's scheduler: request states, KV slot ownership, pause and recovery. Plain Python over integers, no
device and no Triton, so every transition is unit-testable in milliseconds.

    WAITING ─admit─► WAITING_KV ─(prompt KV written, epoch ok)─► RUNNING ─► FINISHED
                                                                  │  ▲
                                         (no slot for next token)  ▼  │ (local radix hit, or prefill wrote the
                                                                 PAUSED ─► RECOVERING   missing KV, epoch ok)

A request's KV: slots[i] holds position i for i in [0, len(slots)). A transfer for (rid, epoch) writes positions
[start, end) into slots[start:end]; those slots are not reused until that transfer answers (invariant 5).

Liveness: a request never holds more than `max_len` tokens (the pool's size, or less), so whenever nothing runs
and no transfer is in flight, every cached slot is evictable and the head of the queue fits. `add` refuses a
prompt that could never fit, a request that reaches `max_len` ends with "length", and `check_invariants` reports
an idle scheduler with work waiting (it must never happen).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backends.common.kv_pool import KVPool
from backends.common.radix_cache import RadixCache
from backends.common.request import InferReq, ParamError, ReqState
from backends.common.scheduler import KVAccounting

PAUSED_PRIORITY = 1  # radix eviction priority of a paused request's KV (finished requests' KV has 0)


@dataclass(slots=True)
class TransferJob:
    """Ask prefill to compute K/V for ids[start:end] (end = len(ids)) and write them into dst_slots."""

    rid: str
    epoch: int
    ids: list[int]
    start: int
    dst_slots: list[int]
    sample: bool  # epoch 0: also sample the first output token; recovery: discard the sample

    @property
    def num_positions(self) -> int:
        return len(self.ids) - self.start


@dataclass(slots=True)
class Plan:
    decode: list[InferReq] = field(default_factory=list)  # run one decode step; slots[-1] is reserved for it
    transfers: list[TransferJob] = field(default_factory=list)
    paused: list[InferReq] = field(default_factory=list)
    restarted: list[InferReq] = field(default_factory=list)  # on_oom="restart": segments ended
    resumed_local: list[InferReq] = field(default_factory=list)
    ended: list[InferReq] = field(default_factory=list)  # finished by the scheduler ("length": pool capacity)
    failed: list[InferReq] = field(default_factory=list)  # finished with req.error: it can never fit


@dataclass(slots=True)
class Completion:
    """What the caller must do after a transfer answered."""

    req: InferReq | None
    first_token: int | None = None  # epoch-0 transfer: the sampled first token (already appended)
    failed: str | None = None
    stale: bool = False
    recovered: bool = False


class DecodeScheduler:
    def __init__(
        self,
        pool: KVPool,
        max_running: int = 256,
        pause_policy: str = "latest",
        on_oom: str = "pause",
        reserve_per_running: int = 1,
        max_len: int | None = None,
    ):
        if pause_policy not in ("latest", "oldest", "longest"):
            raise ValueError(f"pause_policy must be latest, oldest or longest, got {pause_policy!r}")
        if on_oom not in ("pause", "restart"):
            raise ValueError(f"on_oom must be pause or restart, got {on_oom!r}")
        self.pool = pool
        self.radix = RadixCache(pool)
        self.kv = KVAccounting(pool, self.radix)
        self.max_running, self.pause_policy, self.on_oom = max_running, pause_policy, on_oom
        self.reserve_per_running = reserve_per_running
        # tokens one request may hold (prompt + output): never more than the pool, so that any request fits once
        # nothing else holds KV; the caller lowers it to the model's context
        self.max_len = min(pool.num_slots, max_len) if max_len else pool.num_slots
        self.keep_paused_kv = True  # False: a paused request's KV goes straight back to the pool (tests)
        self.reqs: dict[str, InferReq] = {}  # every request not yet FINISHED, by rid
        self.inflight: dict[tuple[str, int], TransferJob] = {}
        self.orphans: dict[tuple[str, int], InferReq] = {}  # cancelled while a transfer was in flight
        self._arrivals = 0
        self.num_pauses = 0
        self.num_recoveries = {"local": 0, "prefill": 0}
        self.num_stale = 0
        self.max_epoch = 0
        self.num_unfittable = 0  # requests ended by the liveness guard

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
        req.arrival = self._arrivals
        self._arrivals += 1
        req.state = ReqState.WAITING
        self.reqs[req.rid] = req

    def cancel(self, rid: str, reason: str = "cancelled") -> InferReq | None:
        """End a request now. Slots an in-flight transfer may still write stay reserved until it answers."""
        req = self.reqs.pop(rid, None)
        if req is None:
            return None
        job = self._inflight_of(req)
        if job is not None:
            self.orphans[(req.rid, req.epoch)] = req
        else:
            self._drop_reserved(req)
            self.kv.release(req, keep_in_cache=req.state is ReqState.RUNNING)
        req.finish_reason, req.state = reason, ReqState.FINISHED
        return req

    def _drop_reserved(self, req: InferReq) -> None:
        """A slot reserved for the next token holds no K/V yet: give it back before caching the rest."""
        if req.slots and len(req.slots) == req.num_tokens and len(req.slots) > req.cached_len:
            self.pool.free([req.slots.pop()])

    def finish(self, req: InferReq, reason: str) -> None:
        self._drop_reserved(req)
        self.reqs.pop(req.rid, None)
        req.finish_reason, req.state = reason, ReqState.FINISHED
        self.kv.release(req, keep_in_cache=True)

    def on_transfer_done(
        self, rid: str, epoch: int, ok: bool, first_token: int | None = None, error: str | None = None
    ) -> Completion:
        job = self.inflight.pop((rid, epoch), None)
        orphan = self.orphans.pop((rid, epoch), None)
        if orphan is not None:  # cancelled meanwhile: the transfer has answered, so its slots are safe to reuse
            self.kv.release(orphan, keep_in_cache=False)
            return Completion(None, stale=False)
        req = self.reqs.get(rid)
        if (
            job is None
            or req is None
            or req.epoch != epoch
            or req.state not in (ReqState.WAITING_KV, ReqState.RECOVERING)
        ):
            self.num_stale += 1  # a message from another round: it changes nothing
            return Completion(req, stale=True)
        if not ok:
            self.reqs.pop(rid)
            self.kv.release(req, keep_in_cache=False)
            req.state, req.error, req.finish_reason = ReqState.FINISHED, error or "prefill failed", "error"
            return Completion(req, failed=req.error)
        if req.state is ReqState.WAITING_KV:
            req.state = ReqState.RUNNING
            req.output_ids.append(int(first_token))
            return Completion(req, first_token=int(first_token))
        req.state = ReqState.RUNNING  # RECOVERING -> RUNNING
        self.num_recoveries["prefill"] += 1
        return Completion(req, recovered=True)

    def _inflight_of(self, req: InferReq) -> TransferJob | None:
        return (
            self.inflight.get((req.rid, req.epoch)) if req.state in (ReqState.WAITING_KV, ReqState.RECOVERING) else None
        )

    # ---- planning ----------------------------------------------------------------------------------------
    def schedule(self) -> Plan:
        plan = Plan()
        self._end_at_capacity(plan)
        self._reserve_decode_slots(plan)
        self._recover_paused(plan)
        if not self.by_state(ReqState.PAUSED):  # paused requests take precedence over new admissions
            self._admit_waiting(plan)
        self._ensure_progress(plan)
        plan.decode = [r for r in self.by_state(ReqState.RUNNING) if len(r.slots) == r.num_tokens]
        return plan

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
            if req.state in (ReqState.RUNNING, ReqState.PAUSED) and req.num_tokens >= self.max_len:
                self.finish(req, "length")
                plan.ended.append(req)

    def _alloc(self, n: int) -> list[int] | None:
        return self.kv.alloc(n)

    def _available(self) -> int:
        return self.pool.num_free + self.radix.evictable_size

    def _reserve_decode_slots(self, plan: Plan) -> None:
        """One slot per running request for its next token; pause victims until that fits."""
        for req in self.by_state(ReqState.RUNNING):
            if req.state is not ReqState.RUNNING or len(req.slots) == req.num_tokens:
                continue
            while (slot := self._alloc(1)) is None:
                victim = self._pick_victim()
                self._pause(victim, plan)
                if victim is req:
                    break
            if slot is not None:
                req.slots += slot

    def _pick_victim(self) -> InferReq:
        running = self.by_state(ReqState.RUNNING)
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
        # KV stays findable as unreferenced radix entries, evicted after finished requests' entries
        self.kv.release(req, keep_in_cache=self.keep_paused_kv, priority=PAUSED_PRIORITY)
        req.state = ReqState.PAUSED
        req.num_pauses += 1
        self.num_pauses += 1
        plan.paused.append(req)

    def _reserve(self) -> int:
        """Slots kept back, when recovering or admitting, for the next tokens of requests that run or soon will."""
        soon = (ReqState.RUNNING, ReqState.RECOVERING, ReqState.WAITING_KV)
        return self.reserve_per_running * sum(1 for r in self.reqs.values() if r.state in soon)

    def _recover_paused(self, plan: Plan) -> None:
        """Try every paused request, oldest first; one that does not fit does not block later ones."""
        for req in self.by_state(ReqState.PAUSED):
            need_kv = req.num_tokens - 1  # positions [0, L-1); the last token is the next decode input
            self.kv.match(req, need_kv)
            missing = need_kv - len(req.slots)
            # the missing positions, plus the next token's slot, must fit beside the running requests' reserve
            if missing + 1 > self._available() - self._reserve():
                self.kv.release(req, keep_in_cache=False)
                continue
            own = self._alloc(missing)
            if own is None:
                self.kv.release(req, keep_in_cache=False)
                continue
            req.slots += own
            if missing == 0:
                req.state = ReqState.RUNNING
                self.num_recoveries["local"] += 1
                plan.resumed_local.append(req)
                slot = self._alloc(1)
                if slot is not None:
                    req.slots += slot
                continue
            req.epoch += 1
            self.max_epoch = max(self.max_epoch, req.epoch)
            req.state = ReqState.RECOVERING
            plan.transfers.append(self._transfer(req, need_kv, sample=False))

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
            req.state = ReqState.WAITING_KV
            plan.transfers.append(self._transfer(req, req.num_tokens, sample=True))
            active += 1

    def _transfer(self, req: InferReq, end: int, sample: bool) -> TransferJob:
        start = req.cached_len
        job = TransferJob(req.rid, req.epoch, req.all_ids[:end], start, req.slots[start:end], sample)
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
            if r.state in (ReqState.WAITING, ReqState.PAUSED) and (r.slots or r.last_node is not None):
                out.append(f"{r.rid}: {r.state.value} but holds KV")
            if r.state is ReqState.RUNNING and not r.num_tokens - 1 <= len(r.slots) <= r.num_tokens:
                out.append(f"{r.rid}: running with {len(r.slots)} slots for {r.num_tokens} tokens")
            if r.num_tokens > self.max_len:
                out.append(f"{r.rid}: {r.num_tokens} tokens, more than max_len {self.max_len}")
        if self.radix.protected_size and not any(r.last_node is not None for r in holders):
            out.append(f"radix: {self.radix.protected_size} slots locked with no request holding a prefix")
        if liveness and self.stalled():
            counts = {s.value: n for s, n in self.counts().items()}
            out.append(f"liveness: nothing runs and nothing is in flight, but requests wait ({counts})")
        return out

    # ---- after a decode step -----------------------------------------------------------------------------
    def after_decode(self, req: InferReq, token: int) -> None:
        """The decode step computed K/V for the reserved slot and sampled `token`."""
        req.output_ids.append(int(token))
