"""Unit tests of the paged KV core: pool, hashing, block tables, KV tensors, manager, seeds."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pagedllm.config.args import EngineArgs
from pagedllm.kv import Block, BlockPool, BlockTable, FreeBlockQueue, KVCache, KVCacheManager, hash_block, slot_mapping
from pagedllm.kv.prefix_cache import PrefixCache, PrefixMatch, hash_block_chain

# ---- block pool ---------------------------------------------------------------------------


@pytest.mark.parametrize("bs", [0, 3, 12, 512, -16, 1.0, "16"])
def test_block_size_must_be_power_of_two(bs) -> None:
    with pytest.raises(ValueError, match="power of two"):
        BlockPool(8, bs)
    with pytest.raises(ValueError, match="block_size must be a power of two"):  # at the engine's arguments, before
        EngineArgs(block_size=bs)  # the worker divides by it (0 was a ZeroDivisionError from LLM(block_size=0))


@pytest.mark.parametrize("bs", [1, 2, 16, 256])
def test_block_size_accepted(bs: int) -> None:
    assert KVCacheManager(4, bs).block_size == bs


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, 16)


def test_free_queue_o1_remove_from_middle() -> None:
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not queued
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_bad_free_raises_and_leaves_pool_intact() -> None:
    pool = BlockPool(4, 16)
    b = pool.allocate()
    pool.free(b)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(b)  # double free
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(3)  # never handed out
    with pytest.raises(ValueError, match="out of range"):
        pool.free(4)
    pool.check_integrity()
    assert pool.num_free == 4


def test_unhashed_blocks_are_handed_out_before_cached_ones_lru() -> None:
    pool = BlockPool(4, 1)
    pc = PrefixCache(pool)
    ids = pool.allocate_many(4)
    for i in ids[:2]:
        pc.insert(i, hash_block(None, [i]), [i])
    pool.free(ids[1])  # cached, freed first -> evicted first
    pool.free(ids[0])  # cached
    pool.free(ids[2])  # unhashed
    assert pool.num_cached_free == 2
    assert pc.match([1, 99]).blocks == [1]  # a freed block stays findable
    assert pool.allocate() == ids[2]  # unhashed first
    assert pool.allocate() == ids[1]  # then the least recently freed cached block...
    assert pc.match([1, 99]).blocks == []  # ...whose hash is gone (lazy eviction)
    assert pc.match([0, 99]).blocks == [0]
    pool.incref(0)  # a prefix hit revives a cached-free block
    assert pool.num_free == 0 and pool.blocks[0].ref_count == 1
    pool.check_integrity()
    pc.check_integrity()


def test_pool_exhaustion_raises() -> None:
    pool = BlockPool(2, 16)
    with pytest.raises(RuntimeError):
        pool.allocate_many(3)
    assert pool.num_free == 2


# ---- hashing ------------------------------------------------------------------------------


def test_hash_chain_is_deterministic_and_consistent() -> None:
    toks = list(range(40))
    chain = hash_block_chain(None, toks, 16)
    assert len(chain) == 2  # the partial third block is not hashed
    assert chain[0] == hash_block(None, toks[:16])
    assert chain[1] == hash_block(chain[0], toks[16:32])
    assert hash_block(None, toks[:16]) == hash_block(None, tuple(toks[:16]))
    assert hash_block(None, toks[:16], (("cache_salt", "a"),)) != chain[0]


def test_different_first_block_gives_different_hashes_for_identical_later_blocks() -> None:
    bs = 4
    a = [1, 2, 3, 4] + [9, 9, 9, 9] + [5]
    b = [1, 2, 3, 5] + [9, 9, 9, 9] + [5]
    ha, hb = hash_block_chain(None, a, bs), hash_block_chain(None, b, bs)
    assert ha[0] != hb[0] and ha[1] != hb[1]
    m = KVCacheManager(8, bs)
    assert m.allocate_slots("a", 0, len(a))
    m.cache_full_blocks("a", a)
    assert m.match_prefix(b).num_tokens == 0  # identical second block, different context: no hit


def test_cache_salt_never_hits_across_tenants() -> None:
    toks = list(range(33))
    m = KVCacheManager(8, 16)
    assert m.allocate_slots("a", 0, 33)
    m.cache_full_blocks("a", toks, cache_salt="tenant-a")
    assert m.match_prefix(toks, cache_salt="tenant-a").num_tokens == 32
    assert m.match_prefix(toks, cache_salt="tenant-b").num_tokens == 0
    assert m.match_prefix(toks).num_tokens == 0


def test_hit_verifies_token_ids() -> None:
    pool = BlockPool(2, 2)
    pc = PrefixCache(pool)
    b = pool.allocate()
    h = hash_block(None, [1, 2])
    assert pc.insert(b, h, [7, 7])  # pretend a collision: stored tokens differ
    assert pc.match([1, 2, 3]).num_tokens == 0


# ---- block tables -------------------------------------------------------------------------


def test_seed_004_slot_mapping() -> None:
    t = BlockTable(16, [5, 12, 3])
    slots = t.slot_mapping(0, 35).tolist()
    assert len(slots) == 35
    assert {0: slots[0], 15: slots[15], 16: slots[16], 31: slots[31], 32: slots[32], 34: slots[34]} == {
        0: 80, 15: 95, 16: 192, 31: 207, 32: 48, 34: 50
    }
    assert all(t.slot(p) == s for p, s in enumerate(slots))


def test_batched_slot_mapping_matches_per_token_reference() -> None:
    rng = random.Random(0)
    bs = 8
    tables, starts, nums = [], [], []
    for _ in range(64):
        nb = rng.randint(0, 6)
        tables.append(rng.sample(range(100), nb))
        start = rng.randint(0, nb * bs)
        starts.append(start)
        nums.append(rng.randint(0, nb * bs - start))
    got = slot_mapping(tables, starts, nums, bs)
    want = [t[p // bs] * bs + p % bs for t, s, n in zip(tables, starts, nums) for p in range(s, s + n)]
    assert got.dtype == torch.int64 and got.tolist() == want


def test_slot_mapping_rejects_positions_beyond_table() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        slot_mapping([[1, 2]], [30], [3], 16)
    with pytest.raises(ValueError):
        slot_mapping([[1]], [0, 1], [1], 16)


# ---- KV tensors ---------------------------------------------------------------------------


def test_kv_cache_layout_copies_and_swap() -> None:
    c = KVCache(num_layers=2, num_kv_heads=3, head_dim=4, num_blocks=6, block_size=2, num_host_blocks=3)
    assert c.data.shape == (2, 2, 3, 12, 4) and c.host is not None and c.host.shape == (2, 2, 3, 6, 4)
    k, v = c.layer(1)
    assert k.shape == (3, 12, 4) and k.data_ptr() == c.data[1, 0].data_ptr()
    c.data.copy_(torch.randn_like(c.data))
    before = c.data.clone()
    blk = lambda t, b: t[..., b * 2 : (b + 1) * 2, :]  # noqa: E731
    c.copy_blocks([(1, 4), (4, 5)])  # gather before scatter: 5 gets 4's old content
    assert torch.equal(blk(c.data, 4), blk(before, 1)) and torch.equal(blk(c.data, 5), blk(before, 4))
    c.swap_out([(4, 0), (2, 2)])
    c.data.zero_()
    c.swap_in([(0, 1), (2, 3)])
    assert torch.equal(blk(c.data, 1), blk(before, 1)) and torch.equal(blk(c.data, 3), blk(before, 2))
    c.copy_blocks([])
    now = c.data.clone()
    c.copy_blocks([(3, 0), (0, 3), (2, 5)])  # a swap of two blocks (each reads the other's old content) and a copy
    assert torch.equal(blk(c.data, 0), blk(now, 3)) and torch.equal(blk(c.data, 3), blk(now, 0))
    assert torch.equal(blk(c.data, 5), blk(now, 2)) and torch.equal(blk(c.data, 2), blk(now, 2))


def test_kv_cache_sizing() -> None:
    per = KVCache.bytes_per_block(32, 8, 128, 16, torch.float16)
    assert per == 2 * 32 * 8 * 128 * 16 * 2
    assert KVCache.num_blocks_for_budget(10 * per + per - 1, 32, 8, 128, 16, torch.float16) == 10
    assert KVCache.num_blocks_for_memory_fraction(0.01, 1, 1, 8, 16) > 0
    with pytest.raises(ValueError):
        KVCache.num_blocks_for_memory_fraction(1.5, 1, 1, 8, 16)
    with pytest.raises(RuntimeError, match="no host tier"):
        KVCache(1, 1, 2, 2, 2).swap_out([(0, 0)])


# ---- manager: seed examples ---------------------------------------------------------------


def test_seed_001_beam_search_shares_the_prompt() -> None:
    m = KVCacheManager(64, 16)
    assert m.allocate_slots(0, 0, 64)
    for beam in (1, 2, 3):
        m.fork(0, beam)
    assert all(m.pool.blocks[b].ref_count == 4 for b in m.block_table(0))
    for beam in range(4):  # each beam appends 10 tokens at the block boundary: no CoW, 1 new block
        assert m.allocate_slots(beam, 64, 10)
    assert m.take_pending_copies() == []
    assert m.pool.num_used == 4 + 4 * 1  # vs 4 beams x 5 blocks = 20 without sharing
    for beam in range(4):  # 10 more each: 84 tokens = 6 blocks, 2 private per beam
        assert m.allocate_slots(beam, 74, 10)
    assert m.pool.num_used == 12  # the seed's "4 shared + 4 beams x 2 new = 12, not 16"
    m.check_integrity()


def test_seed_004_three_requests_share_a_48_token_system_prompt() -> None:
    system = list(range(1000, 1048))
    m = KVCacheManager(32, 16)
    prompts = [system + [1, 2, 3], system + [4, 5], system + [6, 7, 8, 9]]
    assert m.allocate_slots("r0", 0, len(prompts[0]))
    m.cache_full_blocks("r0", prompts[0])
    for i in (1, 2):
        hit = m.match_prefix(prompts[i])
        assert hit.num_tokens == 48 and hit.blocks == m.block_table("r0")[:3]
        assert m.allocate_slots(f"r{i}", hit.num_tokens, len(prompts[i]) - 48, prefix=hit)
    shared = m.block_table("r0")[:3]
    assert all(m.block_table(f"r{i}")[:3] == shared for i in range(3))
    assert [m.pool.blocks[b].ref_count for b in shared] == [3, 3, 3]
    assert m.pool.num_used == 3 + 3  # 3 shared prompt blocks + 1 own block each (vs 12)
    s = m.stats()
    assert (s["queries"], s["hits"], s["hit_tokens"]) == (2, 2, 96)
    m.check_integrity()
    for i in range(3):
        m.free(f"r{i}")
    assert m.stats()["cached_free"] == 3 and m.match_prefix(prompts[0]).num_tokens == 48


def test_full_prompt_hit_is_capped_to_leave_one_token() -> None:
    toks = list(range(48))
    m = KVCacheManager(8, 16)
    assert m.allocate_slots("a", 0, 48)
    m.cache_full_blocks("a", toks)
    assert m.match_prefix(toks).num_tokens == 32
    assert m.match_prefix(toks[:1]).num_tokens == 0 and m.match_prefix([]).num_tokens == 0


# ---- manager: semantics and bad input -----------------------------------------------------


def test_allocation_is_all_or_nothing() -> None:
    m = KVCacheManager(5, 4)
    assert m.allocate_slots("a", 0, 12)
    assert not m.allocate_slots("b", 0, 12)
    assert not m.has_seq("b") and m.num_free_blocks == 2
    assert m.allocate_slots("b", 0, 4)
    assert not m.allocate_slots("a", 12, 8)  # needs 2 blocks, 1 free
    assert m.block_table("a") == [0, 1, 2] and m.num_free_blocks == 1
    m.check_integrity()


def test_pool_smaller_than_one_sequence_raises() -> None:
    m = KVCacheManager(4, 16)
    with pytest.raises(ValueError, match="pool has only 4 blocks"):
        m.allocate_slots("a", 0, 65)
    assert m.num_free_blocks == 4


def test_prefix_misuse_and_stale_prefix() -> None:
    toks = list(range(20))
    m = KVCacheManager(2, 16)
    assert m.allocate_slots("a", 0, 20)
    m.cache_full_blocks("a", toks)
    hit = m.match_prefix(toks)
    with pytest.raises(ValueError, match="prefix.num_tokens"):
        m.allocate_slots("b", 0, 20, prefix=hit)
    with pytest.raises(ValueError, match="first allocation"):
        m.allocate_slots("a", 16, 4, prefix=hit)
    m.free("a")
    assert m.allocate_slots("c", 0, 32)  # hands out the cached block: the match is now stale
    assert not m.allocate_slots("b", 16, 4, prefix=hit)
    assert not m.has_seq("b")
    with pytest.raises(ValueError):
        m.allocate_slots("c", 0, -1)
    m.check_integrity()


def test_fork_then_write_into_shared_partial_block_copies_on_write() -> None:
    m = KVCacheManager(8, 4)
    assert m.allocate_slots("p", 0, 6)
    m.fork("p", "c")
    assert m.allocate_slots("c", 6, 1)
    tail_p, tail_c = m.block_table("p")[1], m.block_table("c")[1]
    assert tail_p != tail_c and m.block_table("p")[0] == m.block_table("c")[0]
    assert m.take_pending_copies() == [(tail_p, tail_c)]
    assert m.take_pending_copies() == []
    with pytest.raises(ValueError, match="already exists"):
        m.fork("p", "c")
    with pytest.raises(KeyError):
        m.fork("nope", "x")
    m.free("nope")  # unknown ids are ignored (aborted before admission)
    m.check_integrity()


def test_cow_source_freed_in_the_same_step_is_not_reused_by_a_swap_in() -> None:
    """Hazard: the last holder of a CoW source leaves and a swap-in of the same step would take
    that block. With the documented order (swap_out, swap_in, CoW) the data must stay right."""
    bs = 2
    m = KVCacheManager(4, bs, num_host_blocks=2)
    kv = KVCache(1, 1, 1, 4, bs, num_host_blocks=2)
    slots = kv.data[0, 0, 0, :, 0]
    assert m.allocate_slots("s", 0, 2)
    slots[m.block_table("s")[0] * bs : m.block_table("s")[0] * bs + 2] = torch.tensor([5.0, 6.0])
    assert m.swap_out("s") is not None
    kv.swap_out([(0, 0)])
    m.take_pending_copies()
    assert m.allocate_slots("p", 0, 1)
    p0 = m.block_table("p")[0]
    slots[p0 * bs] = 1.0
    m.fork("p", "c")
    assert m.allocate_slots("c", 1, 1)  # CoW of p0 -> c0
    m.free("p")  # p0's last table reference goes while the copy is pending
    assert m.num_free_blocks == 2  # p0 is held until take_pending_copies()
    swap_in = m.swap_in("s")
    assert swap_in is not None and p0 not in [d for _, d in swap_in]
    kv.swap_in(swap_in)
    kv.copy_blocks(m.take_pending_copies())
    c0 = m.block_table("c")[0]
    assert slots[c0 * bs].item() == 1.0
    m.check_integrity()


def test_swap_roundtrip_and_limits() -> None:
    m = KVCacheManager(6, 4, num_host_blocks=2)
    assert m.allocate_slots("a", 0, 8)
    assert m.allocate_slots("b", 0, 12)  # 3 blocks: does not fit the 2 host blocks
    assert m.swap_out("b") is None and m.block_table("b") != []
    out = m.swap_out("a")
    assert out is not None and [d for d, _ in out] == [0, 1] and m.is_swapped("a")
    assert m.block_table("a") == [] and m.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        m.allocate_slots("a", 8, 1)
    with pytest.raises(RuntimeError):
        m.swap_out("a")
    with pytest.raises(RuntimeError):
        m.swap_in("b")
    assert m.allocate_slots("c", 0, 5)  # leaves 1 free block
    assert m.swap_in("a") is None  # not enough device blocks: nothing changes
    m.free("c")
    back = m.swap_in("a")
    assert back is not None and [h for h, _ in back] == [h for _, h in out]
    with pytest.raises(RuntimeError, match="swapped in this step"):
        m.swap_out("a")
    m.take_pending_copies()
    m.check_integrity()
    with pytest.raises(RuntimeError, match="no host tier"):
        KVCacheManager(4, 4).swap_out("x")


def test_check_integrity_detects_corruption() -> None:
    m = KVCacheManager(4, 4)
    assert m.allocate_slots("a", 0, 5)
    m.check_integrity()
    m.pool.blocks[0].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count 2 but 1 holders"):
        m.check_integrity()
    m.pool.blocks[0].ref_count -= 1
    m._seqs["a"].table.block_ids.pop()  # a leaked block: held but owned by nobody
    with pytest.raises(AssertionError, match="holders"):
        m.check_integrity()


def test_snapshot_and_stats_are_json_ready() -> None:
    toks = list(range(10))
    m = KVCacheManager(6, 4, num_host_blocks=1)
    assert m.allocate_slots(7, 0, 10)
    m.cache_full_blocks(7, toks)
    m.fork(7, 8)
    snap = m.snapshot()
    json.dumps(snap)
    states = [b["state"] for b in snap["blocks"]]
    assert states == ["used"] * 3 + ["free"] * 3
    assert snap["blocks"][0]["owners"] == [7, 8] and snap["blocks"][0]["ref_count"] == 2
    assert all("hash" not in b for b in snap["blocks"])  # hashes are never shown
    m.free(7)
    m.free(8)
    s = m.stats()
    assert s["free"] + s["cached_free"] + s["used"] == s["num_blocks"] and s["cached_free"] == 2
    assert m.usage == 0.0 and m.num_cached_blocks == 2
    assert m.blocks_needed(None, 17) == 5 and m.blocks_needed("x", 0) == 0


def test_prefix_caching_disabled() -> None:
    m = KVCacheManager(4, 4, enable_prefix_caching=False)
    assert m.allocate_slots("a", 0, 9)
    m.cache_full_blocks("a", list(range(9)))
    assert m.match_prefix(list(range(9))) == PrefixMatch() and m.num_cached_blocks == 0


def test_group_swap_keeps_sharing_and_is_all_or_nothing() -> None:
    m = KVCacheManager(8, 4, num_host_blocks=4)
    assert m.allocate_slots("p", 0, 8)
    m.fork("p", "c")
    assert m.allocate_slots("c", 8, 1)  # c: [b0, b1, own]; p: [b0, b1]
    assert m.allocate_slots("x", 0, 8)
    assert m.swap_out_group(["p", "c", "x"]) is None  # 5 distinct blocks > 4 host blocks
    assert not m.is_swapped("p") and not m.is_swapped("x")
    out = m.swap_out_group(["p", "c"])
    assert out is not None and len(out) == 3 and m.num_free_host_blocks == 1
    m.take_pending_copies()
    back = m.swap_in_group(["p", "c"])
    assert back is not None and len(back) == 3
    p, c = m.block_table("p"), m.block_table("c")
    assert p == c[:2] and [m.pool.blocks[b].ref_count for b in c] == [2, 2, 1]
    with pytest.raises(ValueError, match="duplicate"):
        m.swap_out_group(["x", "x"])
    m.check_integrity()
    m.take_pending_copies()
    assert m.swap_out_group(["p"]) is not None  # shared with c outside the group: copied
    m.free("p")
    m.free("c")
    m.free("x")
    m.take_pending_copies()
    m.check_integrity()
    assert m.pool.num_used == 0 and m.num_free_host_blocks == 4


def test_probe_match_does_not_count_in_stats() -> None:
    toks = list(range(20))
    m = KVCacheManager(8, 4)
    assert m.allocate_slots("a", 0, 20)
    m.cache_full_blocks("a", toks)
    assert m.match_prefix(toks, record=False).num_tokens == 16
    assert m.stats()["queries"] == 0
    assert m.match_prefix(toks).num_tokens == 16 and m.stats()["queries"] == 1
