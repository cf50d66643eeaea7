"""Token-granular KV slot allocator (page size 1), over integers on the host: it never touches a device. A call of
many slots (a paused stream's thousands of positions released, a recovery's allocated) marks the free map through
numpy, at a fraction of a per-slot Python loop's cost: that loop was most of a rotation turn's scheduling time
(perf/rotation_sim.py). A few slots (one decode token per request) take the plain path, cheaper there."""

from __future__ import annotations

import numpy as np

BULK = 32  # from this many slots per call, alloc and free go through numpy


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
        self._mask = np.frombuffer(self._is_free, dtype=np.uint8)  # the same bytes, for the bulk paths
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
            self._mask[np.array(out, dtype=np.int64)] = 0
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
        """Give slots back; a slot already free (or given twice) raises, with nothing freed by the bulk path."""
        if len(slots) >= BULK:
            arr = np.array(slots, dtype=np.int64)
            if arr.min() < 0 or arr.max() >= self.num_slots:
                raise IndexError(f"slot out of range [0, {self.num_slots})")
            twice = np.flatnonzero(self._mask[arr])
            if twice.size:
                raise KVPoolError(f"slot {int(arr[twice[0]])} freed twice")
            ordered = np.sort(arr)
            same = np.flatnonzero(ordered[1:] == ordered[:-1])
            if same.size:
                raise KVPoolError(f"slot {int(ordered[same[0]])} freed twice")
            self._mask[arr] = 1
            self._free.extend(slots)
            self._num_free += len(slots)
            return
        for s in slots:
            if self._is_free[s]:
                raise KVPoolError(f"slot {s} freed twice")
            self._is_free[s] = 1
            self._free.append(s)
            self._num_free += 1

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])
