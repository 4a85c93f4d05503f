"""What a worker built, told to the engine core once at start: the pool's size and what it holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVCacheSpec:
    """What the worker's pool holds, for the core's KV manager."""

    num_blocks: int
    num_host_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    model_name: str
    quantization: str
    dtype: str
    kv_dtype: str
    backend: str
    device: str
    kv_pool: dict  # KVCache.describe(): dtype, bytes per token (scales included), capacity in tokens
