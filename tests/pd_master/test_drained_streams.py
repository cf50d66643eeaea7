"""DrainedStreams: pd_master's hold on finished BLS response iterators (see its docstring for the Triton bug).

A fake stub stands in for Triton 2.51's: one thread serves, in order, the cleanups that drop the stub's own
reference to an iterator (its map erase, done without the GIL in the real stub) and the is_cancelled() queries,
each of which its caller waits for. What must never happen is that the stub's drop is an iterator's last reference:
then the iterator dies in the stub's thread, which in the real stub frees numpy arrays without the GIL."""

from __future__ import annotations

import queue
import random
import threading
import time
import weakref

from backends.pd_master.model import DrainedStreams


class Iterator:
    """Stands in for a pb_utils ResponseIterator: all that matters is which thread drops its last reference."""


class FakeStub:
    def __init__(self, seed: int = 0):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.map: dict[int, Iterator] = {}
        self.rng = random.Random(seed)
        self.thread = threading.Thread(target=self._serve, name="stub-to-parent", daemon=True)
        self.thread.start()

    def open(self) -> Iterator:
        it = Iterator()
        self.map[id(it)] = it  # the stub's own reference
        return it

    def last_response_read(self, it: Iterator) -> None:
        """What ResponseIterator.Clear() does: queue the erase of the stub's reference."""
        self.q.put(("cleanup", id(it)))

    def is_cancelled(self) -> bool:
        done = threading.Event()
        self.q.put(("query", done))
        done.wait()
        return False

    def _serve(self) -> None:
        while True:
            kind, arg = self.q.get()
            time.sleep(self.rng.random() * 0.002)  # the parent's answer takes a while, as under load
            if kind == "cleanup":
                self.map.pop(arg)  # the last reference, unless Python still holds one
            elif kind == "query":
                arg.set()
            else:
                return

    def close(self) -> None:
        self.q.put(("stop", None))
        self.thread.join()


def run_streams(stub: FakeStub, release, n_relays: int = 8, streams_each: int = 40) -> dict[str, int]:
    """Relays that each open streams, read them to the end and hand the iterator to `release`, plus a watchdog
    that polls is_cancelled() as master's does; returns how many iterators died in which thread."""
    died: dict[str, int] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def on_death(_):
        with lock:
            name = threading.current_thread().name
            died[name] = died.get(name, 0) + 1

    refs = []

    def relay(i: int) -> None:
        rng = random.Random(i)
        for _ in range(streams_each):
            it = stub.open()
            refs.append(weakref.ref(it, on_death))
            time.sleep(rng.random() * 0.001)
            stub.last_response_read(it)
            release(it)
            del it

    def watchdog() -> None:
        while not stop.wait(0.003):
            release(None)

    threads = [threading.Thread(target=relay, args=(i,), name=f"relay-{i}") for i in range(n_relays)]
    poller = threading.Thread(target=watchdog, name="watchdog")
    poller.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.2)  # the stub works through its queue; the watchdog's barriers clear what is held
    stop.set()
    poller.join()
    died["alive"] = sum(r() is not None for r in refs)
    return died


def test_no_iterator_dies_in_the_stubs_thread_and_none_is_kept():
    for seed in range(3):
        stub = FakeStub(seed)
        held = DrainedStreams()

        def release(it, held=held, stub=stub):
            # a relay queries once its stream has ended, then drops the iterator (the caller's `del it`); the
            # watchdog (it is None) queries on behalf of a live request
            held.barrier(stub.is_cancelled)
            held.reap()

        died = run_streams(stub, release)
        stub.close()
        assert died.get("stub-to-parent", 0) == 0, died
        assert died["alive"] == 0 and len(held) == 0, died


def test_kept_iterators_wait_for_a_later_barrier():
    """A relay that cannot query (its client already had its final response) keeps the iterator; a barrier that
    started before the keep does not release it, the next one does, and the release is the caller's."""
    stub = FakeStub()
    held = DrainedStreams()
    gate = threading.Event()

    def slow_query():  # a barrier already under way when the stream ends
        gate.wait()
        return stub.is_cancelled()

    early = threading.Thread(target=held.barrier, args=(slow_query,))
    early.start()
    time.sleep(0.01)
    it = stub.open()
    ref = weakref.ref(it)
    stub.last_response_read(it)
    held.keep(it)
    del it
    gate.set()
    early.join()
    held.reap()
    assert ref() is not None and len(held) == 1  # started before the keep: proves nothing about this erase
    held.barrier(stub.is_cancelled)
    freed_in = []
    obj = held.items[0][1]
    weakref.finalize(obj, lambda: freed_in.append(threading.current_thread().name))
    del obj
    held.reap()
    assert ref() is None and len(held) == 0 and freed_in == [threading.current_thread().name]
    stub.close()


def test_the_naive_release_does_die_in_the_stubs_thread():
    """The control: dropping each iterator as soon as its stream ends (what master did before) lets the stub's
    erase be the last reference, so this test setup does detect the bug."""
    stub = FakeStub()
    died = run_streams(stub, lambda it: None)
    stub.close()
    assert died.get("stub-to-parent", 0) > 0, died
