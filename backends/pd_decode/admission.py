"""Decode's admission: new requests queued, admitted first come first served when their prompt's K/V fits beside
what running requests keep in reserve, and one slot reserved per running request before each step."""

from __future__ import annotations

import math

from backends.common.core.request import InferReq, ParamError, ReqState

from .invariants import IllegalTransition
from .plan import Plan, TransferJob


class Admission:
    """The admission stages of `DecodeScheduler`, whose state they use."""

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

    def _reserve(self) -> int:
        """Slots kept back, when recovering or admitting, for the next tokens of requests that run or soon will."""
        return self.reserve_per_running * self._running_soon()

    def _running_soon(self) -> int:
        """Requests that run or soon will: running, recovering, or waiting for their prompt's K/V."""
        soon = (ReqState.RUNNING, ReqState.RECOVERING, ReqState.WAITING_KV)
        return sum(1 for r in self.reqs.values() if r.state in soon)

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

    def _alloc(self, n: int) -> list[int] | None:
        return self.kv.alloc(n)

    def _available(self) -> int:
        return self.pool.num_free + self.radix.evictable_size

    def _transfer(self, req: InferReq, end: int, sample: bool, source: str = "prefill") -> TransferJob:
        start = req.cached_len
        job = TransferJob(req.rid, req.epoch, req.all_ids[:end], start, req.slots[start:end], sample, source)
        if self.state is not None and source == "prefill":  # prefill writes the state at `end`: no copy into it
            job.state_page = req.state_page
            self.state.written_elsewhere(req.state_page)
        self.inflight[(req.rid, req.epoch)] = job
        return job

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
