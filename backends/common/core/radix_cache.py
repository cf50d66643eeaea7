"""Radix tree over int64 token ids mapping prefixes to KV slots (page size 1), with reference counts and LRU
eviction of unreferenced leaves. Pure Python over integers.

The tree owns the slots stored in it. A holder that uses a matched prefix must `lock` the returned node before
the slots are used and `unlock` it when done; locked nodes and their ancestors are never evicted.

Hybrid models (`state` given): a node may also own a state checkpoint, the linear-attention state at the node's
end. A prefix is then usable only up to a position that has one (the root, position 0, always does: the zero
state), so `match_prefix` stops at the deepest checkpoint and never returns K/V whose state it cannot restore.
Checkpoints stay with a node's end through splits, go with it when its tail is trimmed or it is evicted, and are
dropped on their own (least recently used first) when the state pages run short (`evict_state`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from backends.common.core.kv_pool import KVPool
from backends.common.core.state_pages import ZERO, StatePages


def _common_prefix(key: Sequence[int], tokens: Sequence[int], i: int) -> int:
    """How many leading entries of key equal tokens[i:]. Slices are compared in C first (a paused request's
    history of thousands of tokens matches whole edges); element by element only to find where an edge diverges."""
    n = min(len(key), len(tokens) - i)
    seg = tokens[i : i + n]
    if not isinstance(seg, list):
        seg = list(seg)
    if key[:n] == seg:
        return n
    m = 0
    while key[m] == seg[m]:  # they differ somewhere before n
        m += 1
    return m


class Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "priority", "state")

    def __init__(self, parent: Node | None, key: list[int], value: list[int], last_access: int):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.key = key  # token ids of this edge
        self.value = value  # slots of those tokens, same length
        self.lock_ref = 0
        self.last_access = last_access
        self.priority = 0  # evicted after every lower-priority leaf (decode keeps paused requests' KV longer)
        self.state = ZERO  # hybrid models: the state page checkpointed at this node's end (ZERO: none)


class RadixCache:
    def __init__(self, pool: KVPool, state: StatePages | None = None):
        self.pool = pool
        self.state = state
        self.checkpoints: set[Node] = set()  # nodes that own a state page
        self._clock = itertools.count()
        self.root = Node(None, [], [], 0)
        self.root.lock_ref = 1  # the root is never evicted
        self.cached_size = 0  # slots held by the tree
        self.protected_size = 0  # of those, slots under a locked node
        # unlocked nodes without children: what eviction may take, kept up to date by every change to the tree's
        # shape or locks so that evict() never walks the whole tree
        self.evictable_leaves: set[Node] = set()
        # those leaves in eviction order, (priority, last_access, id, seq, node), kept across evict() calls: an
        # entry is pushed whenever a leaf becomes evictable or its priority or last access changes, and is valid
        # only while it still matches its node (stale ones are skipped, and dropped when they outnumber the rest).
        # Rebuilding the order on every call cost O(leaves) per allocation once the cache was full: prefill's
        # bookkeeping per round of 256 requests went from 3 ms to 570 ms on a full 131,072-slot cache.
        self._heap: list[tuple] = []
        self._seq = itertools.count()

    @property
    def evictable_size(self) -> int:
        return self.cached_size - self.protected_size

    def _touch(self, node: Node) -> None:
        t = next(self._clock)
        leaf = node
        while node is not None:
            node.last_access = t
            node = node.parent
        if leaf in self.evictable_leaves:  # only the start of the path can be a leaf
            self._push(leaf)

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.priority, node.last_access, id(node), next(self._seq), node))
        if len(self._heap) > 2 * len(self.evictable_leaves) + 64:  # mostly stale: rebuild from the leaves
            self._heap = [(n.priority, n.last_access, id(n), next(self._seq), n) for n in self.evictable_leaves]
            heapq.heapify(self._heap)

    def _add_evictable(self, node: Node) -> None:
        self.evictable_leaves.add(node)
        self._push(node)

    def _pop_lru(self) -> Node | None:
        """The evictable leaf to go first (lowest priority, then least recently used), taken off the heap."""
        while self._heap:
            priority, last_access, _, _, node = heapq.heappop(self._heap)
            if node in self.evictable_leaves and (priority, last_access) == (node.priority, node.last_access):
                return node
        return None

    def _split(self, node: Node, at: int) -> Node:
        """Split node's edge at `at`; returns the new upper node holding key[:at]."""
        upper = Node(node.parent, node.key[:at], node.value[:at], node.last_access)
        upper.lock_ref = node.lock_ref
        upper.priority = node.priority
        upper.children = {node.key[at]: node}
        node.parent.children[node.key[0]] = upper
        node.parent = upper
        node.key, node.value = node.key[at:], node.value[at:]
        return upper

    def match_prefix(self, tokens: Sequence[int], kv_only: bool = False) -> tuple[list[int], Node]:
        """Slots of the longest cached prefix of tokens, and the node where it ends (lock it before use). With
        state checkpoints, the longest prefix that ends at one (its page: the node's `state`, or ZERO at the
        root), unless `kv_only`: then the K/V alone, as for a model without state."""
        if self.state is not None and not kv_only:
            return self._match_checkpointed(tokens)
        node, slots, i = self.root, [], 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            key = child.key
            n = _common_prefix(key, tokens, i)
            if n < len(key):
                child = self._split(child, n)
            slots.extend(child.value)
            node, i = child, i + n
        self._touch(node)
        return slots, node

    def _match_checkpointed(self, tokens: Sequence[int]) -> tuple[list[int], Node]:
        node, i = self.root, 0
        best = self.root
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            key = child.key
            n = _common_prefix(key, tokens, i)
            if n < len(key):
                break  # a checkpoint sits at a node's end: this one's is past the match
            node, i = child, i + n
            if child.state != ZERO:
                best = child
        slots: list[int] = []
        cur = best
        while cur is not self.root:
            slots[:0] = cur.value
            cur = cur.parent
        self._touch(best)
        return slots, best

    def checkpoint_of(self, node: Node) -> int:
        """The state page to restore at the end of a matched prefix: ZERO at the root (position 0)."""
        return ZERO if node is self.root else node.state

    def _drop_state(self, node: Node) -> None:
        if node.state != ZERO:
            self.state.free(node.state)
            node.state = ZERO
            self.checkpoints.discard(node)

    def evict_state(self, n: int = 1) -> int:
        """Free n checkpoint pages, least recently used first (their K/V stays). Returns how many were freed."""
        freed = 0
        for node in sorted(self.checkpoints, key=lambda x: x.last_access)[:n]:
            self._drop_state(node)
            freed += 1
        return freed

    def insert(
        self, tokens: Sequence[int], slots: Sequence[int], priority: int | None = None, state_page: int = ZERO
    ) -> int:
        """Store slots for tokens. Returns how many leading tokens were already cached: the caller still owns
        slots[:that] (duplicates of the tree's own, to be freed by the caller) and the tree now owns the rest.
        With `priority`, every node on the path gets that eviction priority. `state_page` (the state after all of
        tokens) is always taken: it becomes the checkpoint at the end, or is freed when one is already there."""
        assert len(tokens) == len(slots)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = Node(node, list(tokens[i:]), list(slots[i:]), 0)
                node.children[tokens[i]] = leaf
                self.evictable_leaves.discard(node)
                self.evictable_leaves.add(leaf)  # its heap entry is pushed by _touch below, once it is stamped
                self.cached_size += len(leaf.key)
                node = leaf
                break
            key = child.key
            n = _common_prefix(key, tokens, i)
            if n < len(key):
                child = self._split(child, n)
            node, i = child, i + n
        if priority is not None:
            cur = node
            while cur is not self.root:
                cur.priority = priority
                cur = cur.parent
        if state_page != ZERO:
            if node is self.root or node.state != ZERO:
                self.state.free(state_page)
            else:
                node.state = state_page
                self.checkpoints.add(node)
        self._touch(node)  # pushes the end node's heap entry if it is an evictable leaf
        return i

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.protected_size += len(node.key)
                self.evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix node unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
                if not node.children:
                    self._add_evictable(node)
            node = node.parent

    def locked_bound(self, tokens: Sequence[int]) -> int:
        """At most how many locked slots a match of tokens can return: 0 when the edge it would start with is
        unlocked (a lock holds a node's whole path up to the root, so nothing under an unlocked node is locked),
        else every locked slot. Without a walk of the tokens."""
        child = self.root.children.get(tokens[0]) if len(tokens) else None
        return self.protected_size if child is not None and child.lock_ref > 0 else 0

    def locked_only_by(self, node: Node | None) -> int:
        """Slots on the path from `node` up that one lock alone protects (lock_ref 1): what the request holding
        that lock would make evictable by letting go of it."""
        n = 0
        while node is not None and node is not self.root and node.lock_ref == 1:
            n += len(node.key)
            node = node.parent
        return n

    def evict(self, num_slots: int) -> int:
        """Free num_slots slots from unreferenced leaves, least recently used first (fewer if the tree has fewer
        to give). With page size 1 a leaf is trimmed from its end rather than dropped whole, so a long cached
        history loses only the positions that are needed. Returns the number freed."""
        if num_slots <= 0:
            return 0
        freed = 0
        while freed < num_slots and (node := self._pop_lru()) is not None:
            need = num_slots - freed
            if len(node.value) > need:  # trim the tail: [0, len - need) stays cached
                if self.state is not None:
                    self._drop_state(node)  # its end moves: the checkpoint no longer matches it
                self.pool.free(node.value[-need:])
                del node.value[-need:], node.key[-need:]
                self.cached_size -= need
                self._push(node)  # still evictable, first in line
                return freed + need
            self.pool.free(node.value)
            if self.state is not None:
                self._drop_state(node)
            freed += len(node.value)
            self.cached_size -= len(node.value)
            parent = node.parent
            del parent.children[node.key[0]]
            self.evictable_leaves.discard(node)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._add_evictable(parent)
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node
            stack.extend(node.children.values())

    def clear(self) -> int:
        """Evict everything unreferenced (used at shutdown and by tests)."""
        return self.evict(self.cached_size)
