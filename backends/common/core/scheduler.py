"""Offline continuous-batching scheduler: every request's computed-token count catches up with its total, so
chunked prefill, prefix hits and recompute after preemption are one rule. Plain Python over integers."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from backends.common.core.kv_pool import KVPool
from backends.common.core.radix_cache import RadixCache
from backends.common.core.request import InferReq, ReqState
from backends.common.core.state_pages import ZERO, StatePages


@dataclass(slots=True)
class ScheduledSpan:
    req: InferReq
    start: int  # first position computed this step
    num_new: int

    @property
    def samples(self) -> bool:
        """True when this span reaches the end of the request's tokens, so its logits give the next token."""
        return self.start + self.num_new == self.req.num_tokens


class StateError(RuntimeError):
    pass


class KVAccounting:
    """Slot ownership for requests that hold KV in one pool: `release`, `cache_unfinished`, `alloc`. For hybrid
    models (the radix cache has state pages) also the state: a request that holds a prefix holds a live state page
    (`req.state_page`) with the state at the end of its computed positions, which goes to the cache with its K/V."""

    def __init__(self, pool: KVPool, radix: RadixCache):
        self.pool, self.radix = pool, radix
        self.state: StatePages | None = radix.state
        # a page taken back from whoever may give one up when neither a free page nor a checkpoint is left (decode:
        # a paused request's page kept on the device, `DecodeScheduler._unpark`); None: nobody can
        self.reclaim: Callable[[], int | None] | None = None

    def alloc_state(self) -> int:
        """A free state page, dropping least recently used checkpoints when none is free, then `reclaim`."""
        page = self.state.alloc()
        if page is None and self.radix.evict_state(1):
            page = self.state.alloc()
        if page is None and self.reclaim is not None:
            page = self.reclaim()
        if page is None:
            raise StateError(
                f"all {self.state.num_pages} state pages are held by running requests (raise --state-pages)"
            )
        return page

    def alloc(self, n: int) -> list[int] | None:
        slots = self.pool.alloc(n)
        if slots is None:
            self.radix.evict(n - self.pool.num_free)
            slots = self.pool.alloc(n)
        return slots

    def match(self, req: InferReq, limit: int, kv_only: bool = False) -> None:
        """Adopt the longest cached prefix of the request's tokens (at most `limit`); with state, the longest that
        ends at a checkpoint, whose state is queued to be copied into the request's new live page. kv_only: the
        K/V alone and no live page (the caller brings the state from elsewhere: a host copy's page)."""
        live = self.state is not None and not kv_only
        page = self.alloc_state() if live else ZERO  # first: it may drop a checkpoint
        slots, node = self.radix.match_prefix(req.cache_ids[:limit], kv_only=kv_only)
        self.radix.lock(node)
        req.slots, req.cached_len, req.last_node = slots, len(slots), node
        if live:
            self.state.copy(page, self.radix.checkpoint_of(node))
            req.state_page = page

    def release(self, req: InferReq, keep_in_cache: bool = True, priority: int = 0) -> None:
        """Give back the request's KV: into the radix cache as unreferenced entries (evicted lowest priority
        first, then least recently used), or straight to the pool."""
        own = req.slots[req.cached_len :]
        page, req.state_page = req.state_page, ZERO
        if keep_in_cache and req.slots:
            present = self.radix.insert(req.cache_ids[: len(req.slots)], req.slots, priority, state_page=page)
            self.pool.free(req.slots[req.cached_len : present])  # duplicates of slots the tree already had
        else:
            self.pool.free(own)
            if page != ZERO:
                self.state.free(page)
        if req.last_node is not None:
            self.radix.unlock(req.last_node)
        req.slots, req.cached_len, req.last_node = [], 0, None

    def cache_unfinished(self, req: InferReq) -> None:
        """Move the request's computed KV into the tree (still locked) so concurrent requests can share it. With
        state, a copy of the live page becomes the checkpoint at this chunk boundary when a page is free."""
        n = len(req.slots)
        ckpt = ZERO
        if self.state is not None and (ckpt := self.state.alloc()) is not None:
            self.state.copy(ckpt, req.state_page)
        present = self.radix.insert(req.cache_ids[:n], req.slots, state_page=ZERO if ckpt is None else ckpt)
        self.pool.free(req.slots[req.cached_len : present])
        slots, node = self.radix.match_prefix(req.cache_ids[:n], kv_only=True)
        self.radix.lock(node)
        if req.last_node is not None:
            self.radix.unlock(req.last_node)
        req.slots, req.cached_len, req.last_node = slots, n, node

    def used_by_requests(self, reqs) -> int:
        return sum(len(r.slots) - r.cached_len for r in reqs)


class Scheduler:
    def __init__(
        self,
        pool: KVPool,
        max_batch: int = 64,
        chunk_size: int = 512,
        max_batch_tokens: int = 2048,
        state: StatePages | None = None,
    ):
        self.pool = pool
        self.radix = RadixCache(pool, state)
        self.kv = KVAccounting(pool, self.radix)
        self.max_batch, self.chunk_size, self.max_batch_tokens = max_batch, chunk_size, max_batch_tokens
        self.waiting: deque[InferReq] = deque()
        self.running: list[InferReq] = []  # in admission order
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served by the radix cache at admission

    def add(self, req: InferReq) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSpan]:
        plan: list[ScheduledSpan] = []
        budget = self.max_batch_tokens
        for req in list(self.running):
            if req.state is not ReqState.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - len(req.slots), self.chunk_size, budget)
            if n <= 0:
                continue
            if not self._grow(req, n, plan):
                continue
            plan.append(ScheduledSpan(req, len(req.slots) - n, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            req = self.waiting[0]
            self.kv.match(req, req.num_tokens - 1)  # keep one token to compute: it yields the next logits
            self.num_cached_tokens += len(req.slots)
            n = min(req.num_tokens - len(req.slots), self.chunk_size, budget)
            slots = self.kv.alloc(n)
            if slots is None:
                self.kv.release(req)
                break
            self.waiting.popleft()
            req.slots += slots
            req.state = ReqState.RUNNING
            self.running.append(req)
            plan.append(ScheduledSpan(req, len(req.slots) - n, n))
            budget -= n
        return plan

    def _grow(self, req: InferReq, n: int, plan: list[ScheduledSpan]) -> bool:
        """Allocate n slots for req, preempting the latest-admitted unplanned requests if needed."""
        planned = None
        while (slots := self.kv.alloc(n)) is None:
            if planned is None:
                planned = {id(s.req) for s in plan}
            victims = [r for r in self.running if id(r) not in planned]
            victim = victims[-1]  # req itself is unplanned, so there is always one
            self.preempt(victim)
            if victim is req:
                return False
        req.slots += slots
        return True

    def preempt(self, req: InferReq) -> None:
        self.kv.release(req, keep_in_cache=True)
        self.running.remove(req)
        req.state = ReqState.WAITING
        req.num_pauses += 1
        self.num_preemptions += 1
        # back to the front, oldest first, so the preempted request resumes before new admissions
        self.waiting.appendleft(req)

    def after_forward(self, plan: list[ScheduledSpan]) -> None:
        for span in plan:
            req = span.req
            if not span.samples and req.state is ReqState.RUNNING:
                self.kv.cache_unfinished(req)

    def finish(self, req: InferReq, reason: str) -> None:
        req.finish_reason = reason
        req.state = ReqState.FINISHED
        self.kv.release(req, keep_in_cache=True)
        self.running.remove(req)

    def accounting(self) -> tuple[int, int, int]:
        """(free, used by requests, held by cache); their sum is the pool size."""
        return self.pool.num_free, self.kv.used_by_requests(self.running), self.radix.cached_size

    def state_accounting(self) -> tuple[int, int, int]:
        """(free, live pages of requests, checkpoints in the cache) of the state pages; (0, 0, 0) without."""
        return state_accounting(self.radix, self.running)


def state_accounting(radix: RadixCache, holders) -> tuple[int, int, int]:
    if radix.state is None:
        return 0, 0, 0
    return radix.state.num_free, sum(1 for r in holders if r.state_page != ZERO), len(radix.checkpoints)
