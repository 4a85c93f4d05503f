import pytest

from pagedllm.spec_decode.suffix import SuffixProposer
from pagedllm.spec_decode.suffix_tree import SuffixTrie


def test_trie_follows_the_most_frequent_continuation():
    t = SuffixTrie(8)
    t.extend("a", [1, 2, 3, 1, 2, 4, 1, 2, 3, 5])
    toks, score, m = t.continuation([9, 1, 2], 3, max_match=4, min_prob=0.0)
    assert (toks, m) == ([3, 1, 2], 2)  # "1 2" -> 3 twice, 4 once; then "1 2 3" -> 1 once, 5 once (first seen)
    assert score == pytest.approx(2 / 3 + 2 / 3 * 1 / 2 + 2 / 3 * 1 / 2)
    # min_prob cuts the walk where the path gets unlikely
    assert t.continuation([9, 1, 2], 3, max_match=4, min_prob=0.5)[0] == [3]
    assert t.continuation([7], 3, 4, 0.0)[0] == []


def test_trie_remove_restores_it_exactly():
    t = SuffixTrie(4)
    t.extend("a", [1, 2, 3])
    nodes = t.num_nodes
    t.extend("b", [2, 3, 4, 2, 3, 5])
    t.remove([2, 3, 4, 2, 3, 5])
    assert t.num_nodes == nodes
    assert t.continuation([2], 2, 3, 0.0)[0] == [3]
    t.remove([1, 2, 3])
    assert t.num_nodes == 0 and not t.root.children


def test_proposer_uses_own_history_and_finished_requests():
    p = SuffixProposer(max_tree_depth=8, max_cached_requests=2, min_token_prob=0.0)
    p.start_request("r1", [10, 11, 12, 13, 10, 11])
    assert p.propose([[10, 11, 12, 13, 10, 11]], [2], ["r1"]).token_ids == [[12, 13]]
    # r1 generates a phrase, finishes; r2 never saw it but gets it from the global tree
    p.propose([[10, 11, 12, 13, 10, 11, 40, 41, 42, 43]], [1], ["r1"])
    p.finish_request("r1")
    p.start_request("r2", [5, 6])
    assert p.propose([[5, 6, 40, 41]], [3], ["r2"]).token_ids == [[42, 43]]
    # the prompt of r1 is not in the global tree (only outputs are kept)
    assert p.propose([[5, 6, 40, 41, 7, 10, 11]], [2], ["r2"]).token_ids == [[]]


def test_lru_bounds_the_global_tree():
    p = SuffixProposer(max_tree_depth=6, max_cached_requests=2)
    for i in range(5):
        rid = f"r{i}"
        p.start_request(rid, [1])
        p.propose([[1] + [100 * i + j for j in range(10)]], [1], [rid])
        p.finish_request(rid)
    assert len(p.cached) == 2 and not p.requests
    # only the last two requests' outputs remain: 2 streams of 10 distinct tokens, depth <= 6
    assert p.global_trie.num_nodes == 2 * sum(min(6, 10 - s) for s in range(10))
    assert p.global_trie.continuation([200, 201], 2, 4, 0.0)[0] == []
    assert p.global_trie.continuation([400, 401], 2, 4, 0.0)[0] == [402, 403]


def test_needs_req_ids():
    with pytest.raises(ValueError, match="req_ids"):
        SuffixProposer().propose([[1, 2]], [2])
