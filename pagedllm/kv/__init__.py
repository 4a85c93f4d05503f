"""Paged KV cache: block pool, prefix cache, block tables, the scheduler-facing manager, and the
pool tensors."""

from pagedllm.kv.kv_cache import KVCache

__all__ = ["KVCache"]
