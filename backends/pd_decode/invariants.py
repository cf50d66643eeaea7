"""Decode's request states and invariants: the table of every state change a request may make (`TRANSITIONS`),
and the checks of pool accounting, slot ownership, host copies, state pages and liveness that tests run after every
step and decode runs whenever it is idle (`pd_decode_invariant_violations_total`)."""

from __future__ import annotations

from backends.common.core.request import ReqState
from backends.common.core.state_pages import ZERO

from .plan import Plan

_S = ReqState
# Every state change a request may make on decode (the diagram in scheduler.py); `DecodeScheduler._move` refuses
# the rest.
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


class Invariants:
    """The invariant checks of `DecodeScheduler` (its state lives there)."""

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
