"""KV pool and radix cache: exact results and exact accounting under random operation sequences."""

from __future__ import annotations

import random

import pytest

from backends.common.core import kv_pool
from backends.common.core.kv_pool import KVPool, KVPoolError
from backends.common.core.radix_cache import RadixCache


def test_pool_alloc_free_exact():
    pool = KVPool(8)
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.num_free == 5
    assert pool.alloc(6) is None and pool.num_free == 5  # all or nothing
    pool.free(a)
    assert pool.num_free == 8
    with pytest.raises(KVPoolError):
        pool.free([1])


def test_pool_alloc_at_takes_a_run_and_alloc_never_hands_it_out_again():
    pool = KVPool(16)
    assert pool.alloc_at(4, 3) == [4, 5, 6] and pool.num_free == 13
    assert pool.alloc_at(6, 2) is None and pool.num_free == 13  # slot 6 is taken: all or nothing
    assert pool.alloc_at(15, 2) is None  # past the end
    assert pool.find_run(9) == 7 and pool.find_run(10) is None  # [7, 16) is the only run of 9
    got = pool.alloc(13)
    assert sorted(got) == [s for s in range(16) if s not in (4, 5, 6)] and pool.alloc(1) is None
    pool.free([5])
    assert pool.alloc_at(5, 1) == [5]  # freed, then taken in place
    pool.free([5, 4])
    assert sorted(pool.alloc(2)) == [4, 5] and pool.num_free == 0  # stale stack entries are skipped
    rng = random.Random(1)  # random mixes keep the count exact and never hand a slot to two holders
    pool, held = KVPool(64), set()
    for _ in range(3000):
        op = rng.random()
        if op < 0.35:
            got = pool.alloc(rng.randint(1, 5)) or []
        elif op < 0.7:
            got = pool.alloc_at(rng.randrange(64), rng.randint(1, 6)) or []
        else:
            got = []
            if held:
                out = rng.sample(sorted(held), rng.randint(1, len(held)))
                pool.free(out)
                held -= set(out)
        assert not held & set(got)
        held |= set(got)
        assert pool.num_free == 64 - len(held) and all(pool.is_free(s) != (s in held) for s in range(64))


def test_bulk_alloc_and_free_give_exactly_what_the_per_slot_path_gives(monkeypatch):
    """Allocations of many slots take the stack's top as one slice (kv_pool.BULK): the same slots in the same order
    as the per-slot path, over random mixes with alloc_at's stale stack entries; a slot freed twice (within one
    call or across calls) or out of range raises with nothing freed."""

    def run(bulk: int) -> list:
        monkeypatch.setattr(kv_pool, "BULK", bulk)
        rng, pool, held, log = random.Random(7), KVPool(600), [], []
        for _ in range(400):
            op = rng.random()
            if op < 0.4:
                got = pool.alloc(rng.choice([1, 3, 40, 150])) or []
            elif op < 0.55:
                got = pool.alloc_at(rng.randrange(600), rng.randint(1, 60)) or []
            else:
                got = []
                if held:
                    out = rng.sample(held, min(len(held), rng.choice([2, 50, 200])))
                    pool.free(out)
                    held = [h for h in held if h not in set(out)]
            held += got
            log.append((list(got), pool.num_free))
            assert pool.num_free == 600 - len(held) == sum(pool.is_free(s) for s in range(600))
        return log

    assert run(32) == run(10**9)
    monkeypatch.setattr(kv_pool, "BULK", 32)
    pool = KVPool(100)
    got = pool.alloc(60)
    assert got == list(range(60))
    with pytest.raises(KVPoolError, match="slot 5 freed twice"):
        pool.free(got[:40] + [5])  # twice in one call
    assert pool.num_free == 40  # nothing freed
    pool.free(got[:40])
    with pytest.raises(KVPoolError, match="slot 10 freed twice"):
        pool.free(got[40:] + list(range(10, 30)))  # already free
    assert pool.num_free == 80
    with pytest.raises(IndexError):
        pool.free(list(range(40, 60)) + [100])
    assert pool.num_free == 80 and not any(pool.is_free(s) for s in range(40, 60))
    pool.free(got[40:])
    assert pool.num_free == 100 and all(pool.is_free(s) for s in range(100))


def test_match_insert_split_and_lock():
    pool = KVPool(32)
    rc = RadixCache(pool)
    s1 = pool.alloc(5)
    assert rc.insert([1, 2, 3, 4, 5], s1) == 0
    slots, node = rc.match_prefix([1, 2, 3, 9])
    assert slots == s1[:3]  # split at 3
    rc.lock(node)
    assert rc.protected_size == 3 and rc.evictable_size == 2
    s2 = pool.alloc(4)
    # [1, 2, 3] already present: the caller keeps s2[:3] as duplicates
    assert rc.insert([1, 2, 3, 7], s2) == 3
    pool.free(s2[:3])
    assert rc.cached_size == 6
    # only the unlocked leaves [4, 5] and [7] can go, LRU first ([4, 5] was touched before [7]);
    # a leaf longer than needed loses only its tail
    assert rc.evict(1) == 1
    assert rc.match_prefix([1, 2, 3, 4, 5])[0] == s1[:4]
    assert rc.evict(100) == 2
    assert rc.cached_size == 3
    rc.unlock(node)
    assert rc.evict(100) == 3 and pool.num_free == 32


def _check(pool, rc, held):
    used = sum(len(s) for s in held.values())
    assert pool.num_free + used + rc.cached_size == pool.num_slots
    assert 0 <= rc.protected_size <= rc.cached_size
    # the evictable-leaf set that evict() uses instead of walking the tree is exactly the unlocked leaves
    assert rc.evictable_leaves == {n for n in rc._nodes() if not n.children and n.lock_ref == 0}


def test_locked_only_by_counts_the_path_one_lock_alone_protects():
    pool = KVPool(64)
    r = RadixCache(pool)
    r.insert([1, 2, 3, 4], pool.alloc(4))
    r.insert([1, 2, 3, 4, 5, 6], [*r.match_prefix([1, 2, 3, 4])[0], *pool.alloc(2)])
    r.insert([1, 2, 9], [*r.match_prefix([1, 2])[0], *pool.alloc(1)])  # splits [1, 2] | [3, 4] | [5, 6]; [9]
    _, a = r.match_prefix([1, 2, 3, 4, 5, 6])
    _, b = r.match_prefix([1, 2, 9])
    r.lock(a)
    assert r.locked_only_by(a) == 6  # the whole path: nobody else locks any of it
    r.lock(b)
    assert r.locked_only_by(a) == 4 and r.locked_only_by(b) == 1  # [1, 2] is shared now
    assert r.locked_only_by(None) == 0 and r.locked_only_by(r.root) == 0
    r.unlock(b)
    assert r.locked_only_by(a) == 6


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_keep_accounting_exact(seed):
    """Model requests: match (lock), extend with own slots, then release into the tree; evict at random."""
    rng = random.Random(seed)
    pool = KVPool(256)
    rc = RadixCache(pool)
    reference: dict[tuple, int] = {}  # token prefix -> slot, for every cached position
    held: dict[int, list[int]] = {}  # request -> own slots
    live = {}
    for step in range(300):
        op = rng.random()
        if op < 0.45 and len(live) < 6:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 24))]
            slots, node = rc.match_prefix(tokens)
            # matched slots are exactly those recorded for each prefix
            assert slots == [reference[tuple(tokens[: i + 1])] for i in range(len(slots))]
            assert len(slots) == len(tokens) or tuple(tokens[: len(slots) + 1]) not in reference
            rc.lock(node)
            own = pool.alloc(len(tokens) - len(slots))
            if own is None:
                rc.evict(len(tokens) - len(slots) - pool.num_free)
                own = pool.alloc(len(tokens) - len(slots))
            if own is None:
                rc.unlock(node)
                continue
            live[step] = (tokens, slots + own, len(slots), node)
            held[step] = own
        elif op < 0.85 and live:
            rid = rng.choice(list(live))
            tokens, slots, cached, node = live.pop(rid)
            del held[rid]
            present = rc.insert(tokens, slots)
            assert present >= cached
            pool.free(slots[cached:present])
            for i in range(len(tokens)):
                reference.setdefault(tuple(tokens[: i + 1]), slots[i])
            rc.unlock(node)
        else:
            rc.evict(rng.randrange(1, 40))
        # forget evicted prefixes (evictions also happen on the alloc path above)
        for key in list(reference):
            if len(rc.match_prefix(list(key))[0]) < len(key):
                del reference[key]
        _check(pool, rc, held)
    for _tokens, slots, cached, node in live.values():
        pool.free(slots[cached:])
        rc.unlock(node)
    rc.clear()
    assert pool.num_free == pool.num_slots and rc.cached_size == 0 and rc.protected_size == 0


def _evict_by_full_scan(rc, num_slots: int) -> int:
    """The eviction order by definition: lowest priority, then least recently used, re-read from every evictable
    leaf for each one taken (what evict() did before it kept its heap across calls)."""
    freed = 0
    while freed < num_slots and rc.evictable_leaves:
        node = min(rc.evictable_leaves, key=lambda n: (n.priority, n.last_access, id(n)))
        need = num_slots - freed
        if len(node.value) > need:
            rc.pool.free(node.value[-need:])
            del node.value[-need:], node.key[-need:]
            rc.cached_size -= need
            return freed + need
        rc.pool.free(node.value)
        freed += len(node.value)
        rc.cached_size -= len(node.value)
        parent = node.parent
        del parent.children[node.key[0]]
        rc.evictable_leaves.discard(node)
        if parent is not rc.root and not parent.children and parent.lock_ref == 0:
            rc.evictable_leaves.add(parent)
    return freed


def _contents(rc):
    """(token path, slots) of every node, and the free slots: the cache's whole state."""
    out = []
    for n in rc._nodes():
        path, cur = [], n
        while cur is not rc.root:
            path = cur.key + path
            cur = cur.parent
        out.append((tuple(path), tuple(n.value)))
    return sorted(out), sorted(s for s in range(rc.pool.num_slots) if rc.pool.is_free(s))


@pytest.mark.parametrize("seed", range(12))
def test_kept_heap_evicts_exactly_in_the_full_scan_order(seed):
    """Inserts with and without priorities, matches that touch, locks and partial evictions: every evict() of the
    kept heap leaves the same cache, slot for slot, as the full scan applied to a copy taken just before."""
    import copy

    rng = random.Random(seed)
    pool = KVPool(400)
    rc = RadixCache(pool)
    locked = []
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
            slots, node = rc.match_prefix(tokens)
            own = pool.alloc(len(tokens) - len(slots))
            if own is None:
                continue
            present = rc.insert(tokens, slots + own, priority=rng.choice([None, None, 0, 1, 2]))
            pool.free((slots + own)[len(slots) : present])
        elif op < 0.65:
            _, node = rc.match_prefix([rng.randrange(3) for _ in range(rng.randrange(1, 12))])
            if rng.random() < 0.5 and node is not rc.root:
                rc.lock(node)
                locked.append(node)
        elif op < 0.75 and locked:
            rc.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            n = rng.randrange(1, 60)
            twin = copy.deepcopy(rc)
            assert rc.evict(n) == _evict_by_full_scan(twin, n)
            assert _contents(rc) == _contents(twin)
        assert rc.evictable_leaves == {n for n in rc._nodes() if not n.children and n.lock_ref == 0}
        assert len(rc._heap) <= 2 * len(rc.evictable_leaves) + 64  # stale entries are dropped


def test_eviction_on_a_full_cache_does_not_scan_every_leaf():
    """Thousands of cached sequences and one allocation at a time (prefill's pattern once its cache is full): each
    evict(n) touches a few heap entries, not every leaf (counted by the comparisons the heap makes)."""
    pool = KVPool(60_000)
    rc = RadixCache(pool)
    for i in range(3_000):  # distinct 20-token sequences under a shared 4-token prefix
        tokens = [1, 2, 3, 4, 100 + i // 50, 1000 + i] + list(range(14))
        slots, _ = rc.match_prefix(tokens)
        own = pool.alloc(len(tokens) - len(slots))
        pool.free(own[: rc.insert(tokens, slots + own) - len(slots)])
    leaves = len(rc.evictable_leaves)
    assert leaves >= 3_000

    class Counted(tuple):
        comparisons = 0

        def __lt__(self, other):
            Counted.comparisons += 1
            return tuple.__lt__(self, other)

    import heapq

    rc._heap = [Counted(e) for e in rc._heap]
    heapq.heapify(rc._heap)
    # every entry pushed from here on is counted too
    rc._push = lambda n: heapq.heappush(rc._heap, Counted((n.priority, n.last_access, id(n), next(rc._seq), n)))
    Counted.comparisons = 0
    for _ in range(200):
        assert rc.evict(18) == 18
    # ordering the leaves afresh on each call (what evict() did) takes at least one comparison per leaf per call:
    # 200 x 3,000; the kept heap needs O(log n) per entry pushed or popped
    assert Counted.comparisons < 200 * leaves / 20, Counted.comparisons


def test_match_of_any_sequence_type_and_the_locked_bound():
    """A match compares whole edges as slices: a tuple of tokens matches as its list does, an edge that diverges
    part-way is split where it does, and `locked_bound` is 0 unless the match would start on a locked edge."""
    pool = KVPool(64)
    radix = RadixCache(pool)
    a = list(range(10, 30))
    assert radix.insert(a, pool.alloc(20)) == 0
    slots, node = radix.match_prefix(tuple(a[:12] + [99]))
    assert slots == radix.match_prefix(a[:12] + [99])[0] and len(slots) == 12 and node.key == a[:12]
    assert len(radix.match_prefix(a + [5])[0]) == 20 and radix.match_prefix([7, 8])[0] == []
    assert radix.locked_bound(a) == 0 and radix.locked_bound([]) == 0
    b = [50, 51, 52]
    radix.insert(b, pool.alloc(3))
    _, nb = radix.match_prefix(b)
    radix.lock(nb)
    assert radix.locked_bound(a) == 0 and radix.locked_bound(b + [1]) == radix.protected_size == 3
    radix.unlock(nb)
    assert radix.locked_bound(b) == 0
