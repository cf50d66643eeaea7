"""Token-granular KV slot allocator (page size 1). Pure Python over integers: it never touches a device."""

from __future__ import annotations


class KVPoolError(RuntimeError):
    pass


class KVPool:
    """Hands out slot indices in [0, num_slots). Invariant: every slot is either free here or owned by exactly
    one holder (a request or the radix cache), so `num_free + used_by_requests + held_by_cache == num_slots`."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"KV pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._is_free = bytearray(b"\x01") * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        if n <= 0:
            return []
        out = self._free[-n:][::-1]
        del self._free[-n:]
        for s in out:
            self._is_free[s] = 0
        return out

    def free(self, slots) -> None:
        for s in slots:
            if self._is_free[s]:
                raise KVPoolError(f"slot {s} freed twice")
            self._is_free[s] = 1
            self._free.append(s)

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])
