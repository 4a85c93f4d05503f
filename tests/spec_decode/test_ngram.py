import random

import pytest

from pagedllm.spec_decode.ngram import NgramProposer, ngram_lookup


def reference_lookup(h, k, min_n, max_n):
    """The definition, one position at a time: longest n first, most recent earlier match."""
    for n in range(max_n, min_n - 1, -1):
        if len(h) <= n:
            continue
        for start in range(len(h) - n - 1, -1, -1):
            if h[start:start + n] == h[-n:]:
                return h[start + n:start + n + k]
    return []


def test_crafted_histories():
    hist = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3]
    # "1 2 3" occurs twice before the tail; the most recent is followed by 4 5 8 (a 3-gram match)
    assert ngram_lookup([hist], 3, 1, 4) == ([[4, 5, 8]], [3])
    # a 4-gram match beats a more recent 3-gram one
    hist2 = [5, 1, 2, 3, 6, 6, 1, 2, 3, 7, 5, 1, 2, 3]
    assert ngram_lookup([hist2], 2, 1, 4) == ([[6, 6]], [4])
    assert ngram_lookup([hist2], 2, 1, 3) == ([[7, 5]], [3])
    # no earlier occurrence of the last token: nothing proposed; too short: nothing
    assert ngram_lookup([[1, 2, 3, 4], [3]], 4, 1, 4) == ([[], []], [0, 0])
    # continuation runs to the end of the history at most
    assert ngram_lookup([[4, 5, 6, 4, 5]], 5, 2, 2) == ([[6, 4, 5]], [2])
    # prompt_lookup_min respected: only a 1-gram repeats
    assert ngram_lookup([[1, 2, 9, 3, 4, 9]], 2, 2, 3) == ([[]], [0])


@pytest.mark.parametrize("min_n, max_n", [(1, 4), (2, 3), (3, 3)])
def test_batched_matches_definition(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    hists = [[rng.randrange(4) for _ in range(rng.randrange(0, 40))] for _ in range(60)]
    got, lens = ngram_lookup(hists, 5, min_n, max_n)
    assert got == [reference_lookup(h, 5, min_n, max_n) for h in hists]
    assert all((n == 0) == (not d) and (n == 0 or min_n <= n <= max_n) for d, n in zip(got, lens))
    assert sum(map(len, got)) > 50  # the random histories do exercise matches


def test_proposer_honours_per_sequence_k():
    p = NgramProposer(1, 3)
    out = p.propose([[1, 2, 3, 1, 2, 3, 1], [4, 5, 6, 4]], [2, 0]).token_ids
    assert out == [[2, 3], []]


def test_request_histories_grow_in_place_and_restart_when_rewritten():
    """With req_ids the proposer extends each request's array by the new tokens; a history that is not
    an extension of the synced one (an id reused) is taken whole."""
    p = NgramProposer(1, 3)
    h = [5, 6, 7, 8]
    assert p.propose([h], [2], ["a"]).token_ids == [[]]
    for t in (5, 6, 9, 5):  # ... 5 6 9 5: the 1-gram "5" matched most recently before 6 9
        h = h + [t]
        got = p.propose([h], [2], ["a"])
    assert got.token_ids == [[6, 9]] and got.match_len == [1]
    assert p.propose([[1, 2, 1]], [2], ["a"]).token_ids == [[2, 1]]  # rewritten: not the old array
    p.finish_request("a")
    assert "a" not in p._histories
    with pytest.raises(ValueError, match="num_tokens"):
        p.propose([[1]], [1, 2])
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 3)
