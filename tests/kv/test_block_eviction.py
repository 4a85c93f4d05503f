"""The pool's own eviction (L1) follows ``--kv-eviction``: LRU and reuse pick different victims where a
hot block was freed before a one-off, the heap stays consistent, and the engine's greedy tokens do not
depend on the policy."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kv import KVCacheManager
from pagedllm.kv.block_eviction import ReuseEviction, make_eviction
from pagedllm.kv.block_pool import BlockPool

HOT = [1, 2, 3, 4, 50]  # one full block of 4 (cached after use) and one token in a partial block
ONE_OFF = [5, 6, 7, 8, 60]


def _use(m: KVCacheManager, sid: str, prompt: list[int]) -> None:
    hit = m.match_prefix(prompt)
    assert m.allocate_slots(sid, hit.num_tokens, len(prompt) - hit.num_tokens, prefix=hit)
    m.cache_full_blocks(sid, prompt)
    m.free(sid)
    m.take_pending_copies()


@pytest.mark.parametrize("eviction, survivor, evicted", [("lru", ONE_OFF, HOT), ("reuse", HOT, ONE_OFF)])
def test_policy_picks_the_pool_victim(eviction, survivor, evicted):
    m = KVCacheManager(3, 4, eviction=eviction)
    for _ in range(3):
        _use(m, "hot", HOT)  # used three times, then freed before the one-off
    _use(m, "once", ONE_OFF)
    assert m.pool.num_cached_free == 2 and m.pool.unhashed.size == 1
    assert m.allocate_slots("new", 0, 8)  # the unhashed block and one cached victim
    m.check_integrity()
    assert m.match_prefix(survivor, record=False).num_tokens == 4
    assert m.match_prefix(evicted, record=False).num_tokens == 0
    m.free("new")
    m.check_integrity()
    assert m.pool.num_used == 0


@pytest.mark.parametrize("eviction, victim", [("lru", 1), ("reuse", 0)])
def test_reuse_gives_up_the_deeper_block_at_equal_use(eviction, victim):
    pool = BlockPool(64, 4, eviction)  # (a pool's worth of releases decays uses: a big pool, little decay)
    a, b = pool.allocate_many(64)[:2]
    pool.set_hash(a, 11, (1, 2, 3, 4), depth=3)
    pool.set_hash(b, 12, (5, 6, 7, 8), depth=0)  # a chain's first block: every longer prefix needs it
    pool.free(b)  # freed first: LRU's victim
    pool.free(a)
    assert pool.victim().block_id == victim
    pool.check_integrity()


def test_reuse_heap_survives_churn():
    """Thousands of random uses, prefix hits and evictions: stale heap entries are skipped and compacted,
    every cached-free block keeps a live entry, and the pool drains to zero."""
    rng = random.Random(0)
    m = KVCacheManager(16, 4, eviction="reuse")
    prompts = [[d] * 4 * rng.randint(1, 3) + [99] for d in range(1, 30)]
    live: list[str] = []
    for step in range(1500):
        if live and (rng.random() < 0.5 or len(live) > 3):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            p = prompts[min(int(rng.paretovariate(1.0)) - 1, len(prompts) - 1)]
            hit = m.match_prefix(p)
            sid = f"s{step}"
            if m.allocate_slots(sid, hit.num_tokens, len(p) - hit.num_tokens, prefix=hit):
                m.cache_full_blocks(sid, p)
                live.append(sid)
        m.take_pending_copies()
        if step % 50 == 0:
            m.check_integrity()
    ev = m.pool.eviction
    assert isinstance(ev, ReuseEviction) and len(ev._heap) <= 2 * m.pool.num_cached_free + 64 + 16
    for sid in live:
        m.free(sid)
    m.check_integrity()
    assert m.pool.num_used == 0 and m.stats()["hit_tokens"] > 0


def test_unknown_pool_eviction_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_eviction"):
        make_eviction("mru", 8)
    with pytest.raises(ValueError, match="kv_eviction"):
        KVCacheManager(8, 4, eviction="mru")


def test_engine_tokens_do_not_depend_on_the_pool_policy(tiny_model_dir):
    """A pool too small for the prompts: the policies evict differently, greedy outputs stay identical."""
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[1000 + (i * 31 + j * 7) % 9000 for i in range(40 + 16 * (j % 3))] for j in range(8)]
    order = [0, 1, 0, 2, 0, 3, 4, 0, 5, 1, 6, 7, 0, 2]
    outs, hits = {}, {}
    for eviction in ("lru", "reuse"):
        llm = LLM(tiny_model_dir, dtype="float32", num_blocks=16, block_size=16, check_integrity=True,
                  kv_eviction=eviction)
        res = [llm.generate([prompts[k]], sp, use_tqdm=False)[0] for k in order]
        outs[eviction] = [r.outputs[0].token_ids for r in res]
        hits[eviction] = [r.num_cached_tokens for r in res]
        llm.engine.kv.check_integrity()
        assert llm.engine.kv.stats()["used"] == 0
        llm.engine.shutdown()
    assert outs["lru"] == outs["reuse"]
    assert hits["lru"] != hits["reuse"]  # the policies did evict differently
