"""Build the KV tiers an engine's arguments ask for, and the model fingerprint the disk tier keys on."""

from __future__ import annotations

import hashlib
import os

import torch

from pagedllm.config.args import EngineArgs
from pagedllm.kv.disk_tier import DiskTier, directory_hash_key
from pagedllm.kv.host_tier import HostTier
from pagedllm.kv.kv_cache import KVCache
from pagedllm.kv.pool_blocks import PoolBlocks
from pagedllm.kv.prefix_cache import HASH_KEY_ENV
from pagedllm.kv.tier_policy import make_policy
from pagedllm.kv.tier_store import TierStore
from pagedllm.protocol.kv_spec import KVCacheSpec


def model_fingerprint(args: EngineArgs, spec: KVCacheSpec, kv_cache: PoolBlocks) -> bytes:
    """32 bytes naming what a block's K/V depends on: the weights (path, size and mtime of the files),
    quantization, dtype, KV dtype, block size, pool shape and TP layout."""
    parts = [spec.model_name, spec.quantization, spec.dtype, spec.kv_dtype, str(kv_cache.block_size),
             str((kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim)), f"tp={args.tensor_parallel_size}"]
    if args.model and os.path.exists(args.model):
        root = os.path.realpath(args.model)
        files = [root] if os.path.isfile(root) else sorted(
            os.path.join(root, f) for f in os.listdir(root) if f.endswith((".safetensors", ".bin", ".gguf", ".json")))
        for f in files:
            st = os.stat(f)
            parts.append(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=32).digest()


def build_tiers(args: EngineArgs, spec: KVCacheSpec,
                kv_cache: PoolBlocks | None) -> tuple[TierStore, bytes | None] | None:
    """The tier store for ``--kv-offload-memory`` / ``--kv-disk-path`` (None when neither is set) and the
    hash key the manager must use (the disk directory's, unless ``$PAGEDLLM_HASH_KEY`` is set). ``kv_cache``:
    the pool's blocks (``Executor.tier_blocks``), None where the executor cannot copy them (then ValueError)."""
    if args.kv_offload_memory < 0:
        raise ValueError(f"kv_offload_memory: must be >= 0 bytes, got {args.kv_offload_memory}")
    if not args.kv_offload_memory and not args.kv_disk_path:
        return None
    if kv_cache is None:
        raise ValueError("kv_offload_memory / kv_disk_path: KV tiers need an executor that copies the pool's "
                         "blocks: distributed_executor_backend 'uni' or 'mp' (any tensor_parallel_size), "
                         "not 'external_launcher'")
    if not args.enable_prefix_caching:
        raise ValueError("kv_offload_memory / kv_disk_path: KV tiers need enable_prefix_caching")
    per_block = KVCache.bytes_per_block(kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim,
                                        kv_cache.block_size, kv_cache.dtype)
    block_shape = (kv_cache.num_layers, 2, kv_cache.num_kv_heads, kv_cache.block_size, kv_cache.head_dim)
    device = kv_cache.device
    make_policy(args.kv_eviction)  # a bad name fails before any tier is made
    host = None
    if args.kv_offload_memory:
        slots = args.kv_offload_memory // per_block
        if slots < 1:
            raise ValueError(f"kv_offload_memory: {args.kv_offload_memory} bytes hold no block of {per_block} bytes")
        host = HostTier(slots, block_shape, kv_cache.dtype, make_policy(args.kv_eviction, slots),
                        pin_memory=device.type == "cuda" and torch.cuda.is_available())
    disk, key = None, None
    if args.kv_disk_path:
        if args.kv_disk_size <= 0:
            raise ValueError(f"kv_disk_size: must be > 0 bytes, got {args.kv_disk_size}")
        disk = DiskTier(args.kv_disk_path, args.kv_disk_size, model_fingerprint(args, spec, kv_cache),
                        make_policy(args.kv_eviction, args.kv_disk_size // per_block))
        key = None if os.environ.get(HASH_KEY_ENV) else directory_hash_key(args.kv_disk_path)
    return TierStore(block_shape, kv_cache.dtype, per_block, host, disk, device), key
