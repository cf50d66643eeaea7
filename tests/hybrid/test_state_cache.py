"""State pages and radix checkpoints, pure Python: a prefix is usable only up to a position whose state the cache
holds, and every page is free, live or a checkpoint, never two of them."""

from __future__ import annotations

import random

import pytest

from backends.common.core.kv_pool import KVPool
from backends.common.core.radix_cache import RadixCache
from backends.common.core.request import InferReq, SamplingParams
from backends.common.core.scheduler import KVAccounting, StateError, state_accounting
from backends.common.core.state_pages import ZERO, StatePages


def make(slots=1000, pages=8):
    pool, pages = KVPool(slots), StatePages(pages)
    return pool, pages, RadixCache(pool, pages)


def test_kv_hit_without_a_state_checkpoint_is_refused():
    pool, pages, radix = make()
    toks = list(range(100))
    a = pages.alloc()
    radix.insert(toks[:64], pool.alloc(64), state_page=a)
    present = radix.insert(toks, radix.match_prefix(toks[:64], kv_only=True)[0] + pool.alloc(36))
    assert present == 64
    # the K/V of all 100 positions is cached, but the state only at 64
    assert len(radix.match_prefix(toks, kv_only=True)[0]) == 100
    slots, node = radix.match_prefix(toks)
    assert len(slots) == 64 and radix.checkpoint_of(node) == a
    # a sequence that leaves the cached path at 80 still stops at 64; one that leaves it at 30 gets nothing
    assert len(radix.match_prefix(toks[:80] + [999])[0]) == 64
    slots, node = radix.match_prefix(toks[:30] + [999])
    assert slots == [] and node is radix.root and radix.checkpoint_of(node) == ZERO


def test_checkpoint_survives_splits_and_goes_with_a_trimmed_tail():
    pool, pages, radix = make()
    toks = list(range(50))
    b = pages.alloc()
    radix.insert(toks, pool.alloc(50), state_page=b)
    radix.insert(toks[:20] + [777] * 5, radix.match_prefix(toks[:20], kv_only=True)[0] + pool.alloc(5))  # split at 20
    slots, node = radix.match_prefix(toks)
    assert len(slots) == 50 and node.state == b
    assert len(radix.match_prefix(toks[:49])[0]) == 0  # nothing checkpointed at or before 49 but the root
    # evicting one slot trims the 50-token leaf's tail: its end moves, so its checkpoint is freed
    radix.evict(1 + 5)
    assert len(radix.match_prefix(toks, kv_only=True)[0]) < 50
    assert radix.match_prefix(toks)[0] == [] and pages.num_free == 8 and not radix.checkpoints


def test_insert_where_a_checkpoint_exists_frees_the_new_page():
    pool, pages, radix = make()
    toks = list(range(10))
    radix.insert(toks, pool.alloc(10), state_page=pages.alloc())
    dup = pages.alloc()
    pages.copy(dup, 0)
    radix.insert(toks, radix.match_prefix(toks, kv_only=True)[0], state_page=dup)
    assert pages.num_free == 7 and not pages.has_ops()  # the copy into the freed page was dropped too


def test_evict_state_drops_least_recently_used_checkpoints_and_keeps_kv():
    pool, pages, radix = make()
    seqs = [[i * 100 + t for t in range(10)] for i in range(3)]
    for s in seqs:
        radix.insert(s, pool.alloc(10), state_page=pages.alloc())
    radix.match_prefix(seqs[0])  # the most recently used
    assert radix.evict_state(2) == 2
    assert len(radix.match_prefix(seqs[0])[0]) == 10
    assert [len(radix.match_prefix(s)[0]) for s in seqs[1:]] == [0, 0]
    assert [len(radix.match_prefix(s, kv_only=True)[0]) for s in seqs[1:]] == [10, 10]


def test_accounting_live_page_follows_the_request_into_the_cache():
    pool, pages, radix = make(pages=3)
    kv = KVAccounting(pool, radix)
    req = InferReq("r", list(range(40)), SamplingParams())
    kv.match(req, 39)
    assert req.state_page != ZERO and pages.take_ops() == [(req.state_page, ZERO)]
    req.slots += kv.alloc(39)
    page = req.state_page
    kv.release(req)  # its state after 39 positions becomes the checkpoint at 39
    assert state_accounting(radix, [req]) == (2, 0, 1)
    again = InferReq("r2", list(range(45)), SamplingParams())
    kv.match(again, 44)
    assert again.cached_len == 39 and pages.take_ops() == [(again.state_page, page)]
    kv.release(again, keep_in_cache=False)
    assert state_accounting(radix, [again]) == (2, 0, 1)


def test_pages_all_live_is_a_clear_error():
    pool, pages, radix = make(pages=2)
    kv = KVAccounting(pool, radix)
    reqs = [InferReq(f"r{i}", [i, i + 1], SamplingParams()) for i in range(3)]
    kv.match(reqs[0], 1)
    kv.match(reqs[1], 1)
    with pytest.raises(StateError, match="state pages"):
        kv.match(reqs[2], 1)


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_pages_exact(seed):
    rng = random.Random(seed)
    pool, pages, radix = make(slots=400, pages=12)
    kv = KVAccounting(pool, radix)
    live: list[InferReq] = []
    for step in range(400):
        op = rng.random()
        if op < 0.4 and len(live) < 6:
            base = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9], []])
            req = InferReq(
                f"q{step}", base + [rng.randrange(50) for _ in range(rng.randrange(1, 30))], SamplingParams()
            )
            kv.match(req, req.num_tokens - 1)
            got = kv.alloc(req.num_tokens - 1 - len(req.slots))
            if got is None:
                kv.release(req, keep_in_cache=False)
            else:
                req.slots += got
                live.append(req)
        elif op < 0.7 and live:
            req = live.pop(rng.randrange(len(live)))
            kv.release(req, keep_in_cache=rng.random() < 0.8)
        elif op < 0.85:
            radix.evict(rng.randrange(1, 60))
        else:
            radix.evict_state(rng.randrange(1, 3))
        free, held, ckpts = state_accounting(radix, live)
        assert free + held + ckpts == 12
        owned = [r.state_page for r in live] + [n.state for n in radix.checkpoints]
        assert len(set(owned)) == len(owned) and not any(pages.pool.is_free(p) for p in owned)
        pages.take_ops()
    for r in live:
        kv.release(r)
    radix.clear()
    assert pages.num_free == 12 and pool.num_free == 400
