"""Decode's host-copy policy: which positions of a paused request go to host memory, where in the host pool, which
copies are reclaimed when it runs short, and when a copy is the source a recovery takes."""

from __future__ import annotations

from backends.common.core.kv_pool import KVPool
from backends.common.core.request import InferReq, ReqState
from backends.common.core.state_pages import ZERO

from .plan import HostCopy, Plan, SwapOut


class HostCopies:
    """The host-copy stages of `DecodeScheduler`, whose state they use."""

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
