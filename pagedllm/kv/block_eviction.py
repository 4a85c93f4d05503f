"""Which cached-free pool block (L1) an allocation evicts: ``--kv-eviction lru`` or ``reuse``.

``lru`` takes the head of the pool's cached free queue (least recently freed). ``reuse`` keeps the
cached-free blocks in a min-heap of reuse keys (kv/reuse_score.py): every release of a hashed block by
a request counts as one use, weighted by its depth, and decays with the pool's release clock. Heap
entries are never updated in place: a block that leaves the cached-free state (a prefix hit takes it,
its hash is dropped) leaves a stale entry behind, skipped when it surfaces (its generation no longer
matches), and the heap is rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import Protocol

from pagedllm.kv.reuse_score import DEPTH_WEIGHT, add_use, use_weight


class EvictableBlock(Protocol):
    """What the policies read and write of a pool block (kv/block_pool.py's Block)."""

    block_id: int
    ref_count: int
    block_hash: int | None
    depth: int
    reuse_key: float
    generation: int


class BlockQueue(Protocol):
    """The pool's cached free queue, in the order its blocks were freed."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[EvictableBlock]: ...


class LRUEviction:
    """The least recently freed cached block goes first (the free queue's own order)."""

    name = "lru"

    def released(self, b: EvictableBlock) -> None:
        """A request dropped its reference to hashed block ``b`` (LRU: the queue order says it all)."""

    def cached(self, b: EvictableBlock) -> None:
        """``b`` became cached-free (its last holder left)."""

    def victim(self, cached: BlockQueue, blocks: Sequence[EvictableBlock]) -> EvictableBlock:
        """The block to evict among ``cached`` (the pool's cached free queue, in the order freed)."""
        return next(iter(cached))


class ReuseEviction:
    """The cached-free block with the lowest decayed, depth-weighted use count goes first."""

    name = "reuse"

    def __init__(self, half_life: float, depth_weight: float = DEPTH_WEIGHT) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.half_life = half_life
        self.depth_weight = depth_weight
        self.clock = 0  # releases of hashed blocks so far
        self._heap: list[tuple[float, int, int]] = []  # (key, generation, block id)

    def released(self, b: EvictableBlock) -> None:
        self.clock += 1
        b.reuse_key = add_use(b.reuse_key, self.clock, self.half_life, use_weight(b.depth, self.depth_weight))

    def cached(self, b: EvictableBlock) -> None:
        b.generation += 1
        heapq.heappush(self._heap, (b.reuse_key, b.generation, b.block_id))

    def victim(self, cached: BlockQueue, blocks: Sequence[EvictableBlock]) -> EvictableBlock:
        heap = self._heap
        if len(heap) > 2 * len(cached) + 64:
            self._heap = heap = [(b.reuse_key, b.generation, b.block_id) for b in cached]
            heapq.heapify(heap)
        while heap:
            _, gen, bid = heap[0]
            b = blocks[bid]
            if b.generation == gen and b.ref_count == 0 and b.block_hash is not None:
                return b
            heapq.heappop(heap)
        raise AssertionError("reuse eviction: no live heap entry for a non-empty cached queue")

    def check(self, cached: BlockQueue, blocks: Sequence[EvictableBlock]) -> None:
        """Raise AssertionError unless every cached-free block has a live heap entry."""
        live = {bid for _, gen, bid in self._heap if blocks[bid].generation == gen}
        missing = [b.block_id for b in cached if b.block_id not in live]
        if missing:
            raise AssertionError(f"reuse eviction: cached-free blocks {missing[:8]} are not in the heap")


def make_eviction(name: str, num_blocks: int) -> LRUEviction | ReuseEviction:
    """The pool's eviction order for ``--kv-eviction``; reuse counts decay by half every four pools' worth
    of releases (a block must be reused within a few turnovers of the pool to stay). Half-life and depth
    weight were chosen on the Zipf RAG trace (bench/README.md, tiers)."""
    if name == "lru":
        return LRUEviction()
    if name == "reuse":
        return ReuseEviction(half_life=4.0 * num_blocks, depth_weight=DEPTH_WEIGHT)
    raise ValueError(f"kv_eviction must be one of lru, reuse, got {name!r}")

