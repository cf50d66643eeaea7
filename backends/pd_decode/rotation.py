"""Decode's rotation: paused and running requests take turns while the pool is over-committed, the next turn's K/V
prefetched from host memory, and the quiet state in which a plan is one more token for every running request."""

from __future__ import annotations

import math

from backends.common.core.request import InferReq, ReqState

from .plan import Plan


class Rotation:
    """The rotation stages of `DecodeScheduler`, whose state they use."""

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
        next_turn = self._next_turn_at(len(paused))
        if now < next_turn:  # the turns' bound: each paused stream waits longer, no turn comes sooner
            self._turn_retry = (head.rid, head.paused_at, next_turn)
            return
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
        self._last_turn = now

    def _next_turn_at(self, paused: int) -> float:
        """The earliest time of the next turn under the turns' bound, with `paused` requests paused: while they
        are at most `turns_per_wait`, up to that many turns in any `turn_wait` seconds (each paused stream waits
        about turn_wait: a few streams taking turns are not slowed); with more paused, a sustained overload, one
        turn per `turn_wait`, so that the K/V a turn swaps back in is paid for by a longer run instead of
        thrashing (perf/scenario.py overload-sim, perf/soak.py policies)."""
        if self.turns_per_wait <= 0:
            return -math.inf
        per_wait = self.turns_per_wait if paused <= self.turns_per_wait else 1
        return self._last_turn + self.turn_wait / per_wait

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
        due = max(head.paused_at + self.turn_wait, self._next_turn_at(len(paused)))
        if running:
            due = max(due, min(r.running_since for r in running) + self.quantum)
        key = (head.rid, head.paused_at)
        if self._turn_retry is not None and self._turn_retry[:2] == key:
            due = max(due, self._turn_retry[2])  # a turn this plan declined waits for what can change that
        if (self.prefetch_margin is not None and self.host_pool is not None
                and self._prefetched.get(head.rid) != head.paused_at and self._prefetch_declined != key):  # fmt: skip
            due = min(due, head.paused_at + self.turn_wait - self.quantum / 2)
        return due

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
