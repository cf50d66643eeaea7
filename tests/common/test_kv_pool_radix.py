"""KV pool and radix cache: exact results and exact accounting under random operation sequences."""

from __future__ import annotations

import random

import pytest

from backends.common.kv_pool import KVPool, KVPoolError
from backends.common.radix_cache import RadixCache


def test_pool_alloc_free_exact():
    pool = KVPool(8)
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.num_free == 5
    assert pool.alloc(6) is None and pool.num_free == 5  # all or nothing
    pool.free(a)
    assert pool.num_free == 8
    with pytest.raises(KVPoolError):
        pool.free([1])


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
