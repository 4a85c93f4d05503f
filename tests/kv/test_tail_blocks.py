"""Tails: a finished sequence's last, partly filled block stays findable, and a prompt that continues it
(a chat's next turn) computes only its new tokens. A hit copies the tail into a block of the request's own;
the tiers keep and promote tails too; outputs stay token-identical."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kv import KVCacheManager
from tests.kv.tier_helpers import BS, evict_all, make_tiers


def _finish(m: KVCacheManager, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
    """A sequence computed over ``tokens`` that finishes: its tail is cached, then it is freed."""
    assert m.allocate_slots(seq_id, 0, len(tokens))
    m.take_pending_copies()
    m.cache_tail(seq_id, tokens, salt)
    m.free(seq_id)


def test_a_continuation_hits_the_tail_and_gets_a_copy():
    m = KVCacheManager(16, BS, enable_prefix_caching=True)
    events = []
    m.prefix_cache.on_event = lambda *e: events.append(e[0])
    first = list(range(100, 110))  # 2 full blocks + a tail of 2
    _finish(m, 1, first)
    assert m.stats()["num_cached"] == 3 and events == ["stored", "stored"]  # a tail is not a vLLM block: no event
    turn2 = first + [7, 8, 9]
    match = m.match_prefix(turn2)
    assert match.num_tokens == 10 and len(match.blocks) == 2 and match.tail is not None
    assert m.allocate_slots(2, 10, 3, match)
    own = m.block_table(2)[2]
    assert own != match.tail and m.take_pending_copies() == [(match.tail, own)]
    m.check_integrity()
    m.free(2)
    m.check_integrity()
    assert m.match_prefix(first + [1]).num_tokens == 10  # the tail is still cached


def test_the_longest_common_prefix_of_a_tail_is_hit_and_one_token_is_left():
    m = KVCacheManager(16, BS, enable_prefix_caching=True)
    _finish(m, 1, [1, 2, 3, 4, 5, 6, 7])  # 1 full block + tail (5, 6, 7)
    assert m.match_prefix([1, 2, 3, 4, 5, 6, 9, 9]).num_tokens == 6  # diverges inside the tail
    assert m.match_prefix([1, 2, 3, 4, 5, 6, 7]).num_tokens == 6  # the whole prompt: its last token is computed
    assert m.match_prefix([1, 2, 3, 4, 8]).num_tokens == 4
    assert m.match_prefix([1, 2, 3, 4, 5, 6, 7, 8], cache_salt="t").num_tokens == 0  # another tenant


def test_a_stale_tail_is_refused_and_shared_blocks_are_not_tails():
    m = KVCacheManager(4, BS, enable_prefix_caching=True)
    _finish(m, 1, [1, 2, 3, 4, 5, 6])
    match = m.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert match.tail is not None
    evict_to = m.allocate_slots(9, 0, 4 * BS)  # takes every block: the tail is evicted
    assert evict_to
    m.take_pending_copies()
    m.free(9)
    assert not m.allocate_slots(2, match.num_tokens, 1, match)  # the match went stale
    assert m.allocate_slots(3, 0, 6)
    m.fork(3, 4)
    m.take_pending_copies()
    m.cache_tail(3, [1, 2, 3, 4, 5, 6])  # its tail block is shared with the fork: not indexed
    assert m.match_prefix([1, 2, 3, 4, 5, 6, 7], record=False).tail is None
    m.free(3)
    m.free(4)
    m.check_integrity()


def test_tails_are_demoted_and_promoted_by_the_tiers():
    m, kv, _ = make_tiers(num_blocks=8, host_slots=16)
    first = list(range(200, 210))  # 2 full blocks + a tail of 2
    assert m.allocate_slots(1, 0, len(first))
    table = m.block_table(1)
    data = torch.randn(2, 2, 2, len(table), BS, 4)
    kv.import_blocks(table, {"kv": data})
    m.take_pending_copies()
    m.cache_tail(1, first)
    m.free(1)
    evict_all(m)  # all three go to L2
    turn2 = first + [5, 6]
    assert m.match_prefix(turn2, record=False).num_tokens == 0
    assert m.prefetch(turn2) is False  # an L2 run lands at once, its tail last
    match = m.match_prefix(turn2)
    assert match.num_tokens == 10 and match.tail is not None and match.tier_tokens == {"host": 10}
    got = kv.export_blocks([*match.blocks, match.tail])["kv"]
    assert torch.equal(got[:, :, :, :2], data[:, :, :, :2])
    assert torch.equal(got[:, :, :, 2, :2], data[:, :, :, 2, :2])  # the tail's two computed slots
    m.check_integrity()


SP = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
QUESTION = [[900 + 7 * c + t for t in range(6)] for c in range(6)]


def chats(model: str, num_blocks: int = 16, **kw) -> tuple[list, list[int]]:
    """6 conversations x 3 turns, each turn's prompt the last one + its answer + a 6-token question: the
    outputs and each request's computed prompt tokens; the pool empty and intact after."""
    llm = LLM(model, dtype="float32", num_blocks=num_blocks, check_integrity=True, **kw)
    history = [[1000 + 13 * c + i for i in range(21)] for c in range(6)]  # 1 full block + a tail each
    outs, computed = [], []
    for turn in range(3):
        for c in range(6):
            prompt = history[c] + QUESTION[(c + turn) % 6]
            o = llm.generate([{"prompt_token_ids": prompt}], SP, use_tqdm=False)[0]
            outs.append(o.outputs[0].token_ids)
            computed.append(len(prompt) - o.num_cached_tokens)
            history[c] = prompt + list(o.outputs[0].token_ids)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats()["used"] == 0
    llm.engine.shutdown()
    return outs, computed


def test_chat_turns_hit_their_tails_and_stay_token_identical(tiny_model_dir, tmp_path):
    """Greedy outputs of 3-turn chats with tails, with tails promoted from L2 and disk, and with prefix caching
    off, are equal; a returning turn computes only its new tokens plus the answer's last one."""
    off, _ = chats(tiny_model_dir, enable_prefix_caching=False)
    pool, computed_pool = chats(tiny_model_dir, num_blocks=64)  # every chat stays in the pool
    assert pool == off
    assert computed_pool[6:] == [7] * 12  # the answer's last token (its K/V never written) + the 6 new ones
    tiers, computed_tiers = chats(tiny_model_dir, kv_offload_memory=4 << 20, kv_disk_path=str(tmp_path))
    assert tiers == off and computed_tiers[6:] == [7] * 12  # 16 blocks hold 1-2 chats: the rest from L2
    again, _ = chats(tiny_model_dir, kv_disk_path=str(tmp_path))  # a restart: the first turns are on disk
    assert again == off


@pytest.mark.parametrize("workers", [{"distributed_executor_backend": "mp"}, {"tensor_parallel_size": 2}])
def test_tail_copies_in_worker_processes(tiny_model_dir, workers):
    """The tail's copy runs in the workers (the ``mp`` executor; 2 TP ranks on CPU, gloo), from the pool and
    promoted from L2: the same outputs as prefix caching off in one process."""
    off, _ = chats(tiny_model_dir, enable_prefix_caching=False)
    got, computed = chats(tiny_model_dir, device="cpu", kv_offload_memory=4 << 20, **workers)
    assert got == off and computed[6:] == [7] * 12
