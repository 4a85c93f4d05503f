"""Eviction policies of the KV tiers."""

from __future__ import annotations

import pytest

from pagedllm.kv.tier_policy import LRUPolicy, ReusePolicy, make_policy


def test_lru_evicts_least_recently_touched():
    p = LRUPolicy()
    for k in "abcd":
        p.touch(k)
    p.touch("a")
    assert p.victims(2) == ["b", "c"]
    p.remove("b")
    assert p.victims(1) == ["c"] and len(p) == 3


def test_reuse_keeps_frequent_blocks_that_lru_would_drop():
    p, lru = ReusePolicy(half_life=100), LRUPolicy()
    for pol in (p, lru):
        for _ in range(5):
            pol.touch("hot")
        for k in ("c1", "c2", "c3"):
            pol.touch(k, depth=5)
    assert lru.victims(1) == ["hot"]
    assert "hot" not in p.victims(2)


def test_reuse_prefers_shallow_blocks_at_equal_frequency():
    p = ReusePolicy()
    p.touch("deep", depth=20)
    p.touch("root", depth=0)
    p.touch("deep2", depth=20)
    assert set(p.victims(2)) == {"deep", "deep2"}


def test_reuse_decays_old_hits():
    p = ReusePolicy(half_life=4, depth_weight=0.0)
    for _ in range(3):
        p.touch("old")
    for i in range(40):
        p.touch(f"new{i}")
    assert p.score("old") < 0.01 < p.score("new39")  # three hits long ago count less than one just now


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_eviction"):
        make_policy("mru")


def test_reuse_admission_keeps_a_one_off_block_out():
    import torch

    from pagedllm.kv.host_tier import HostTier

    shape = (1, 2, 1, 2, 2)
    tier = HostTier(2, shape, torch.float32, ReusePolicy())
    data = {"kv": torch.arange(16, dtype=torch.float32).view(1, 2, 1, 2, 2, 2)}
    tier.put([1, 2], [(1,), (2,)], [3, 3], [9, 9], data)  # two popular blocks fill the tier
    spill = tier.put([3], [(3,)], [3], [1], {"kv": data["kv"][:, :, :, :1]})
    assert spill.hashes == [3] and torch.equal(spill.data["kv"], data["kv"][:, :, :, :1])  # a one-off stays out
    assert not tier.contains(3, (3,)) and tier.contains(1, (1,))
    lru = HostTier(2, shape, torch.float32, LRUPolicy())
    lru.put([1, 2], [(1,), (2,)], [3, 3], [9, 9], data)
    spill = lru.put([3], [(3,)], [3], [1], {"kv": data["kv"][:, :, :, :1]})  # LRU always admits ...
    assert spill.hashes == [1] and torch.equal(spill.data["kv"], data["kv"][:, :, :, :1])  # ... and block 1 goes down
    tier.check_integrity()
    lru.check_integrity()
