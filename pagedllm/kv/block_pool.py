"""Physical KV blocks, their free queues and reference counts.

Free blocks wait in two O(1) doubly linked queues: blocks without a hash (handed out first, since
reusing them loses nothing) and cached blocks (freed but still findable by the prefix cache) in
the order they were freed. Which cached block an allocation takes is the eviction policy's choice
(kv/block_eviction.py: LRU, or predicted reuse); handing it out is the lazy eviction: its hash is
dropped at that moment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pagedllm.config.args import check_block_size
from pagedllm.kv.block_eviction import LRUEviction, ReuseEviction, make_eviction
from pagedllm.kv.reuse_score import NO_KEY


class Block:
    """One physical block. ``prev``/``next`` link it into a free queue (both None when in use)."""

    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "depth", "hits", "reuse_key", "generation",
                 "tier", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept with the hash to verify prefix hits
        self.depth = 0  # position in its prefix chain and prefix hits since hashed: what the
        self.hits = 0  # tiers' reuse-aware eviction scores when the block is demoted
        self.reuse_key = NO_KEY  # the pool's reuse eviction: decayed uses of this content (kv/reuse_score.py)
        self.generation = 0  # of its latest entry in that policy's heap
        # "host" / "disk": its content was promoted from that tier and no sequence has taken it since, so the
        # first prefix hit on it is that tier's hit (the per-tier hit counts); None: computed here, or taken
        self.tier: str | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:  # the hash itself is never shown (reprs reach logs and error messages)
        return f"Block(id={self.block_id}, ref={self.ref_count}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of blocks between two sentinels: O(1) popleft, append and removal of a
    block from the middle (a prefix hit on a free block pulls it out)."""

    __slots__ = ("head", "tail", "size")

    def __init__(self, blocks: list[Block] | None = None) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next = self.tail
        self.tail.prev = self.head
        self.size = 0
        for b in blocks or ():
            self.append(b)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Block]:
        b = self.head.next
        while b is not self.tail:
            assert b is not None
            yield b
            b = b.next

    def popleft(self) -> Block:
        b = self.head.next
        if b is self.tail or b is None:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(b)
        return b

    def append(self, b: Block) -> None:
        last = self.tail.prev
        assert last is not None
        b.prev, b.next = last, self.tail
        last.next = b
        self.tail.prev = b
        self.size += 1

    def remove(self, b: Block) -> None:
        prev, nxt = b.prev, b.next
        if prev is None or nxt is None:
            raise ValueError(f"block {b.block_id} is not in a free queue")
        prev.next = nxt
        nxt.prev = prev
        b.prev = b.next = None
        self.size -= 1


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens with O(1) allocate / incref / free (O(log n) to pick a
    cached block under the ``reuse`` eviction policy)."""

    def __init__(self, num_blocks: int, block_size: int = 16, eviction: str = "lru") -> None:
        check_block_size(block_size)
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.unhashed = FreeBlockQueue(self.blocks)
        self.cached = FreeBlockQueue()
        self.eviction: LRUEviction | ReuseEviction = make_eviction(eviction, num_blocks)
        # Called with a block whose hash is dropped, so the index forgets it, and whether the content is
        # evicted (worth saving below the pool) or about to be overwritten / discarded (not).
        self.on_evict: Callable[[Block, bool], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, cached ones included."""
        return self.unhashed.size + self.cached.size

    @property
    def num_cached_free(self) -> int:
        return self.cached.size

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def _block(self, block_id: int) -> Block:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} is out of range 0..{self.num_blocks - 1}")
        return self.blocks[block_id]

    def allocate(self) -> int:
        """Hand out one block with ref_count 1: an unhashed one if any, else the eviction policy's victim."""
        if self.unhashed.size:
            b = self.unhashed.popleft()
        elif self.cached.size:
            b = self.victim()
            self.cached.remove(b)
            self.drop_hash(b)
        else:
            raise RuntimeError("KV block pool exhausted: no free block to allocate")
        b.ref_count = 1
        return b.block_id

    def victim(self) -> Block:
        """The cached-free block the eviction policy gives up next (the cached queue must not be empty)."""
        return self.blocks[self.eviction.victim(self.cached, self.blocks).block_id]

    def allocate_many(self, n: int) -> list[int]:
        """All-or-nothing allocation of ``n`` blocks."""
        if n > self.num_free:
            raise RuntimeError(f"KV block pool exhausted: need {n} blocks, {self.num_free} free")
        return [self.allocate() for _ in range(n)]

    def incref(self, block_id: int) -> None:
        """Take one more reference; a free (cached) block leaves its free queue."""
        b = self._block(block_id)
        if b.ref_count == 0:
            (self.unhashed if b.block_hash is None else self.cached).remove(b)
        b.ref_count += 1

    def free(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes free but keeps its hash (still findable)."""
        b = self._block(block_id)
        if b.ref_count <= 0:
            raise ValueError(f"block {block_id} is not allocated (ref_count {b.ref_count}); double free?")
        b.ref_count -= 1
        if b.block_hash is not None:
            self.eviction.released(b)
        if b.ref_count == 0:
            if b.block_hash is None:
                self.unhashed.append(b)
            else:
                self.cached.append(b)
                self.eviction.cached(b)

    def set_hash(self, block_id: int, block_hash: int, token_ids: tuple[int, ...], depth: int = 0) -> None:
        b = self._block(block_id)
        if b.ref_count == 0:
            raise ValueError(f"cannot hash free block {block_id}")
        b.block_hash = block_hash
        b.token_ids = token_ids
        b.depth = depth
        b.hits = 0
        b.reuse_key = NO_KEY
        b.tier = None

    def drop_hash(self, b: Block, evicted: bool = True) -> None:
        """Forget a block's hash (its content is gone or about to change); a free cached block
        moves to the unhashed queue so it is reused first. ``evicted=False``: the content is being
        overwritten or discarded, not evicted (the tiers below must not save it)."""
        if b.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(b, evicted)
        queued = b.ref_count == 0 and b.prev is not None
        if queued:
            self.cached.remove(b)
        b.block_hash = None
        b.token_ids = None
        b.tier = None
        if queued:
            self.unhashed.append(b)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the free queues hold exactly the ref_count-0 blocks."""
        seen: set[int] = set()
        for q, hashed in ((self.unhashed, False), (self.cached, True)):
            n = 0
            prev = q.head
            for b in q:
                if b.prev is not prev:
                    raise AssertionError(f"free queue link broken at block {b.block_id}")
                if b.ref_count != 0:
                    raise AssertionError(f"block {b.block_id} is queued as free with ref_count {b.ref_count}")
                if (b.block_hash is not None) != hashed:
                    raise AssertionError(f"block {b.block_id} is in the wrong free queue")
                if b.block_id in seen:
                    raise AssertionError(f"block {b.block_id} is queued twice")
                seen.add(b.block_id)
                prev = b
                n += 1
            if n != q.size:
                raise AssertionError(f"free queue size {q.size} but {n} blocks linked")
        for b in self.blocks:
            if b.ref_count < 0:
                raise AssertionError(f"block {b.block_id} has negative ref_count")
            if b.ref_count == 0 and b.block_id not in seen:
                raise AssertionError(f"block {b.block_id} has ref_count 0 but is in no free queue")
            if b.ref_count > 0 and (b.prev is not None or b.next is not None):
                raise AssertionError(f"in-use block {b.block_id} is linked")
        if isinstance(self.eviction, ReuseEviction):
            self.eviction.check(self.cached, self.blocks)
