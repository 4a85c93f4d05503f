"""Hit tokens per tier: a prefix hit counts for L2 / L3 only on blocks promoted for it and not taken since, so the
tier counts never exceed the hits, whatever happens to promoted blocks before a request takes them (the CI
failure of 2026-11-26: promoted blocks evicted unused, then promoted again, were counted twice)."""

from __future__ import annotations

from tests.kv.tier_helpers import BS, evict_all, fill, make_tiers, prompt


def _take(m, seq_id: int, tokens: list[int]):
    """Match and allocate like the scheduler's admission; the match (its ``tier_tokens`` say where it came from)."""
    pre = m.match_prefix(tokens)
    assert m.allocate_slots(seq_id, pre.num_tokens, len(tokens) - pre.num_tokens, pre)
    return pre


def test_promoted_blocks_count_for_their_tier_once(tmp_path):
    a = prompt(1, 3)
    m, kv, _ = make_tiers(num_blocks=8, host_slots=16, disk_path=str(tmp_path))
    fill(m, kv, 1, a)
    evict_all(m)  # a's blocks are in L2 (and L3) only
    assert m.match_prefix(a).num_tokens == 0
    assert m.prefetch(a, wait=True) is False  # L2 holds them all: they land now
    first = _take(m, 2, a)
    assert first.num_tokens == 3 * BS and first.tier_tokens == {"host": 3 * BS}
    m.free(2)
    again = _take(m, 3, a)  # the same blocks, taken before: the pool's hit now
    assert again.num_tokens == 3 * BS and again.tier_tokens == {}
    m.free(3)
    m.check_integrity()


def test_blocks_promoted_twice_before_a_hit_count_once(tmp_path):
    """Promoted, evicted unused, promoted again (a small pool under pressure): one hit, counted once."""
    a = prompt(1, 3)
    m, kv, _ = make_tiers(num_blocks=8, host_slots=16)
    fill(m, kv, 1, a)
    evict_all(m)
    for _ in range(2):
        assert m.prefetch(a, wait=True) is False
        assert m.match_prefix(a, record=False).num_tokens == 3 * BS
        evict_all(m)  # taken for other work before a's request ran: back down to L2
    assert m.prefetch(a, wait=True) is False
    pre = _take(m, 2, a)
    assert pre.tier_tokens == {"host": pre.num_tokens} and pre.num_tokens == 3 * BS
    m.free(2)
    assert m.tiers.stats.promoted_blocks["host"] == 9  # three promotions of 3 blocks, one hit of 3
    m.check_integrity()


def test_disk_blocks_count_for_l3(tmp_path):
    a = prompt(1, 2)
    m, kv, _ = make_tiers(num_blocks=16, disk_path=str(tmp_path))
    fill(m, kv, 1, a)
    m.close()
    m2, _, _ = make_tiers(num_blocks=8, host_slots=4, disk_path=str(tmp_path))  # a restart: L2 empty
    assert m2.prefetch(a, wait=True) is False
    pre = _take(m2, 1, a)
    assert pre.num_tokens == 2 * BS and pre.tier_tokens == {"disk": 2 * BS}
    m2.free(1)
    m2.check_integrity()
