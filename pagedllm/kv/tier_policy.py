"""Which blocks a KV tier (host RAM, disk) gives up first when it is full.

``lru`` drops the least recently used block. ``reuse`` predicts reuse: a block's score is its hit
count decayed by how long ago it was last used (half-life in tier accesses, so the clock is the
workload, not the wall), plus a bonus for being shallow in its prefix chain (a system prompt's
first blocks are shared by every conversation that starts with it, and a hit on any later block
needs them first). Every prefix passing through a block adds to its count, so blocks shared by
many cached prefixes score high. The lowest scores go first, and a newcomer that would score below the
block it would push out is not admitted.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable

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
    """Decayed frequency plus a shallow-depth bonus; see the module docstring."""

    def __init__(self, half_life: float = 2048.0, depth_weight: float = 1.0) -> None:
        self.half_life = half_life
        self.depth_weight = depth_weight
        self._clock = 0
        self._entries: dict[Hashable, tuple[float, int, int]] = {}  # key -> (count, last use, depth)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> set:
        return set(self._entries)

    def _decayed(self, count: float, last: int) -> float:
        return count * 0.5 ** ((self._clock - last) / self.half_life)

    def touch(self, key: Hashable, depth: int = 0, hits: int = 1) -> None:
        self._clock += 1
        count, last, _ = self._entries.get(key, (0.0, self._clock, depth))
        self._entries[key] = (self._decayed(count, last) + hits, self._clock, depth)

    def remove(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def score(self, key: Hashable) -> float:
        count, last, depth = self._entries[key]
        return self._decayed(count, last) + self.depth_weight / (1 + depth)

    def admits(self, depth: int, hits: int, victim: Hashable) -> bool:
        """Admission control: a newcomer that would score below the block it evicts stays out (a
        one-off document does not push out a popular one)."""
        return hits + self.depth_weight / (1 + depth) > self.score(victim)

    def victims(self, n: int) -> list:
        return heapq.nsmallest(n, self._entries, key=self.score)


def make_policy(name: str) -> LRUPolicy | ReusePolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "reuse":
        return ReusePolicy()
    raise ValueError(f"kv_eviction must be one of {', '.join(POLICIES)}, got {name!r}")
