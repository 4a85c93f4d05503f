"""Promotion latency: disk reads that finished land together in one copy into the pool, and a read expected to
take a small part of a step is waited for in the schedule that asks for it (the request runs in that step)."""

from __future__ import annotations

import torch

from tests.kv.tier_helpers import evict_all, fill, make_tiers, pool_kv, prompt


def _count_imports(kv) -> list[list[int]]:
    calls: list[list[int]] = []
    real = kv.import_blocks

    def counting(ids, data):
        calls.append(list(ids))
        real(ids, data)

    kv.import_blocks = counting
    return calls


def _on_disk(tmp_path, num_blocks: int, prompts: list[list[int]], host_slots: int = 0):
    """A fresh manager (a restart, with an empty L2 of ``host_slots``) over a disk tier that holds ``prompts``'
    blocks; their K/V."""
    m, kv, _ = make_tiers(num_blocks=16, disk_path=str(tmp_path))  # holds them all: nothing demoted early
    datas = [fill(m, kv, i + 1, p) for i, p in enumerate(prompts)]
    m.close()
    m2, kv2, store2 = make_tiers(num_blocks=num_blocks, host_slots=host_slots, disk_path=str(tmp_path))
    return m2, kv2, store2, datas


def _both_read(m, a, b, monkeypatch) -> None:
    """Start both reads (neither landing before the other is asked for) and wait for them."""
    with monkeypatch.context() as mp:
        mp.setattr(m, "_land_finished", lambda: None)
        assert m.prefetch(a) and m.prefetch(b)
    for ld in list(m._loads.values()):
        ld.future.result()


def test_finished_reads_land_in_one_copy(tmp_path, monkeypatch):
    a, b = prompt(1, 3), prompt(2, 3)
    m, kv, _, (da, db) = _on_disk(tmp_path, 8, [a, b])
    calls = _count_imports(kv)
    _both_read(m, a, b, monkeypatch)
    assert m.prefetch(a) is False  # lands both
    assert len(calls) == 1 and len(calls[0]) == 6
    for tokens, data in ((a, da), (b, db)):
        n, got = pool_kv(m, kv, tokens)
        assert n == 3 and torch.equal(got, data)
    m.check_integrity()


def test_a_run_evicted_before_its_write_is_neither_written_nor_demoted(tmp_path, monkeypatch):
    """Two runs landing together in a pool too small for both: the second one's blocks evict the first one's
    before the copy. Nothing unwritten is demoted or served, and the accounting holds."""
    a, b = prompt(1, 3), prompt(2, 3)
    m, kv, store, (da, db) = _on_disk(tmp_path, 4, [a, b], host_slots=8)
    _both_read(m, a, b, monkeypatch)
    m.prefetch(a)
    store.flush()
    assert store.stats.demoted_blocks["host"] == 0  # a's evicted blocks were never filled: L2 did not take them
    n_b, got_b = pool_kv(m, kv, b)
    assert n_b == 3 and torch.equal(got_b, db)
    n_a, got_a = pool_kv(m, kv, a)
    assert n_a == 1 and torch.equal(got_a, da[:, :, :, :1])  # what is left of a's run (its head) is a's own K/V
    m.check_integrity()
    m.prefetch(a, wait=True)  # and a comes back from disk intact
    n_a, got_a = pool_kv(m, kv, a)
    assert n_a == 3 and torch.equal(got_a, da)


def test_a_short_read_runs_in_the_step_that_asks(tmp_path):
    a, b = prompt(1, 3), prompt(2, 3)
    m, kv, store, (da, _) = _on_disk(tmp_path, 8, [a, b])
    assert m.prefetch(b, wait=True) is False  # measures a read
    assert store.read_seconds_per_block is not None
    store.read_seconds_per_block = 1e-3
    m._step_s = 1.0  # a step far longer than a read: read it now
    assert m.prefetch(a) is False
    n, got = pool_kv(m, kv, a)
    assert n == 3 and torch.equal(got, da)
    evict_all(m)
    m._step_s = 3e-3  # a read as long as a step: the read thread reads it, the request waits for a later step
    assert m.prefetch(a) is True
    assert pool_kv(m, kv, a)[0] == 0
    m.prefetch(a, wait=True)
    assert pool_kv(m, kv, a)[0] == 3
    m.check_integrity()


def _evict_after_locate(store, monkeypatch, pick) -> list:
    """``store.locate`` as the store thread can race it: right after a lookup finds a run, the L2 block at
    ``pick(where)`` is evicted (making room for a demotion). Returns the positions evicted."""
    real, evicted = store.locate, []

    def locate(hashes, tokens):
        where = real(hashes, tokens)
        i = pick(where)
        if i is not None:
            store.host.remove(hashes[i])
            evicted.append(i)
        return where

    monkeypatch.setattr(store, "locate", locate)
    return evicted


def test_an_l2_block_evicted_between_lookup_and_read_ends_the_run_there(monkeypatch):
    """An L2-only run whose second block leaves L2 after ``locate`` found it: the block before it is promoted,
    the rest recomputed later; no KeyError, and the pool's accounting holds."""
    a = prompt(1, 3)
    m, kv, store = make_tiers(num_blocks=4, host_slots=8)
    data = fill(m, kv, 1, a)
    evict_all(m)
    evicted = _evict_after_locate(store, monkeypatch, lambda where: 1)
    assert m.prefetch(a) is False and evicted == [1]
    n, got = pool_kv(m, kv, a)
    assert n == 1 and torch.equal(got, data[:, :, :, :1])
    assert store.stats.promoted_blocks["host"] == 1
    m.check_integrity()


def test_an_l2_block_evicted_before_a_disk_run_is_read_ends_the_run_there(tmp_path, monkeypatch):
    """A run mixing L2 and disk blocks whose first L2 block leaves L2 after ``locate``: the disk blocks before it
    land, nothing from it on; no KeyError, and the accounting holds."""
    a = prompt(1, 4)
    m, kv, store = make_tiers(num_blocks=6, host_slots=2, disk_path=str(tmp_path))
    data = fill(m, kv, 1, a)
    evict_all(m)
    evicted = _evict_after_locate(store, monkeypatch, lambda where: where.index("host") if "host" in where else None)
    m.prefetch(a, wait=True)
    m.prefetch(a)  # lands what the read returned
    n, got = pool_kv(m, kv, a)
    cut = evicted[0] if evicted else 4
    assert n == cut and torch.equal(got, data[:, :, :, :cut])
    m.check_integrity()
