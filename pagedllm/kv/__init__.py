"""Paged KV cache: block pool, prefix cache, block tables, the scheduler-facing manager, and the
pool tensors."""

from pagedllm.kv.block_pool import Block, BlockPool, FreeBlockQueue
from pagedllm.kv.block_table import BlockTable, slot_mapping
from pagedllm.kv.kv_cache import KVCache
from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.kv.prefix_cache import PrefixCache, PrefixMatch, hash_block

__all__ = [
    "Block",
    "BlockPool",
    "BlockTable",
    "FreeBlockQueue",
    "KVCache",
    "KVCacheManager",
    "PrefixCache",
    "PrefixMatch",
    "hash_block",
    "slot_mapping",
]
