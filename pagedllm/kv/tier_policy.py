"""Which blocks a KV tier (host RAM, disk) gives up first when it is full (the pool's own choice, with
the same scores: kv/block_eviction.py).

``lru`` drops the least recently used block. ``reuse`` predicts reuse: a block's score is its use
count decayed by how long ago it was used (half-life in tier accesses, so the clock is the workload,
not the wall), each use weighted up for a block shallow in its prefix chain (a system prompt's first
blocks are shared by every conversation that starts with it, and a hit on any later block needs them
first); see kv/reuse_score.py. Every prefix passing through a block adds to its count, so blocks shared
by many cached prefixes score high. The lowest scores go first (a heap, no pass over all blocks), and a
newcomer that would score below the block it would push out is not admitted.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable

from pagedllm.kv.reuse_score import DEPTH_WEIGHT, NO_KEY, add_use, decayed, use_weight

POLICIES = ("lru", "reuse")


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def keys(self) -> set:
        return set(self._order)

    def touch(self, key: Hashable, depth: int = 0, hits: int = 1) -> None:
        """``key`` was stored or hit (``depth``/``hits`` only matter to scoring policies)."""
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def admits(self, depth: int, hits: int, victim: Hashable) -> bool:
        """Whether a newcomer may take ``victim``'s place (LRU: always)."""
        return True

    def victims(self, n: int) -> list:
        """The ``n`` keys to evict first, first to go first (not removed: the tier calls ``remove``)."""
        out = []
        for k in self._order:
            if len(out) >= n:
                break
            out.append(k)
        return out


class ReusePolicy:
    """Decayed, depth-weighted use counts (kv/reuse_score.py) in a lazy min-heap; see the module docstring."""

    def __init__(self, half_life: float = 2048.0, depth_weight: float = DEPTH_WEIGHT) -> None:
        self.half_life = half_life
        self.depth_weight = depth_weight
        self._clock = 0
        self._entries: dict[Hashable, tuple[float, int]] = {}  # key -> (reuse key, heap generation)
        self._heap: list[tuple[float, int, Hashable]] = []  # stale entries are skipped, then dropped
        self._gen = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> set:
        return set(self._entries)

    def touch(self, key: Hashable, depth: int = 0, hits: int = 1) -> None:
        self._clock += 1
        old = self._entries.get(key, (NO_KEY, 0))[0]
        k = add_use(old, self._clock, self.half_life, hits * use_weight(depth, self.depth_weight))
        self._gen += 1
        self._entries[key] = (k, self._gen)
        heapq.heappush(self._heap, (k, self._gen, key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [(k, g, key) for key, (k, g) in self._entries.items()]
            heapq.heapify(self._heap)

    def remove(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def score(self, key: Hashable) -> float:
        """The block's decayed, depth-weighted use count now."""
        return decayed(self._entries[key][0], self._clock, self.half_life)

    def admits(self, depth: int, hits: int, victim: Hashable) -> bool:
        """Admission control: a newcomer that would score below the block it evicts stays out (a
        one-off document does not push out a popular one)."""
        return hits * use_weight(depth, self.depth_weight) > self.score(victim)

    def victims(self, n: int) -> list:
        live: list[tuple[float, int, Hashable]] = []
        heap, entries = self._heap, self._entries
        while heap and len(live) < n:
            item = heapq.heappop(heap)
            if entries.get(item[2], (None, -1))[1] == item[1]:
                live.append(item)
        for item in live:  # only looked at: the tier removes the ones it evicts
            heapq.heappush(heap, item)
        return [item[2] for item in live]


def make_policy(name: str, capacity_blocks: int = 512) -> LRUPolicy | ReusePolicy:
    """The policy of a tier holding about ``capacity_blocks`` blocks: reuse counts halve every four tiers'
    worth of accesses, as in the pool (kv/block_eviction.py; Zipf RAG: 1.15x LRU's hit tokens, against
    1.11x with a fixed half-life of 2048 accesses for an L2 of 64 blocks)."""
    if name == "lru":
        return LRUPolicy()
    if name == "reuse":
        return ReusePolicy(half_life=4.0 * max(capacity_blocks, 1))
    raise ValueError(f"kv_eviction must be one of {', '.join(POLICIES)}, got {name!r}")
