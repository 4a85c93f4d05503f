"""A small pool with KV tiers, and sequences whose blocks hold known K/V, for the tier tests."""

from __future__ import annotations

import torch

from pagedllm.kv import KVCache, KVCacheManager
from pagedllm.kv.disk_tier import DiskTier
from pagedllm.kv.host_tier import HostTier
from pagedllm.kv.tier_policy import make_policy
from pagedllm.kv.tier_store import TierStore

L, H, D, BS = 2, 2, 4, 4
FINGERPRINT = b"f" * 32
KEY = b"k" * 32


def make_tiers(num_blocks: int = 8, host_slots: int = 0, disk_path: str | None = None, disk_bytes: int = 1 << 20,
               policy: str = "lru", dtype: torch.dtype = torch.float32,
               fingerprint: bytes = FINGERPRINT) -> tuple[KVCacheManager, KVCache, TierStore]:
    kv = KVCache(L, H, D, num_blocks, BS, dtype=dtype)
    m = KVCacheManager(num_blocks, BS)
    shape = (L, 2, H, BS, D)
    host = HostTier(host_slots, shape, kv.dtype, make_policy(policy)) if host_slots else None
    disk = DiskTier(disk_path, disk_bytes, fingerprint, make_policy(policy)) if disk_path else None
    per_block = KVCache.bytes_per_block(L, H, D, BS, kv.dtype)
    store = TierStore(shape, kv.dtype, per_block, host, disk)
    m.attach_tiers(store, KEY, kv)
    return m, kv, store


def prompt(seed: int, num_blocks: int) -> list[int]:
    """``num_blocks`` full blocks plus one token (so every block can be a prefix hit)."""
    return [seed * 1000 + i for i in range(num_blocks * BS + 1)]


def fill(m: KVCacheManager, kv: KVCache, seq_id: int, tokens: list[int], cache_salt: str | None = None,
         scales: torch.Tensor | None = None) -> torch.Tensor:
    """Run a sequence over ``tokens`` with random K/V in its blocks (a quantized pool: codes, with
    ``scales``), cache its full blocks, free it; returns the K/V of its full blocks (``[L, 2, H, n, BS, D]``)."""
    assert m.allocate_slots(seq_id, 0, len(tokens))
    table = m.block_table(seq_id)
    data = torch.randn(L, 2, H, len(table), BS, D).mul(20).to(kv.dtype)
    kv.import_blocks(table, {"kv": data} if scales is None else {"kv": data, "scales": scales})
    m.cache_full_blocks(seq_id, tokens, cache_salt)
    m.take_pending_copies()
    m.free(seq_id)
    return data[:, :, :, : len(tokens) // BS]


def evict_all(m: KVCacheManager, seq_id: int = 999) -> None:
    """Take every block (evicting the cached ones, which the tiers save), then give them back unhashed."""
    assert m.allocate_slots(seq_id, 0, m.num_blocks * BS)
    m.take_pending_copies()
    m.free(seq_id)
    m.tiers.flush()  # the copy thread has stored them


def pool_kv(m: KVCacheManager, kv: KVCache, tokens: list[int], cache_salt: str | None = None) -> tuple[int, torch.Tensor]:
    """Blocks of ``tokens`` cached in the pool now, and their K/V."""
    match = m.match_prefix(tokens, cache_salt, record=False)
    if not match.blocks:
        return 0, torch.empty(0)
    return len(match.blocks), kv.export_blocks(match.blocks)["kv"]
