"""State pages of a hybrid model's linear-attention layers: which page is free, and the page copies the device
still has to make. Pure Python over integers, like the KV pool.

A request that runs owns one live page, holding the state at its computed length. The radix cache owns
checkpoint pages, each the state at the end of one radix node; a prefix hit copies a checkpoint into the hitting
request's new live page. Copies are queued here (`copy`) and run in queue order by whoever next touches the state
on the device (`take_ops`), before anything else writes a page: a page freed while a queued copy still reads it
can be handed out again at once, because every write to it is queued or computed after that copy."""

from __future__ import annotations

from backends.common.core.kv_pool import KVPool

ZERO = -1  # the source of a copy that zeroes its page: the state before position 0


class StatePages:
    def __init__(self, num_pages: int):
        self.pool = KVPool(num_pages)
        self.num_pages = num_pages
        self._ops: dict[int, int] = {}  # dst -> src, in the order they must run

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def alloc(self) -> int | None:
        got = self.pool.alloc(1)
        return None if got is None else got[0]

    def free(self, page: int) -> None:
        self._ops.pop(page, None)  # a copy into a page nobody holds is moot
        self.pool.free([page])

    def copy(self, dst: int, src: int) -> None:
        """Queue dst <- src (src ZERO: zero dst)."""
        self._ops.pop(dst, None)
        self._ops[dst] = src

    def written_elsewhere(self, page: int) -> None:
        """A transfer writes the whole of `page` (prefill's hand-off): a queued copy into it must not run after."""
        self._ops.pop(page, None)

    def take_ops(self) -> list[tuple[int, int]]:
        ops, self._ops = list(self._ops.items()), {}
        return ops

    def has_ops(self) -> bool:
        return bool(self._ops)
