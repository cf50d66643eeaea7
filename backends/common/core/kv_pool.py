"""Token-granular KV slot allocator (page size 1). Pure Python over integers: it never touches a device. A call of
many slots (a paused stream's thousands of positions released, a recovery's allocated) takes them off the stack as
one slice and marks the free map in one tight loop: the general per-slot loop was most of a rotation turn's
scheduling time (perf/scenario.py rotation-sim)."""

from __future__ import annotations

BULK = 32  # from this many slots per call, alloc takes the stack's top as one slice when it can


class KVPoolError(RuntimeError):
    pass


class KVPool:
    """Hands out slot indices in [0, num_slots). Invariant: every slot is either free here or owned by exactly
    one holder (a request or the radix cache), so `num_free + used_by_requests + held_by_cache == num_slots`."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"KV pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # free slots as a stack (pop() hands out low slots first); `alloc_at` takes slots out of the middle by
        # marking them, and the stack drops such entries when it reaches them
        self._free = list(range(num_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_slots
        self._num_free = num_slots

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None (and nothing taken) when fewer than n are free."""
        if n > self._num_free:
            return None
        if n <= 0:
            return []
        if n >= BULK and len(self._free) == self._num_free:  # the stack holds every free slot once and nothing else
            out = self._free[-n:]
            del self._free[-n:]
            out.reverse()  # the order pop() gives
            is_free = self._is_free
            for s in out:
                is_free[s] = 0
            self._num_free -= n
            return out
        out = []
        while len(out) < n:
            s = self._free.pop()
            if self._is_free[s]:  # else taken by alloc_at (or a duplicate entry of a slot freed again)
                self._is_free[s] = 0
                out.append(s)
        self._num_free -= n
        return out

    def alloc_at(self, start: int, n: int) -> list[int] | None:
        """Slots [start, start + n) when every one of them is free, else None (and nothing taken): lets a holder
        that grows keep its slots in one run (the host tier: one copy per run)."""
        if n <= 0:
            return []
        if start < 0 or start + n > self.num_slots or self._is_free.find(b"\x00", start, start + n) != -1:
            return None
        self._is_free[start : start + n] = b"\x00" * n
        self._num_free -= n
        if len(self._free) > 4 * self.num_slots:  # duplicate entries piled up: rebuild the stack
            self._free = [s for s in range(self.num_slots - 1, -1, -1) if self._is_free[s]]
        return list(range(start, start + n))

    def find_run(self, n: int) -> int | None:
        """The first slot of the lowest run of n free slots, or None."""
        if n <= 0 or n > self._num_free:
            return None
        i = self._is_free.find(b"\x01" * n)
        return None if i < 0 else i

    def free(self, slots) -> None:
        """Give slots back. A slot already free, given twice in one call or out of range raises, with nothing freed."""
        is_free = self._is_free
        try:
            for i, s in enumerate(slots):  # noqa: B007 (i is read by the except clause)
                if is_free[s]:
                    raise KVPoolError(f"slot {s} freed twice")
                is_free[s] = 1
        except (KVPoolError, IndexError):
            for t in slots[:i]:  # undo this call's marks
                is_free[t] = 0
            raise
        self._free.extend(slots)
        self._num_free += len(slots)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])
