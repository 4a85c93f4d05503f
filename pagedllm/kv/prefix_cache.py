"""Prefix caching over chained block hashes.

A full block's hash covers its parent's hash, its token ids and extra keys (``cache_salt`` and
anything else that changes the KV), so equal blocks after different prefixes never share and
one tenant cannot hit another's blocks. Hashes are 128-bit blake2b digests of a stable byte
encoding, keyed with a secret (``HASH_KEY``): random per process, so nobody who sees a hash can test
guessed prompts against it; processes that must agree on hashes (tensor-parallel ranks, replicas
sharing prefix KV) set the same ``PAGEDLLM_HASH_KEY``. A hit still compares the stored token ids,
so a collision can never serve wrong KV. Hashes are never shown outside the engine.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedllm.kv.block_pool import Block, BlockPool

ExtraKeys = tuple[object, ...]
HASH_KEY_ENV = "PAGEDLLM_HASH_KEY"


def hash_key() -> bytes:
    """The blake2b key: derived from ``$PAGEDLLM_HASH_KEY`` (any string) when set, else random."""
    secret = os.environ.get(HASH_KEY_ENV)
    if not secret:
        return secrets.token_bytes(32)
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"pagedllm-hkey").digest()


HASH_KEY = hash_key()


def extra_keys_for(cache_salt: str | None, lora_id: int = 0) -> ExtraKeys:
    """Extra hash keys of a request: its optional tenant salt and its LoRA adapter (an adapter changes every
    layer's K/V, so blocks are never shared across adapters or with the base model)."""
    keys = () if cache_salt is None else (("cache_salt", cache_salt),)
    return keys + (("lora", lora_id),) if lora_id else keys


def _extra_bytes(extra_keys: ExtraKeys) -> bytes:
    # repr of str/int/tuple values is stable; only those belong in extra keys.
    return repr(extra_keys).encode() if extra_keys else b""


def _digest(parent_hash: int | None, token_bytes: bytes, extra: bytes, key: bytes | None = None) -> int:
    head = b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(16, "little")
    data = head + len(token_bytes).to_bytes(4, "little") + token_bytes + extra
    return int.from_bytes(hashlib.blake2b(data, digest_size=16, key=key or HASH_KEY).digest(), "little")


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return array("q", token_ids).tobytes()


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_keys: ExtraKeys = (),
               key: bytes | None = None) -> int:
    """Hash of one full block given its parent's hash (None for the first block); ``key``
    defaults to the process's ``HASH_KEY``."""
    return _digest(parent_hash, _token_bytes(token_ids), _extra_bytes(extra_keys), key)


def hash_block_chain(
    parent_hash: int | None, token_ids: Sequence[int], block_size: int, extra_keys: ExtraKeys = (),
    key: bytes | None = None,
) -> list[int]:
    """Hashes of the consecutive full blocks in ``token_ids`` (a trailing partial block is
    ignored), chained from ``parent_hash``; encodes the tokens once for the whole run."""
    n = len(token_ids) // block_size
    buf = _token_bytes(token_ids[: n * block_size])
    extra = _extra_bytes(extra_keys)
    step = block_size * 8
    out: list[int] = []
    for i in range(n):
        parent_hash = _digest(parent_hash, buf[i * step : (i + 1) * step], extra, key)
        out.append(parent_hash)
    return out


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Cached blocks covering the first ``num_tokens`` tokens of a prompt; no references taken."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[int] = field(default_factory=list)  # chain hashes of ``blocks``, reused later
    # of ``num_tokens``, those in blocks promoted from a tier below the pool and not taken since ("host", "disk")
    tier_tokens: dict[str, int] = field(default_factory=dict)


class PrefixCache:
    """Index hash -> block over the pool's hashed blocks (in use or cached-free), with
    match / insert / evict / stats / check_integrity like mini-sglang's BasePrefixCache."""

    def __init__(self, pool: BlockPool, key: bytes | None = None) -> None:
        self.pool = pool
        self.key = key  # the hash key (None: the process's HASH_KEY); a persistent disk tier needs a stable one
        self.on_drop: Callable[[Block], None] | None = None  # sees each block before its hash is forgotten
        self._index: dict[int, int] = {}
        pool.on_evict = self._forget
        # KV events (kv/kv_events.py): ("stored", hash, parent hash, token ids, extra keys) or ("removed", hash)
        self.on_event: Callable[..., None] | None = None
        self.queries = 0
        self.hits = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._index)

    def _forget(self, b: Block, evicted: bool) -> None:
        if evicted and self.on_drop is not None:
            self.on_drop(b)
        if b.block_hash is not None and self._index.get(b.block_hash) == b.block_id:
            del self._index[b.block_hash]
            if self.on_event is not None:
                self.on_event("removed", b.block_hash)

    def match(self, token_ids: Sequence[int], extra_keys: ExtraKeys = (), record: bool = True) -> PrefixMatch:
        """Longest cached prefix at block granularity, capped so at least one token is left to
        compute (a full hit would give the model an empty query). Stops at the first miss.
        ``record=False`` leaves the stats alone (a probe, e.g. for cache-aware ordering)."""
        bs = self.pool.block_size
        extra = _extra_bytes(extra_keys)
        pool_blocks, index = self.pool.blocks, self._index
        blocks, hashes = [], []
        tiers: dict[str, int] = {}
        parent: int | None = None
        for i in range(max(len(token_ids) - 1, 0) // bs):
            chunk = token_ids[i * bs : (i + 1) * bs]
            h = _digest(parent, _token_bytes(chunk), extra, self.key)
            bid = index.get(h)
            if bid is None or pool_blocks[bid].token_ids != tuple(chunk):
                break
            blocks.append(bid)
            hashes.append(h)
            parent = h
            if (t := pool_blocks[bid].tier) is not None:
                tiers[t] = tiers.get(t, 0) + bs
            if record:
                pool_blocks[bid].hits += 1
        num = len(blocks) * bs
        if record:
            self.queries += 1
            self.query_tokens += len(token_ids)
            self.hits += num > 0
            self.hit_tokens += num
        return PrefixMatch(blocks, num, hashes, tiers)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def insert(self, block_id: int, block_hash: int, token_ids: Sequence[int], depth: int = 0,
               parent_hash: int | None = None, extra_keys: ExtraKeys = ()) -> bool:
        """Register an in-use full block (the ``depth``-th of its chain; ``parent_hash``: the chain's previous
        block, and ``extra_keys``: what else its hash covers, for KV events) under ``block_hash``. False
        (nothing changes) when the block already has a hash or another block holds this content."""
        b = self.pool.blocks[block_id]
        if b.block_hash is not None or block_hash in self._index:
            return False
        self.pool.set_hash(block_id, block_hash, tuple(token_ids), depth)
        self._index[block_hash] = block_id
        if self.on_event is not None:
            self.on_event("stored", block_hash, parent_hash, tuple(token_ids), extra_keys)
        return True

    def remove(self, block_id: int) -> None:
        """Unregister a block whose content is about to be overwritten (or was never written): not an
        eviction, so ``on_drop`` does not see it."""
        self.pool.drop_hash(self.pool.blocks[block_id], evicted=False)

    def evict(self, num_blocks: int, demote: bool = True) -> int:
        """Forget the hashes of up to ``num_blocks`` cached-free blocks in the pool's eviction order; returns
        how many were evicted (``demote=False``: ``on_drop`` does not see them, they are discarded). Allocation
        also evicts lazily; this frees index memory early."""
        n = 0
        while n < num_blocks and self.pool.cached.size:
            self.pool.drop_hash(self.pool.victim(), demote)
            n += 1
        return n

    def stats(self) -> dict[str, float]:
        return {
            "queries": self.queries,
            "hits": self.hits,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "num_cached": len(self._index),
        }

    def check_integrity(self) -> None:
        """Raise AssertionError unless index and block hashes agree one to one."""
        for h, bid in self._index.items():
            b = self.pool.blocks[bid]
            if b.block_hash != h:
                raise AssertionError(f"the index maps a hash to block {bid}, which holds another hash")
            if b.token_ids is None or len(b.token_ids) != self.pool.block_size:
                raise AssertionError(f"cached block {bid} does not hold a full block of token ids")
        hashed = sum(b.block_hash is not None for b in self.pool.blocks)
        if hashed != len(self._index):
            raise AssertionError(f"{hashed} hashed blocks but {len(self._index)} indexed")
