"""KV tiers below the pool: evicted blocks are demoted to host RAM / disk and promoted back intact."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.kv.tier_helpers import BS, evict_all, fill, make_tiers, pool_kv, prompt


def test_evicted_blocks_demote_to_host_and_promote_back_intact():
    m, kv, store = make_tiers(num_blocks=8, host_slots=16)
    tokens = prompt(1, 3)
    data = fill(m, kv, 1, tokens)
    evict_all(m)
    assert pool_kv(m, kv, tokens)[0] == 0  # gone from the pool ...
    assert store.stats.demoted_blocks["host"] == 3  # ... but saved
    m.check_integrity()
    assert m.prefetch(tokens) is False  # an L2 run lands at once
    n, got = pool_kv(m, kv, tokens)
    assert n == 3 and torch.equal(got, data)
    assert store.stats.promoted_blocks["host"] == 3
    m.check_integrity()
    assert m.stats()["free"] + m.stats()["cached_free"] + m.stats()["used"] == m.num_blocks


def test_partial_pool_hit_promotes_only_the_missing_tail():
    m, kv, store = make_tiers(num_blocks=8, host_slots=16)
    tokens = prompt(2, 4)
    data = fill(m, kv, 1, tokens)
    # evict only the two tail blocks: a free() puts the tail first in LRU order
    assert m.allocate_slots(5, 0, 4 * BS + 2 * BS)  # 4 unhashed + 2 of the cached
    m.take_pending_copies()
    m.free(5)  # room to land them
    store.flush()
    assert pool_kv(m, kv, tokens)[0] == 2
    m.prefetch(tokens)
    n, got = pool_kv(m, kv, tokens)
    assert n == 4 and torch.equal(got, data)
    assert store.stats.promoted_blocks["host"] == 2
    m.check_integrity()


def test_disk_tier_survives_a_restart(tmp_path):
    m, kv, _store = make_tiers(num_blocks=8, disk_path=str(tmp_path))
    tokens = prompt(3, 3)
    data = fill(m, kv, 1, tokens)
    m.close()  # saves the pool's cached blocks, waits for the writes
    m2, kv2, store2 = make_tiers(num_blocks=8, disk_path=str(tmp_path))
    assert m2.prefetch(tokens) is True  # a disk read is in flight: the request waits, others run
    assert m2.prefetch(tokens, wait=True) is False
    n, got = pool_kv(m2, kv2, tokens)
    assert n == 3 and torch.equal(got, data)
    assert store2.stats.promoted_blocks["disk"] == 3
    m2.check_integrity()


def test_host_and_disk_run_lands_together(tmp_path):
    """Blocks split between L2 and L3 come back as one run."""
    m, kv, store = make_tiers(num_blocks=8, host_slots=2, disk_path=str(tmp_path))
    tokens = prompt(4, 4)
    data = fill(m, kv, 1, tokens)
    evict_all(m)
    store.flush()
    m.prefetch(tokens, wait=True)
    n, got = pool_kv(m, kv, tokens)
    assert n == 4 and torch.equal(got, data)
    assert store.stats.promoted_blocks["host"] + store.stats.promoted_blocks["disk"] == 4
    assert store.stats.promoted_blocks["disk"] >= 2  # L2 holds only 2
    m.check_integrity()


@pytest.mark.parametrize("where", ["host", "disk"])
def test_tenant_salt_isolates_every_tier(tmp_path, where):
    m, kv, store = make_tiers(num_blocks=8, host_slots=16 if where == "host" else 0,
                              disk_path=str(tmp_path) if where == "disk" else None)
    tokens = prompt(5, 3)
    fill(m, kv, 1, tokens, cache_salt="tenant-a")
    evict_all(m)
    store.flush()
    assert m.prefetch(tokens, "tenant-b", wait=True) is False
    assert pool_kv(m, kv, tokens, "tenant-b")[0] == 0
    assert pool_kv(m, kv, tokens, "tenant-a")[0] == 0
    m.prefetch(tokens, "tenant-a", wait=True)
    assert pool_kv(m, kv, tokens, "tenant-a")[0] == 3
    m.check_integrity()


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_pools_move_codes_and_scales_through_the_tiers(tmp_path, dtype):
    m, kv, _store = make_tiers(num_blocks=8, host_slots=1, disk_path=str(tmp_path), dtype=dtype)
    tokens = prompt(6, 3)
    # int8: a scale per block and head (4 blocks: 3 full + the partial one); fp8: the pool's per-head scales
    scales = torch.rand(2, 2, 2, 4) if dtype == torch.int8 else kv.scales.clone()
    codes = fill(m, kv, 1, tokens, scales=scales)
    evict_all(m)  # L2 holds one block: the rest come from disk
    m.prefetch(tokens, wait=True)
    match = m.match_prefix(tokens, record=False)
    got = kv.export_blocks(match.blocks)
    assert len(match.blocks) == 3 and torch.equal(got["kv"].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got["scales"], scales[:, :, :, :3] if dtype == torch.int8 else scales)
    m.check_integrity()


def test_full_host_tier_evicts_by_policy_and_keeps_counts_exact():
    m, kv, store = make_tiers(num_blocks=8, host_slots=4)
    for s in range(4):
        fill(m, kv, s, prompt(10 + s, 3))
        evict_all(m)
        m.check_integrity()
    assert len(store.host) == 4
    assert store.host.num_free == 0
    # the last prompt's blocks are the newest: still in L2
    assert len(store.locate(*_chain(m, prompt(13, 3)))) == 3


def _chain(m, tokens):
    from pagedllm.kv.prefix_cache import hash_block_chain

    hashes = hash_block_chain(None, tokens[:3 * BS], BS, (), m.prefix_cache.key)
    return hashes, [tuple(tokens[i * BS:(i + 1) * BS]) for i in range(3)]


def test_attach_is_refused_after_traffic():
    m, kv, store = make_tiers(num_blocks=8, host_slots=4)
    fill(m, kv, 1, prompt(1, 2))
    with pytest.raises(RuntimeError, match="before the first request"):
        m.attach_tiers(store, None, kv)


def test_unregistered_blocks_are_never_demoted():
    """A block unregistered because its content is changing (or was never written) is not saved."""
    m, _kv, store = make_tiers(num_blocks=8, host_slots=16)
    tokens = prompt(20, 2)
    hashes = _chain(m, tokens + [0] * BS)[0][:2]
    writes = m.import_blocks(hashes, tokens[:2 * BS])
    assert len(writes) == 2
    for _, b in writes:  # e.g. the K/V write failed: the caller unregisters them
        m.prefix_cache.remove(b)
    evict_all(m)
    assert store.stats.demoted_blocks["host"] == 0 and len(store.host) == 0
    m.check_integrity()


def test_a_promoted_run_that_does_not_fit_the_pool_is_not_served(caplog):
    m, kv, _store = make_tiers(num_blocks=8, host_slots=16)
    tokens = prompt(21, 3)
    fill(m, kv, 1, tokens)
    evict_all(m)
    real = kv.import_blocks

    def refuse(ids, data):
        raise ValueError("kv: expected another shape")

    kv.import_blocks = refuse
    m.prefetch(tokens)
    kv.import_blocks = real
    assert pool_kv(m, kv, tokens)[0] == 0 and "does not fit" in caplog.text
    m.check_integrity()


def test_close_saves_cached_blocks_once_and_twice_is_harmless(tmp_path):
    m, kv, store = make_tiers(num_blocks=8, host_slots=16, disk_path=str(tmp_path))
    fill(m, kv, 1, prompt(22, 3))
    m.close()
    assert store.stats.demoted_blocks["disk"] == 3
    m.close()
    assert store.stats.demoted_blocks["disk"] == 3
    m.check_integrity()


def test_disk_is_written_back_from_l2_only_what_leaves_it(tmp_path):
    """Write-back: blocks L2 keeps are not written while the engine runs; L2's victims are, and close() saves
    the rest, so a restart finds every block with its K/V."""
    m, kv, store = make_tiers(num_blocks=8, host_slots=3, disk_path=str(tmp_path))
    first, second = prompt(23, 3), prompt(24, 3)
    want = fill(m, kv, 1, first)
    evict_all(m)
    assert store.stats.demoted_blocks["host"] == 3 and store.stats.demoted_blocks["disk"] == 0
    want2 = fill(m, kv, 2, second)
    evict_all(m)  # L2 (3 slots, LRU) gives up the first prompt's blocks: they go to disk
    assert store.stats.demoted_blocks["disk"] == 3 and len(store.disk) == 3
    m.check_integrity()
    m.close()  # the second prompt's blocks, still in L2, are saved now
    assert store.stats.demoted_blocks["disk"] == 6
    m2, kv2, _ = make_tiers(num_blocks=8, disk_path=str(tmp_path))
    for tokens, data in ((first, want), (second, want2)):
        m2.prefetch(tokens, wait=True)
        n, got = pool_kv(m2, kv2, tokens)
        assert n == 3 and torch.equal(got, data)
    m2.check_integrity()


def test_tiers_need_the_worker_in_the_core_process():
    from pagedllm.config.args import EngineArgs
    from pagedllm.kv.tier_setup import build_tiers

    with pytest.raises(ValueError, match="distributed_executor_backend"):
        build_tiers(EngineArgs(kv_offload_memory=1 << 20), None, None)


@pytest.mark.parametrize("where", ["host", "disk"])
def test_a_block_still_on_its_way_down_is_waited_for_not_missed(tmp_path, monkeypatch, where):
    """A lookup right after an eviction, while the copy thread still holds the store (a busy machine's copy
    thread lags): the blocks are found and promoted intact, not recomputed."""
    m, kv, store = make_tiers(num_blocks=8, host_slots=16 if where == "host" else 0,
                              disk_path=str(tmp_path) if where == "disk" else None)
    tokens = prompt(9, 3)
    data = fill(m, kv, 1, tokens)
    real, started = store._store, threading.Event()

    def slow_store(*a):
        started.set()
        time.sleep(0.3)
        real(*a)

    monkeypatch.setattr(store, "_store", slow_store)
    assert m.allocate_slots(999, 0, m.num_blocks * BS)  # evicts the three cached blocks: their store is queued
    m.take_pending_copies()
    m.free(999)
    assert started.wait(5) and len(store._storing) == 3  # the store is running, not done
    m.prefetch(tokens, wait=True)  # (before the stores were waited for: nothing located, nothing landed)
    n, got = pool_kv(m, kv, tokens)
    assert n == 3 and torch.equal(got, data)
    assert not store._storing  # done stores are forgotten
    m.check_integrity()
