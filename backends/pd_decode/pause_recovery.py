"""Decode's pause and recovery: victims paused when the pool runs out, and paused requests brought back by the
cheapest path (a local prefix-cache hit, a host swap-in, decode's own recompute or a prefill recompute under a new
epoch); a hybrid request's state page parked on the device while it waits."""

from __future__ import annotations

from backends.common.core.request import InferReq, ReqState
from backends.common.core.state_pages import ZERO

from .plan import PAUSED_PRIORITY, Plan, SwapOut


class PauseRecovery:
    """The pause and recovery stages of `DecodeScheduler`, whose state they use."""

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
            if need_kv + 1 - self.radix.locked_bound(req.cache_ids) > self._available() - self._reserve():
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
            elif self.state is not None and missing <= self.recompute_max and self._can_recompute(req):
                self.recovered_tokens["recompute"] += missing
                plan.recomputes.append(self._transfer(req, need_kv, sample=False, source="recompute"))
            else:
                self.recovered_tokens["prefill"] += missing
                plan.transfers.append(self._transfer(req, need_kv, sample=False))

    @staticmethod
    def _can_recompute(req: InferReq) -> bool:
        """Decode computes positions itself only past a request's images: it has no vision tower."""
        return req.mm is None or req.cached_len >= req.mm.prompt_len

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
