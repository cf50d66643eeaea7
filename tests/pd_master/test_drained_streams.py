"""DrainedStreams: pd_master's hold on finished BLS response iterators (see its docstring for the Triton bug)."""

from __future__ import annotations

import threading
import weakref

from backends.pd_master.model import DrainedStreams


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Iterator:
    """Stands in for a pb_utils ResponseIterator: all that matters is when the last reference goes."""


def test_holds_each_iterator_for_the_hold_time_then_lets_go():
    clock = Clock()
    held = DrainedStreams(hold_seconds=10.0, clock=clock)
    freed: list[str] = []
    refs = []
    for name in ("a", "b", "c"):
        it = Iterator()
        refs.append(weakref.ref(it, lambda _, name=name: freed.append(name)))
        held.keep(it)
        del it
        clock.now += 1.0
    assert freed == [] and len(held) == 3  # Python's reference outlives the stream's end
    clock.now = 110.5  # "a" (kept at 100) is due, "b" (101) and "c" (102) are not
    held.reap()
    assert freed == ["a"] and len(held) == 2
    clock.now = 112.0
    held.keep(Iterator())  # keep() also lets go of what is due
    assert sorted(freed) == ["a", "b", "c"] and len(held) == 1
    assert [r() for r in refs] == [None, None, None]


def test_release_happens_in_the_reaping_thread_outside_the_lock():
    clock = Clock()
    held = DrainedStreams(hold_seconds=1.0, clock=clock)
    seen: list[tuple[int, bool]] = []

    def on_free(_):
        got = held.lock.acquire(blocking=False)  # a release under the lock could deadlock on the stub's side
        if got:
            held.lock.release()
        seen.append((threading.get_ident(), got))

    it = Iterator()
    ref = weakref.ref(it, on_free)
    held.keep(it)
    del it
    clock.now += 2.0
    reaper = threading.Thread(target=held.reap)
    reaper.start()
    reaper.join()
    assert ref() is None
    assert seen == [(reaper.ident, True)]
