"""KVCacheManager: the only KV interface the scheduler uses (see docs/architecture.md).

It owns the block pool, the prefix cache, every sequence's block table and the host (swap) tier,
and hands the model runner three kinds of block copies per step. Apply them in this order, once
per step, before the forward: ``swap_out`` pairs, then ``swap_in`` pairs, then the copy-on-write
pairs from ``take_pending_copies()``. Calling ``take_pending_copies()`` also ends the step: blocks
that this step's copies still read (a CoW source whose last holder left, host blocks just
swapped in) are only recycled then, so no copy of the step can read a block another one wrote.

With KV tiers attached (``attach_tiers``: host RAM, disk), the cached blocks the pool evicts are saved
there when the step's schedule ends, and ``prefetch`` brings a prompt's blocks back from them; see
docs/architecture.md, "KV tiers".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pagedllm.kv.block_pool import Block, BlockPool
from pagedllm.kv.block_table import BlockTable
from pagedllm.kv.kv_quant import raw
from pagedllm.kv.prefix_cache import PrefixCache, PrefixMatch, extra_keys_for, hash_block, hash_block_chain
from pagedllm.kv.pool_blocks import PoolBlocks
from pagedllm.kv.tier_store import TierStore

log = logging.getLogger(__name__)

SeqId = Hashable
BlockPairs = list[tuple[int, int]]

__all__ = ["KVCacheManager", "PrefixMatch"]


@dataclass(slots=True)
class _Seq:
    table: BlockTable
    hashes: list[int] = field(default_factory=list)  # chain hashes of its leading full blocks
    num_registered: int = 0  # leading full blocks already offered to the prefix cache
    host_blocks: list[int] | None = None  # where its KV lives while swapped out
    num_sent: int = 0  # leading table entries the worker holds unchanged (see take_table_diff)


@dataclass(slots=True)
class _Load:
    """A promotion from disk in flight: blocks ``start..`` of a chain, landed when the future is done."""

    future: Future
    hashes: list[int]
    token_ids: list[int]
    extra: tuple
    start: int
    t0: float
    where: list[str]  # the tier of each block from ``start`` ("host" or "disk")
    tail: tuple[int, ...] | None = None  # the run ends with a tail block of these tokens (its hash is last)


@dataclass(slots=True)
class _Run:
    """Promoted blocks ``start..`` of a chain (``data``: gathered layout, block ``i`` of the chain at ``i - start``)."""

    hashes: list[int]
    token_ids: Sequence[int]
    extra: tuple
    start: int
    data: dict
    t0: float
    where: Sequence[str]  # the tier of each block from ``start``, for the per-tier hit counts
    tail: tuple[int, ...] | None = None  # the run ends with a tail block of these tokens (its hash is last)


# Disk reads a schedule asks for are done in line (in the scheduler's thread) while their expected times add up
# to less than this fraction of a step: their requests run in that step instead of the next.
INLINE_READ_FRACTION = 0.1


class KVCacheManager:
    """Paged KV bookkeeping: allocation, prefix sharing, fork + copy-on-write, swap."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        eviction: str = "lru",
    ) -> None:
        """``eviction``: which cached-free block an allocation takes, ``lru`` or ``reuse`` (kv/block_eviction.py)."""
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.pool = BlockPool(num_blocks, block_size, eviction)
        self.prefix_cache = PrefixCache(self.pool)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self._seqs: dict[SeqId, _Seq] = {}
        self._pending: dict[int, int] = {}  # CoW copies of this step, dst -> src
        self._pending_src: dict[int, int] = {}  # src -> number of pending copies reading it
        self._deferred: list[int] = []  # blocks whose last holder left while a pending copy reads them
        self._host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._host_ref = [0] * num_host_blocks  # swapped sequences holding each host block
        self._host_deferred: list[int] = []  # host blocks released this step (copies may still use them)
        self._swapped_in_now: set[SeqId] = set()
        self.tiers: TierStore | None = None  # L2/L3 below the pool (attach_tiers)
        self._kv_cache: PoolBlocks | None = None
        self._demote: list[tuple[int, int, tuple[int, ...], int, int]] = []  # evicted: id, hash, tokens, depth, hits
        self._loads: dict[int, _Load] = {}  # disk promotions in flight, by the first block's hash
        self._landing: dict[int, tuple[_Run, int]] = {}  # promoted blocks indexed, not written yet: id -> run, pos
        self._step_s: float | None = None  # moving average of the time between two schedules' ends
        self._step_end: float | None = None
        self._waited_s = 0.0  # this schedule's disk reads done in line (see _read_fits)
        self._pages: dict[Hashable, list[int]] = {}  # issue 32: blocks held as pages by an owner (a LoRA adapter)

    # ---- pages: blocks that hold something other than KV (issue 32: LoRA adapter weights) --------

    def allocate_pages(self, owner: Hashable, n: int) -> list[int] | None:
        """``n`` blocks held by ``owner`` (one reference each, never hashed), or None if fewer are free: an
        adapter's weights compete with the KV cache for the same pool (S-LoRA's unified paging)."""
        if owner in self._pages:
            raise ValueError(f"{owner!r} already holds pages")
        if n > self.pool.num_free:
            return None
        self._pages[owner] = ids = self.pool.allocate_many(n)
        return ids

    def free_pages(self, owner: Hashable) -> int:
        """Give back every page ``owner`` holds; returns how many."""
        ids = self._pages.pop(owner, [])
        for b in ids:  # never a copy's source or destination: straight back to the pool
            self.pool.free(b)
        return len(ids)

    def pages_of(self, owner: Hashable) -> list[int]:
        return list(self._pages.get(owner, ()))

    @property
    def num_page_blocks(self) -> int:
        """Blocks held as pages (counted as used in ``num_free_blocks`` and ``usage``)."""
        return sum(map(len, self._pages.values()))

    # ---- queries -------------------------------------------------------------------------

    def has_seq(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: SeqId) -> bool:
        return self._seq(seq_id).host_blocks is not None

    def block_table(self, seq_id: SeqId) -> list[int]:
        """A copy of the sequence's physical block ids (empty while swapped out)."""
        return list(self._seq(seq_id).table.block_ids)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now, cached-free ones included."""
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by the prefix cache (in use or cached-free)."""
        return len(self.prefix_cache)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    @property
    def usage(self) -> float:
        """Fraction of device blocks held by sequences (cached-free blocks count as free)."""
        return self.pool.num_used / self.num_blocks

    def blocks_needed(self, seq_id: SeqId | None, num_total_tokens: int) -> int:
        """New blocks a sequence (None: a new one) needs to hold ``num_total_tokens`` tokens,
        not counting copy-on-write or prefix hits."""
        have = 0 if seq_id is None or seq_id not in self._seqs else len(self._seqs[seq_id].table)
        return max(-(-num_total_tokens // self.block_size) - have, 0)

    def _seq(self, seq_id: SeqId) -> _Seq:
        st = self._seqs.get(seq_id)
        if st is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return st

    # ---- prefix cache --------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None, record: bool = True,
                     lora_id: int = 0) -> PrefixMatch:
        """Longest cached prefix of a prompt (full blocks, token ids verified, at least one token
        left to compute). Takes no references: pass it to ``allocate_slots`` right away. Each call
        counts as one query in ``stats()`` unless ``record=False`` (a probe for ordering)."""
        if not self.enable_prefix_caching:
            return PrefixMatch()
        return self.prefix_cache.match(token_ids, extra_keys_for(cache_salt, lora_id), record)

    def cache_full_blocks(self, seq_id: SeqId, token_ids: Sequence[int], cache_salt: str | None = None,
                          num_computed: int | None = None, lora_id: int = 0) -> None:
        """Hash and register the sequence's full blocks not registered yet: the one place block
        hashes are made. The first ``num_computed`` of ``token_ids`` (default: all) have KV in the
        pool; only they are ever hashed. Idempotent and O(1) when no block filled up."""
        if not self.enable_prefix_caching:
            return
        st = self._seq(seq_id)
        bs = self.block_size
        table = st.table.block_ids
        n_full = min((len(token_ids) if num_computed is None else num_computed) // bs, len(table))
        if n_full <= st.num_registered:
            return
        k = len(st.hashes)
        extra = extra_keys_for(cache_salt, lora_id)
        if k < n_full:
            parent = st.hashes[-1] if k else None
            st.hashes += hash_block_chain(parent, token_ids[k * bs : n_full * bs], bs, extra, self.prefix_cache.key)
        for i in range(st.num_registered, n_full):
            self.prefix_cache.insert(table[i], st.hashes[i], token_ids[i * bs : (i + 1) * bs], i,
                                     st.hashes[i - 1] if i else None, extra)
        st.num_registered = n_full

    def cache_tail(self, seq_id: SeqId, token_ids: Sequence[int], cache_salt: str | None = None,
                   lora_id: int = 0) -> None:
        """Index a finishing sequence's full blocks and its last, partly filled block (``token_ids``: the
        tokens whose K/V is in the pool), so a prompt that continues it (a chat's next turn) computes only
        its new tokens; call it just before ``free``. A block shared with another sequence is left alone."""
        if not self.enable_prefix_caching:
            return
        self.cache_full_blocks(seq_id, token_ids, cache_salt, None, lora_id)
        st = self._seqs.get(seq_id)
        k, n = divmod(len(token_ids), self.block_size)
        if st is None or not n or k >= len(st.table.block_ids) or len(st.hashes) < k:
            return
        b = st.table.block_ids[k]
        if self.pool.blocks[b].ref_count != 1 or b in self._pending:
            return
        parent, extra = st.hashes[k - 1] if k else None, extra_keys_for(cache_salt, lora_id)
        tail = token_ids[k * self.block_size:]
        self.prefix_cache.insert(b, hash_block(parent, tail, extra, self.prefix_cache.key), tail, k, parent, extra)

    def import_blocks(self, hashes: Sequence[int], token_ids: Sequence[int],
                      cache_salt: str | None = None, lora_id: int = 0) -> list[tuple[int, int]]:
        """Index full blocks computed by another engine (a peer replica, a prefill replica) in the
        prefix cache, so a later request's ``match_prefix`` hits them. ``hashes`` are their chain
        hashes, ``token_ids`` their tokens (``len(hashes) * block_size``); the hashes must be the
        ones this engine makes (same hash key, block size, salt and LoRA adapter), else ValueError.

        Blocks already cached here are kept; each missing one gets a free block (LRU eviction as
        for any allocation, never a block in use). Returns ``(position in hashes, block id)`` for
        every block whose K/V the caller must write now, before anything else allocates: the
        blocks are left cached-free (ref 0), like the blocks of a finished request."""
        if not self.enable_prefix_caching or not hashes:
            return []
        bs = self.block_size
        if len(token_ids) != len(hashes) * bs:
            raise ValueError(f"token_ids: expected {len(hashes) * bs} ids for {len(hashes)} blocks, got {len(token_ids)}")
        extra = extra_keys_for(cache_salt, lora_id)
        if hash_block_chain(None, token_ids, bs, extra, self.prefix_cache.key) != list(hashes):
            raise ValueError("hashes: not this engine's chain hashes of token_ids "
                             "(engines sharing KV need the same hash key, block size, cache salt and adapter)")
        return self._index_blocks(hashes, token_ids, extra)

    def _index_blocks(self, hashes: Sequence[int], token_ids: Sequence[int], extra: tuple,
                      start: int = 0, tail: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
        """Give blocks ``start..`` of a chain missing from the pool a free block each and index them
        (cached-free); ``[]`` when blocks before ``start`` are no longer cached. ``tail``: the last hash
        is a tail block of these tokens. Returns the ``(position, block)`` pairs whose K/V the caller
        writes now."""
        pool, bs = self.pool, self.block_size
        full = len(hashes) - (tail is not None)
        # One extra token lifts match's "leave one token to compute" cap: every block is looked up.
        held = self.prefix_cache.match([*token_ids[:full * bs], 0], extra, record=False).blocks
        if len(held) < start:
            return []
        for b in held:
            pool.incref(b)  # not evicted by the allocations below
        writes = []
        for i in range(len(held), len(hashes)):
            if pool.num_free == 0:
                break
            b = pool.allocate()
            held.append(b)
            tokens = token_ids[i * bs:(i + 1) * bs] if i < full else tail
            if self.prefix_cache.insert(b, hashes[i], tokens, i, hashes[i - 1] if i else None, extra):
                writes.append((i, b))
        for b in reversed(held):  # the tail is evicted first, as in free()
            pool.free(b)
        self._flush_demotions()  # the allocations evicted blocks: save them before they are overwritten
        return writes

    # ---- tiers below the pool (L2 host RAM, L3 disk) ---------------------------------------

    def attach_tiers(self, tiers: TierStore, hash_key: bytes | None, kv_cache: PoolBlocks) -> None:
        """Demote the blocks the pool evicts to ``tiers`` (gathered from ``kv_cache``: the pool, or every
        rank's shard of it) and promote from them on a prefix miss (``prefetch``). ``hash_key``: a stable
        key for a persistent disk tier."""
        if len(self.prefix_cache) or self._seqs:
            raise RuntimeError("attach tiers before the first request")
        if kv_cache.num_blocks < self.num_blocks or kv_cache.block_size != self.block_size:
            raise ValueError("kv_cache: its pool does not match this manager's")
        self.tiers, self._kv_cache = tiers, kv_cache
        if hash_key is not None:
            self.prefix_cache.key = hash_key
        self.prefix_cache.on_drop = self._on_drop

    def _on_drop(self, b: Block) -> None:
        if self._landing.pop(b.block_id, None) is not None:
            return  # a promoted block evicted before its write (a later run of the same landing): the tier keeps it
        if b.ref_count == 0 and b.block_hash is not None and b.token_ids is not None:
            self._demote.append((b.block_id, b.block_hash, b.token_ids, b.depth, b.hits))

    def _flush_demotions(self) -> None:
        """Save the blocks evicted since the last flush: one gather for all of them, then L2/L3."""
        if not self._demote or self.tiers is None or self._kv_cache is None:
            self._demote.clear()
            return
        ids, hashes, tokens, depths, hits = zip(*self._demote)
        self._demote.clear()
        self.tiers.demote(hashes, tokens, depths, [1 + h for h in hits], self._kv_cache.gather_blocks(list(ids)))

    def prefetch(self, token_ids: Sequence[int], cache_salt: str | None = None, wait: bool = False,
                 lora_id: int = 0) -> bool:
        """Promote the prompt's blocks that L2/L3 hold past its pool hit. An L2 run lands now (one
        host-to-device copy); a run that needs the disk is read by the tier thread, and this returns
        True until it lands, so the scheduler lets other requests run meanwhile (``wait``: nothing
        else to run, so wait for it here; a short read is done in line, see ``_read_fits``). Waiting
        beats recomputing: a block from the tiers costs a copy of its bytes, recomputing it a forward
        over its tokens (see bench/README.md, tiers)."""
        if self.tiers is None or not self.enable_prefix_caching:
            return False
        self._land_finished()
        bs, extra = self.block_size, extra_keys_for(cache_salt, lora_id)
        n = max(len(token_ids) - 1, 0) // bs
        l1 = self.prefix_cache.match(token_ids, extra, record=False)
        k = len(l1.blocks)
        hashes = l1.hashes + hash_block_chain(l1.hashes[-1] if k else None, token_ids[k * bs:n * bs], bs, extra,
                                              self.prefix_cache.key)
        load, inline = self._loads.get(hashes[k]) if k < n else None, False
        if load is None:
            tokens = [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(k, n)]
            where = self.tiers.locate(hashes[k:], tokens)
            m, t0 = len(where), time.perf_counter()
            shared = l1.num_tokens - k * bs if l1.tail is not None and not m else 0  # L1's tail, if the run ends there
            tail = self._tail_in_tiers(token_ids, k + m, hashes, extra, shared)
            run = hashes[:k + m]
            if tail is not None:  # the tail after the run: promoted with it, last
                run, where, tail = [*run, tail[0]], [*where, tail[1]], tail[2]
                tokens = [*tokens[:m], tail]
            if not where:
                return False
            if "disk" not in where:
                data, got = self.tiers.load_host(run[k:])
                if got < len(run) - k:  # an L2 block was evicted since it was located: the blocks before it
                    run, where, tail = run[:k + got], where[:got], None
                if got:
                    self._land([_Run(run, token_ids, extra, k, data, t0, where, tail)])
                return False
            inline = not m or self._read_fits(where.count("disk"))  # a tail alone: one block, read now
            load = self._loads[run[k]] = _Load(self.tiers.load_disk(run[k:], tokens[:len(where)], where, inline),
                                               run, list(token_ids[:(k + m) * bs]), extra, k, t0, where, tail)
            if inline:
                self._waited_s += time.perf_counter() - t0
        if wait:
            load.future.result()
        elif not inline:  # (a read in flight from an earlier call is not done: done ones landed above)
            return True
        self._land_finished()
        return False

    def _tail_in_tiers(self, token_ids: Sequence[int], j: int, hashes: Sequence[int], extra: tuple,
                       longer_than: int = 0) -> tuple[int, str, tuple[int, ...]] | None:
        """The longest tail after the chain's ``j`` full blocks that L2/L3 hold, of more than ``longer_than``
        tokens, that the prompt continues whole leaving a token to compute: (hash, tier, tokens), or None.
        One lookup per length (at most ``block_size - 1``)."""
        assert self.tiers is not None
        bs, parent = self.block_size, hashes[j - 1] if j else None
        for n in range(min(bs - 1, len(token_ids) - 1 - j * bs), longer_than, -1):
            tail = tuple(token_ids[j * bs:j * bs + n])
            h = hash_block(parent, tail, extra, self.prefix_cache.key)
            if (where := self.tiers.find(h, tail)) is not None:
                return h, where, tail
        return None

    def _read_fits(self, disk_blocks: int) -> bool:
        """Whether a read of ``disk_blocks`` fits what is left of this schedule's budget for reading in line,
        ``INLINE_READ_FRACTION`` of a step (expected: the tier's measured read time per block; before a read
        and a step are measured, nothing fits). A read that fits is done now, so its request runs in this step
        rather than the next; the others go to the read threads."""
        per_block = self.tiers.read_seconds_per_block if self.tiers is not None else None
        if per_block is None or self._step_s is None:
            return False
        return per_block * disk_blocks <= INLINE_READ_FRACTION * self._step_s - self._waited_s

    def _land_finished(self) -> None:
        """Land every finished read (all in one copy)."""
        runs = []
        for key, ld in list(self._loads.items()):
            if ld.future.done():
                del self._loads[key]
                data, m = ld.future.result()
                if m:  # a tail comes last: a run cut short (a missing or corrupt file) lands without it
                    tail = ld.tail if ld.start + m == len(ld.hashes) else None
                    runs.append(_Run(ld.hashes[:ld.start + m], ld.token_ids, ld.extra, ld.start, data, ld.t0, ld.where,
                                     tail))
        if runs:
            self._land(runs)

    def _land(self, runs: list[_Run]) -> None:
        """Index each promoted run in free pool blocks (cached-free), then write all of them in one copy: one
        index copy, or one message per rank when the workers are in other processes."""
        assert self.tiers is not None and self._kv_cache is not None
        self._landing = {}
        for run in runs:
            for i, b in self._index_blocks(run.hashes, run.token_ids, run.extra, run.start, run.tail):  # >= start
                self._landing[b] = (run, i - run.start)
        landing, self._landing = self._landing, {}
        by_run: dict[int, tuple[_Run, list[int], list[int]]] = {}
        for b, (run, pos) in landing.items():
            entry = by_run.setdefault(id(run), (run, [], []))
            entry[1].append(b)
            entry[2].append(pos)
        if by_run:
            parts = [(run.data, torch.tensor(pos, dtype=torch.int64)) for run, _, pos in by_run.values()]
            dtype = parts[0][0]["kv"].dtype
            sub = {"kv": torch.cat([raw(d["kv"]).index_select(3, idx) for d, idx in parts], dim=3).view(dtype)}
            if "scales" in parts[0][0]:  # int8: per block; fp8: the per-head scales, the same in every run
                sub["scales"] = (torch.cat([d["scales"].index_select(3, idx) for d, idx in parts], dim=3)
                                 if self._kv_cache.dtype == torch.int8 else parts[0][0]["scales"])
            ids = [b for _, blocks, _ in by_run.values() for b in blocks]
            try:
                self._kv_cache.import_blocks(ids, sub)
            except ValueError:  # not this pool's layout: indexed but never written, so never hit
                log.warning("KV tiers: a promoted run does not fit this pool; recomputing it", exc_info=True)
                for b in ids:
                    self.prefix_cache.remove(b)
                return
            for b, (run, pos) in landing.items():
                self.pool.blocks[b].tier = run.where[pos]
        now = time.perf_counter()
        for run in runs:
            self.tiers.record_promotion(now - run.t0)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block without demoting it, and empty the host tier (the disk tier
        is kept: it is the persistent one). Returns how many pool blocks were dropped."""
        n = self.prefix_cache.evict(self.pool.num_cached_free, demote=False)
        if self.tiers is not None and self.tiers.host is not None:
            self.tiers.host.clear()
        return n

    def close(self) -> None:
        """Save the pool's cached blocks to the tiers and wait for the disk writes (shutdown)."""
        if self.tiers is None:
            return
        for b in list(self.pool.cached):
            self._on_drop(b)
        self._flush_demotions()
        self.tiers.close()

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        seq_id: SeqId,
        num_computed_tokens: int,
        num_new_tokens: int,
        prefix: PrefixMatch | None = None,
    ) -> bool:
        """Make the sequence's table cover ``num_computed_tokens + num_new_tokens`` tokens.

        ``prefix`` (first call only) must come from ``match_prefix`` with ``num_computed_tokens ==
        prefix.num_tokens``; its blocks join the table with one more reference each, and its tail, if
        any, is copied into a fresh block (held until the copy is taken). Every shared
        block in the write range ``[num_computed, num_computed + num_new)`` is replaced by a fresh
        one (copy-on-write; the copy is queued only when the block holds computed tokens). False
        means not enough free blocks (or the prefix went stale since the match) and nothing
        changed. A sequence that could never fit in the whole pool raises ValueError.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError("token counts must be >= 0")
        pool, bs = self.pool, self.block_size
        st = self._seqs.get(seq_id)
        if st is not None and st.host_blocks is not None:
            raise RuntimeError(f"sequence {seq_id!r} is swapped out; swap_in first")
        table = st.table.block_ids if st is not None else []
        pre = prefix.blocks if prefix is not None else []
        tail = prefix.tail if prefix is not None else None
        if prefix is not None and (pre or tail is not None):
            if table:
                raise ValueError("a prefix can only be passed on a sequence's first allocation")
            if num_computed_tokens != prefix.num_tokens:
                raise ValueError(f"num_computed_tokens {num_computed_tokens} != prefix.num_tokens {prefix.num_tokens}")
            if any(pool.blocks[b].block_hash != h for b, h in zip(pre, prefix.hashes)):
                return False  # a matched block was handed out since the match
            if tail is not None and pool.blocks[tail].block_hash != prefix.tail_hash:
                return False
        total = num_computed_tokens + num_new_tokens
        need_len = -(-total // bs)
        if need_len > self.num_blocks:
            raise ValueError(
                f"sequence {seq_id!r} needs {need_len} blocks for {total} tokens but the pool has only "
                f"{self.num_blocks} blocks of {bs} tokens"
            )
        have = len(table) + len(pre) + (tail is not None)
        if num_computed_tokens > have * bs:
            raise ValueError(
                f"sequence {seq_id!r}: {num_computed_tokens} computed tokens but its table holds {have * bs} slots"
            )
        first = num_computed_tokens // bs
        write = range(first, min(need_len, len(table))) if num_new_tokens else range(0)
        cow = {i for i in write if pool.blocks[table[i]].ref_count > 1}
        revive = sum(pool.blocks[b].ref_count == 0 for b in pre)
        if tail is not None:  # held (revived if free) and copied into a block of its own
            revive += 1 + (pool.blocks[tail].ref_count == 0)
        new = max(need_len - have, 0)
        if new + len(cow) + revive > pool.num_free:
            return False

        if st is None:
            st = self._seqs[seq_id] = _Seq(BlockTable(bs))
            table = st.table.block_ids
        if prefix is not None and pre:
            for b in pre:
                pool.incref(b)
                pool.blocks[b].tier = None  # taken: a later hit on it is the pool's (prefix.tier_tokens counted this one)
            table.extend(pre)
            st.hashes = list(prefix.hashes)
            st.num_registered = len(pre)
        if tail is not None:
            pool.incref(tail)
            self._deferred.append(tail)  # released once the step's copies are taken
            table.append(pool.allocate())
            self._queue_copy(tail, table[-1])
        if num_new_tokens:
            # Blocks from ``first`` on are (re)written: their old hashes no longer describe them.
            del st.hashes[first:]
            st.num_registered = min(st.num_registered, first)
            for i in write:
                old = table[i]
                if i in cow:
                    table[i] = pool.allocate()
                    st.num_sent = min(st.num_sent, i)
                    if i == first and num_computed_tokens % bs:
                        self._queue_copy(old, table[i])
                    self._release(old)
                elif pool.blocks[old].block_hash is not None:
                    self.prefix_cache.remove(old)  # private cached block about to change
        for _ in range(new):
            table.append(pool.allocate())
        return True

    def free_tail(self, seq_id: SeqId, num_tokens: int) -> None:
        """Keep only the blocks that hold the first ``num_tokens`` tokens: slots past them (rejected
        draft tokens) go back to the pool, unhashed."""
        st = self._seq(seq_id)
        table = st.table.block_ids
        keep = -(-num_tokens // self.block_size)
        if keep >= len(table):
            return
        for b in reversed(table[keep:]):
            self._release(b)
        del table[keep:]
        del st.hashes[keep:]
        st.num_registered = min(st.num_registered, keep)
        st.num_sent = min(st.num_sent, keep)

    def take_table_diff(self, seq_id: SeqId) -> tuple[int, list[int]]:
        """What changed in the sequence's table since the last call, for a worker's copy of it:
        ``(keep, new_ids)`` means keep the first ``keep`` entries and append ``new_ids`` (a
        copy-on-write replacement or a swap moves ``keep`` back; growth only appends)."""
        st = self._seq(seq_id)
        table = st.table.block_ids
        keep, st.num_sent = st.num_sent, len(table)
        return keep, table[keep:]

    def take_pending_copies(self) -> BlockPairs:
        """This step's copy-on-write copies as (src, dst) device blocks; ends the step (and saves
        the blocks it evicted to the tiers, before any copy or forward can overwrite them)."""
        self._flush_demotions()
        now = time.perf_counter()
        if self._step_end is not None:  # an idle gap counts as a long step, at most a second
            gap = min(now - self._step_end, 1.0)
            self._step_s = gap if self._step_s is None else 0.8 * self._step_s + 0.2 * gap
        self._step_end = now
        self._waited_s = 0.0
        pairs = [(src, dst) for dst, src in self._pending.items()]
        self._pending.clear()
        self._pending_src.clear()
        for b in self._deferred:
            self.pool.free(b)
        self._deferred.clear()
        self._host_free += self._host_deferred
        self._host_deferred.clear()
        self._swapped_in_now.clear()
        return pairs

    def _queue_copy(self, src: int, dst: int) -> None:
        src = self._pending.get(src, src)  # src itself only gets its content from a pending copy
        self._pending[dst] = src
        self._pending_src[src] = self._pending_src.get(src, 0) + 1

    def _release(self, block_id: int) -> None:
        """Drop one reference held by a table; a block still read by a pending copy waits."""
        b = self.pool.blocks[block_id]
        if b.ref_count == 1:
            if block_id in self._pending_src:
                self._deferred.append(block_id)
                return
            src = self._pending.pop(block_id, None)  # nobody will read this copy's result
            if src is not None:
                self._pending_src[src] -= 1
                if not self._pending_src[src]:
                    del self._pending_src[src]
        self.pool.free(block_id)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child shares every block of the parent (one more reference each)."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        p = self._seq(parent_id)
        if p.host_blocks is not None:
            raise RuntimeError(f"cannot fork swapped-out sequence {parent_id!r}")
        for b in p.table.block_ids:
            self.pool.incref(b)
        self._seqs[child_id] = _Seq(BlockTable(self.block_size, list(p.table.block_ids)), list(p.hashes),
                                    p.num_registered, num_sent=p.num_sent)

    def free(self, seq_id: SeqId) -> None:
        """Release a finished, aborted or recompute-preempted sequence (unknown ids are ignored).
        Its hashed blocks stay findable until handed out again; the tail is freed first so it is
        evicted before the more shareable head."""
        st = self._seqs.pop(seq_id, None)
        if st is None:
            return
        self._drop_host(st)
        for b in reversed(st.table.block_ids):
            self._release(b)

    # ---- swap ----------------------------------------------------------------------------

    def swap_out(self, seq_id: SeqId) -> BlockPairs | None:
        """``swap_out_group([seq_id])``."""
        return self.swap_out_group([seq_id])

    def swap_in(self, seq_id: SeqId) -> BlockPairs | None:
        """``swap_in_group([seq_id])``."""
        return self.swap_in_group([seq_id])

    def _group(self, seq_ids: Sequence[SeqId], swapped: bool) -> list[_Seq]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"duplicate sequence ids in {list(seq_ids)!r}")
        sts = [self._seq(s) for s in seq_ids]
        for sid, st in zip(seq_ids, sts):
            if (st.host_blocks is not None) != swapped:
                raise RuntimeError(f"sequence {sid!r} is {'not ' if swapped else 'already '}swapped out")
        return sts

    def swap_out_group(self, seq_ids: Sequence[SeqId]) -> BlockPairs | None:
        """Move sequences (e.g. all samples or beams of a request) to the host tier, all or
        nothing: returns (device_block, host_block) copies to apply and frees their device
        blocks, or None (nothing changed) if the host tier lacks room. A block shared inside the
        group is copied once and is shared again after ``swap_in_group``; a block also held
        outside the group is copied and comes back private."""
        if self.num_host_blocks == 0:
            raise RuntimeError("no host tier (num_host_blocks=0): preempt by recompute (free) instead")
        sts = self._group(seq_ids, swapped=False)
        for sid in seq_ids:
            if sid in self._swapped_in_now:
                raise RuntimeError(f"sequence {sid!r} was swapped in this step; swap it out next step")
        blocks = list(dict.fromkeys(b for st in sts for b in st.table.block_ids))
        if len(blocks) > len(self._host_free):
            return None
        host_of = {b: self._host_free.pop() for b in blocks}
        # A block whose content is still a pending CoW copy is read from that copy's source.
        pairs = [(self._pending.get(b, b), h) for b, h in host_of.items()]
        for st in sts:
            st.host_blocks = [host_of[b] for b in st.table.block_ids]
            for h in st.host_blocks:
                self._host_ref[h] += 1
            for b in reversed(st.table.block_ids):
                self._release(b)
            st.table.block_ids = []
            st.num_registered = 0
            st.num_sent = 0
        return pairs

    def swap_in_group(self, seq_ids: Sequence[SeqId]) -> BlockPairs | None:
        """Bring swapped-out sequences back, all or nothing: returns (host_block, device_block)
        copies to apply, or None (nothing changed) if there are not enough free device blocks.
        Host blocks shared inside the group come back as one shared device block."""
        sts = self._group(seq_ids, swapped=True)
        hosts = list(dict.fromkeys(h for st in sts for h in st.host_blocks or ()))
        if len(hosts) > self.pool.num_free:
            return None
        dev_of = {h: self.pool.allocate() for h in hosts}
        taken: set[int] = set()
        for sid, st in zip(seq_ids, sts):
            table = [dev_of[h] for h in st.host_blocks or ()]
            for d in table:
                if d in taken:
                    self.pool.incref(d)
                taken.add(d)
            self._drop_host(st)
            st.table.block_ids = table
            st.num_sent = 0
            self._swapped_in_now.add(sid)
        return list(dev_of.items())

    def _drop_host(self, st: _Seq) -> None:
        """Release a swapped sequence's host blocks; they are recycled when the step ends, since
        this step's swap copies may still read or write them."""
        for h in st.host_blocks or ():
            self._host_ref[h] -= 1
            if not self._host_ref[h]:
                self._host_deferred.append(h)
        st.host_blocks = None

    # ---- observability -------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters for metrics; ``free + cached_free + used == num_blocks`` (an allocation can
        take ``free + cached_free`` blocks). Hit rate is by tokens."""
        pc = self.prefix_cache
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "free": self.pool.unhashed.size,
            "cached_free": self.pool.num_cached_free,
            "used": self.pool.num_used,
            "usage": self.usage,
            "num_cached": len(pc),
            "num_seqs": len(self._seqs),
            "num_swapped": sum(s.host_blocks is not None for s in self._seqs.values()),
            "host_blocks": self.num_host_blocks,
            "host_free": len(self._host_free),
            "queries": pc.queries,
            "hits": pc.hits,
            "query_tokens": pc.query_tokens,
            "hit_tokens": pc.hit_tokens,
            "hit_rate": pc.hit_tokens / pc.query_tokens if pc.query_tokens else 0.0,
            "request_hit_rate": pc.hits / pc.queries if pc.queries else 0.0,
            **(self.tiers.describe() if self.tiers is not None else {}),
        }

    def _owners(self) -> dict[int, list[SeqId]]:
        owners: dict[int, list[SeqId]] = {}
        for sid, st in self._seqs.items():
            for b in st.table.block_ids:
                owners.setdefault(b, []).append(sid)
        return owners

    def snapshot(self) -> dict[str, object]:
        """Per-block state for a live dashboard, as plain JSON-ready lists and dicts; hashes are never
        shown (a hash would let anyone test guessed prompts against it)."""
        owners = self._owners()
        blocks = []
        for b in self.pool.blocks:
            state = "used" if b.ref_count else ("cached" if b.block_hash is not None else "free")
            blocks.append({"id": b.block_id, "ref_count": b.ref_count, "state": state,
                           "owners": owners.get(b.block_id, [])})
        return {"stats": self.stats(), "blocks": blocks}

    def check_integrity(self) -> None:
        """Raise AssertionError (with what is wrong) unless: free queues hold exactly the
        unreferenced blocks, free + cached-free + in-use = total, every block's ref_count equals
        the tables holding it (plus pending-copy holds), the prefix index matches the block
        hashes, and every host block is free or held by exactly one swapped sequence."""
        self.pool.check_integrity()
        self.prefix_cache.check_integrity()
        pool = self.pool
        used = sum(b.ref_count > 0 for b in pool.blocks)
        if pool.unhashed.size + pool.cached.size + used != self.num_blocks:
            raise AssertionError(
                f"free {pool.unhashed.size} + cached-free {pool.cached.size} + in-use {used} "
                f"!= total {self.num_blocks}"
            )
        holders = {b: len(o) for b, o in self._owners().items()}
        for b in self._deferred:
            holders[b] = holders.get(b, 0) + 1
        for b in (b for ids in self._pages.values() for b in ids):  # pages: one holder each
            holders[b] = holders.get(b, 0) + 1
        for b in pool.blocks:
            if b.ref_count != holders.get(b.block_id, 0):
                raise AssertionError(
                    f"block {b.block_id} has ref_count {b.ref_count} but {holders.get(b.block_id, 0)} holders"
                )
        for dst, src in self._pending.items():
            if pool.blocks[dst].ref_count < 1 or pool.blocks[src].ref_count < 1:
                raise AssertionError(f"pending copy {src}->{dst} touches a free block")
        held = [0] * self.num_host_blocks
        for sid, st in self._seqs.items():
            if st.host_blocks is not None:
                if st.table.block_ids:
                    raise AssertionError(f"swapped-out sequence {sid!r} still holds device blocks")
                for h in st.host_blocks:
                    held[h] += 1
        if held != self._host_ref:
            raise AssertionError(f"host ref counts {self._host_ref} != swapped tables holding them {held}")
        idle = sorted(self._host_free + self._host_deferred)
        if idle != [h for h, n in enumerate(held) if n == 0]:
            raise AssertionError(f"free host blocks {idle} are not exactly the unheld ones")
        if self.tiers is not None:
            self.tiers.check_integrity()
