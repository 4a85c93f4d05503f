"""Quantized pools: sizing with scales, describe(), and scales travelling with blocks (CoW, swap, export)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.metadata import AttentionMetadata, write_kv
from pagedllm.attention.reference import gather_sequence_kv
from pagedllm.kv.kv_cache import KVCache, total_memory_bytes

QUANT = ["int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("dims", [(30, 3, 64), (32, 8, 128), (2, 1, 16)])
def test_int8_capacity_ratios_count_scales(dims):
    tokens = {d: KVCache.num_blocks_for_budget(1 << 30, *dims, 16, d) for d in ("float32", "bfloat16", "int8")}
    assert tokens["int8"] >= 3.9 * tokens["float32"] and tokens["int8"] >= 1.95 * tokens["bfloat16"]
    pool = KVCache(*dims, 4, 16, dtype="int8")
    assert pool.data.nbytes + pool.scales.nbytes == 4 * KVCache.bytes_per_block(*dims, 16, "int8")


def test_describe_and_deterministic_default_size():
    d = KVCache(2, 2, 8, 10, 16, dtype="int8").describe()
    assert d["dtype"] == "int8" and d["capacity_tokens"] == 160
    assert d["bytes_per_token"] == 2 * 2 * 2 * (8 * 16 + 4) / 16
    a = KVCache.num_blocks_for_memory_fraction(0.1, 2, 2, 8, 16, "int8")
    assert a == KVCache.num_blocks_for_memory_fraction(0.1, 2, 2, 8, 16, "int8")
    assert a == int(total_memory_bytes() * 0.1) // KVCache.bytes_per_block(2, 2, 8, 16, "int8")
    with pytest.raises(ValueError, match="kv_cache_fraction"):
        KVCache.num_blocks_for_memory_fraction(0, 2, 2, 8, 16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCache(1, 1, 8, 1, 16, dtype="int4")


def _attend(cache: KVCache, table: list[int], seq_len: int, q: torch.Tensor) -> torch.Tensor:
    """Decode of one query at ``seq_len`` over ``table`` without writing (reads only the pool)."""
    meta = AttentionMetadata.build([1], [seq_len], [table], cache.block_size)
    kc, vc = cache.layer(1)
    ki = gather_sequence_kv(kc, meta.block_tables[0], seq_len, cache.block_size, torch.float32)
    vi = gather_sequence_kv(vc, meta.block_tables[0], seq_len, cache.block_size, torch.float32)
    w = torch.softmax(torch.einsum("hd,hsd->hs", q, ki), -1)
    return torch.einsum("hs,hsd->hd", w, vi)


@pytest.mark.parametrize("kv_dtype", QUANT)
def test_copied_swapped_exported_blocks_attend_identically(kv_dtype):
    cache = KVCache(2, 2, 16, 8, 4, dtype=kv_dtype, num_host_blocks=4)
    g = torch.Generator().manual_seed(0)
    table, n = [5, 1, 6], 10
    meta = AttentionMetadata.build([n], [n], [table], 4)
    for i in range(2):
        x = torch.randn(n, 2, 2, 16, generator=g) * (i + 1)
        write_kv(x[:, 0], x[:, 1], *cache.layer(i), meta.slot_mapping)
    q = torch.randn(2, 16, generator=g)
    want = _attend(cache, table, n, q)
    cache.copy_blocks([(5, 0), (1, 2), (6, 3)])
    assert torch.equal(_attend(cache, [0, 2, 3], n, q), want)
    cache.swap_out([(5, 0), (1, 1), (6, 2)])
    cache.data.zero_()
    if cache.dtype == torch.int8:
        cache.scales.zero_()
    cache.swap_in([(0, 7), (1, 4), (2, 5)])
    assert torch.equal(_attend(cache, [7, 4, 5], n, q), want)
    other = KVCache(2, 2, 16, 8, 4, dtype=kv_dtype)
    other.import_blocks([3, 0, 1], cache.export_blocks([7, 4, 5]))
    assert torch.equal(_attend(other, [3, 0, 1], n, q), want)


def test_import_names_the_mismatched_field():
    src = KVCache(1, 1, 8, 4, 4, dtype="int8")
    data = src.export_blocks([0, 1])
    with pytest.raises(ValueError, match="kv"):
        KVCache(1, 1, 8, 4, 4, dtype="float32").import_blocks([0, 1], data)
    with pytest.raises(ValueError, match="scales"):
        KVCache(1, 1, 8, 4, 4, dtype="int8").import_blocks([0, 1], {"kv": data["kv"]})
    fp8 = KVCache(1, 1, 8, 4, 4, dtype="fp8_e4m3")
    exported = fp8.export_blocks([2])
    exported["scales"] = exported["scales"] * 2
    with pytest.raises(ValueError, match="scales"):
        KVCache(1, 1, 8, 4, 4, dtype="fp8_e4m3").import_blocks([0], exported)
