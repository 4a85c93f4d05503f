"""Prefix caching over chained block hashes.

A full block's hash covers its parent's hash, its token ids and extra keys (``cache_salt`` and
anything else that changes the KV), so equal blocks after different prefixes never share and
one tenant cannot hit another's blocks. A finished sequence's last, partly filled block (a *tail*:
fewer than ``block_size`` tokens) is indexed too, hashed the same way over its own tokens (the
length is in the digest, so a tail never collides with a full block): a prompt that goes on past
its last full hit finds the tail there holding the longest common prefix with its next tokens (a
chat's next turn: all of it, the last prompt and answer), as SGLang's radix cache keeps every token
where vLLM drops the partial block. A tail is never shared in place: the request that hits it gets
a copy, since it writes the rest of that block. The tiers below the pool find a tail by its hash,
so only whole. Hashes are 128-bit blake2b digests of a stable byte
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
    tail: int | None = None  # a cached tail block right after ``blocks`` (counted in ``num_tokens``): copy it
    tail_hash: int | None = None


class PrefixCache:
    """Index hash -> block over the pool's hashed blocks (in use or cached-free), with
    match / insert / evict / stats / check_integrity like mini-sglang's BasePrefixCache."""

    def __init__(self, pool: BlockPool, key: bytes | None = None) -> None:
        self.pool = pool
        self.key = key  # the hash key (None: the process's HASH_KEY); a persistent disk tier needs a stable one
        self.on_drop: Callable[[Block], None] | None = None  # sees each block before its hash is forgotten
        self._index: dict[int, int] = {}
        # tails by (parent hash, extra keys, first token) and each tail's key: a match past its last full block
        # compares the tokens of the few tails that can continue it (no hashing)
        self._tail_of: dict[int, tuple] = {}
        self._tails: dict[tuple, set[int]] = {}
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
            key = self._tail_of.pop(b.block_hash, None)
            if key is not None:  # tails are not vLLM blocks: no KV events
                group = self._tails[key]
                group.discard(b.block_id)
                if not group:
                    del self._tails[key]
            elif self.on_event is not None:
                self.on_event("removed", b.block_hash)

    def match(self, token_ids: Sequence[int], extra_keys: ExtraKeys = (), record: bool = True) -> PrefixMatch:
        """Longest cached prefix: full blocks up to the first miss, then the longest cached tail there,
        capped so at least one token is left to compute (a full hit would give the model an empty
        query). ``record=False`` leaves the stats alone (a probe, e.g. for cache-aware ordering)."""
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
        tail = self._match_tail(token_ids, num, parent, extra)
        if tail is not None:
            bid, n = tail
            num += n
            if (t := pool_blocks[bid].tier) is not None:
                tiers[t] = tiers.get(t, 0) + n
            if record:
                pool_blocks[bid].hits += 1
        if record:
            self.queries += 1
            self.query_tokens += len(token_ids)
            self.hits += num > 0
            self.hit_tokens += num
        tail_block = tail[0] if tail is not None else None
        return PrefixMatch(blocks, num, hashes, tiers, tail_block,
                           None if tail_block is None else pool_blocks[tail_block].block_hash)

    def _match_tail(self, token_ids: Sequence[int], start: int, parent: int | None,
                    extra: bytes) -> tuple[int, int] | None:
        """The cached tail after ``parent`` sharing the longest prefix with ``token_ids[start:]``, at most
        all but its last token: (block, tokens shared), or None."""
        room = len(token_ids) - 1 - start
        if not self._tails or room <= 0:
            return None
        group = self._tails.get((parent, extra, token_ids[start]))
        if not group:
            return None
        want = token_ids[start:start + min(room, self.pool.block_size - 1)]
        best, best_n = None, 0
        for bid in group:
            n = 0
            for a, b in zip(self.pool.blocks[bid].token_ids, want):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = bid, n
        return None if best is None else (best, best_n)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def insert(self, block_id: int, block_hash: int, token_ids: Sequence[int], depth: int = 0,
               parent_hash: int | None = None, extra_keys: ExtraKeys = ()) -> bool:
        """Register an in-use block (the ``depth``-th of its chain; ``parent_hash``: the chain's previous
        block, and ``extra_keys``: what else its hash covers, for KV events) under ``block_hash``: a full
        block, or a tail (fewer than ``block_size`` tokens, hashed by ``hash_block`` over them). False
        (nothing changes) when the block already has a hash or another block holds this content."""
        b = self.pool.blocks[block_id]
        if b.block_hash is not None or block_hash in self._index:
            return False
        self.pool.set_hash(block_id, block_hash, tuple(token_ids), depth)
        self._index[block_hash] = block_id
        if len(token_ids) < self.pool.block_size:
            key = self._tail_of[block_hash] = (parent_hash, _extra_bytes(extra_keys), token_ids[0])
            self._tails.setdefault(key, set()).add(block_id)
        elif self.on_event is not None:
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
            full = b.token_ids is not None and len(b.token_ids) == self.pool.block_size
            if not full and (not b.token_ids or bid not in self._tails.get(self._tail_of.get(h), ())):
                raise AssertionError(f"cached block {bid} holds neither a full block of token ids nor an indexed tail")
        hashed = sum(b.block_hash is not None for b in self.pool.blocks)
        if hashed != len(self._index):
            raise AssertionError(f"{hashed} hashed blocks but {len(self._index)} indexed")
        if sum(map(len, self._tails.values())) != len(self._tail_of) or not self._tail_of.keys() <= self._index.keys():
            raise AssertionError("the tail index does not match the indexed tails")
