"""The sampler's per-row reductions: ``argmax_logsumexp`` (``ops/csrc/sampling.cpp``) against ATen's argmax and
logsumexp, ATen's rules included (first index of the maximum, NaN, rows of -inf), ``exponential_race`` against the
same draw in tensor ops, and the sampler on top of them."""

from __future__ import annotations

import pytest
import torch

from pagedllm import ops
from pagedllm.worker.noise import exponential_noise
from pagedllm.worker.sampler import greedy_and_normaliser, sample_plain

pytestmark = pytest.mark.skipif(not ops.load("sampling"), reason="the sampling C++ op can't be built here")


def _check(x: torch.Tensor) -> None:
    idx, lse = torch.ops.pagedllm.argmax_logsumexp(x)
    assert idx.dtype == torch.int64 and lse.dtype == torch.float32
    assert torch.equal(idx, x.argmax(-1))
    torch.testing.assert_close(lse, x.logsumexp(-1), rtol=2e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("V", (1, 7, 8, 13, 100, 49152))
@pytest.mark.parametrize("T", (1, 3, 64))
def test_random_rows_match_aten(T: int, V: int) -> None:
    _check(torch.randn(T, V, generator=torch.Generator().manual_seed(T * V)) * 4)


@pytest.mark.parametrize("V", (13, 40, 1000))
def test_ties_nan_and_infinities_follow_aten(V: int) -> None:
    x = torch.randn(8, V, generator=torch.Generator().manual_seed(V))
    x[0, [3, 9, V - 1]] = 50.0  # a tie in two vector lanes and in the tail: the first index wins
    x[1, [V - 2, V - 1]] = 50.0  # a tie in the tail only
    x[2, 5], x[2, V - 1] = float("nan"), float("nan")  # the first NaN wins, and the normaliser is NaN
    x[3] = float("-inf")  # nothing is possible: index 0, -inf
    x[4, :] = float("-inf")
    x[4, V - 1] = 1.0  # one possible token, in the tail
    x[5, 1:] = float("-inf")  # one possible token, first
    x[6, 2] = float("inf")  # +inf: its index, and an inf normaliser
    x[7] = 0.0  # all equal: index 0, log(V)
    _check(x)


def test_wrapper_and_plain_sampling_give_the_same_tokens_and_logprobs_as_log_softmax() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 5
    tokens, all_lp, lse = greedy_and_normaliser(logits.t().contiguous().t(), need_all=False)  # a strided view too
    assert all_lp is None and torch.equal(tokens, logits.argmax(-1))
    want = logits.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logits.gather(1, tokens[:, None])[:, 0] - lse, want, rtol=1e-5, atol=1e-5)
    tokens2, all_lp, lse2 = greedy_and_normaliser(logits, need_all=True)
    assert lse2 is None and torch.equal(tokens2, tokens) and torch.equal(all_lp, logits.log_softmax(-1))
    zero = torch.zeros(6)
    got_tokens, got_lp = sample_plain(logits, zero, torch.zeros(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int64),
                                      random=False)
    assert torch.equal(got_tokens, tokens)
    torch.testing.assert_close(got_lp, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pagedllm.argmax_logsumexp(logits.double())


def _aten_race(logits, temps, keys, counters) -> torch.Tensor:
    return ((logits / temps[:, None]).softmax(-1) / exponential_noise(keys, counters, logits.shape[1])).argmax(-1)


def _race(logits, temps, keys, counters) -> torch.Tensor:
    return torch.ops.pagedllm.exponential_race(logits, temps, keys, counters)


@pytest.mark.parametrize("V", (5, 8, 1001, 49152))
def test_exponential_race_draws_what_tensor_ops_draw(V: int) -> None:
    """The same tokens as softmax / hashed noise / argmax in ATen: the hash's bits are the same, and leaving the
    softmax's normaliser out (and the tokens that cannot win) changes only rounding. Two rows in 64 may differ on
    a near-tie of another CPU's rounding; a wrong hash or scale would change most."""
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(64, V, generator=g) * 3
    temps = torch.rand(64, generator=g) * 1.5 + 0.1
    keys = torch.randint(0, 1 << 40, (64,), generator=g)
    counters = torch.randint(0, 10_000, (64,), generator=g)
    got, want = _race(logits, temps, keys, counters), _aten_race(logits, temps, keys, counters)
    assert got.dtype == torch.int64 and int((got != want).sum()) <= 1, (got, want)
    assert len(set(got.tolist())) >= min(V, 16) // 2, "draws spread over the vocabulary"


def test_exponential_race_samples_the_distribution_and_never_a_masked_token() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0])  # 9 tokens: a vector and a tail
    n = 20_000
    logits = probs.log().expand(n, -1).contiguous()  # log(0) = -inf: masked
    drawn = _race(logits, torch.ones(n), torch.arange(n, dtype=torch.int64) * 7919, torch.full((n,), 11))
    freq = torch.bincount(drawn, minlength=9).float() / n
    assert torch.allclose(freq, probs, atol=0.012), freq
    # one sequence's steps (counters) too, at a temperature: softmax(log p / 2) is p^(1/2) normalised
    drawn = _race(logits, torch.full((n,), 2.0), torch.full((n,), 12345), torch.arange(n))
    want = probs.sqrt() / probs.sqrt().sum()
    assert torch.allclose(torch.bincount(drawn, minlength=9).float() / n, want, atol=0.012)


def test_exponential_race_edge_rows() -> None:
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    x[0] = float("-inf")  # nothing possible: ATen's softmax is NaN, its argmax 0
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    x[3, :] = float("-inf")
    x[3, 37] = 0.0  # the one possible token, in the tail
    keys, counters = torch.arange(6), torch.arange(6)
    got = _race(x, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, -1.0]), keys, counters)
    assert got[:4].tolist() == [0, 0, 0, 37]
    ones = _race(x, torch.ones(6), keys, counters)
    assert got[4:].tolist() == ones[4:].tolist(), "a temperature <= 0 counts as 1 (the caller keeps its greedy pick)"
    with pytest.raises(RuntimeError, match="one entry per logits row"):
        _race(x, torch.ones(5), keys, counters)


def test_plain_and_full_sampler_draw_alike_through_the_race() -> None:
    """``sample_plain`` (decode graphs) and the sampler's temperature path take the same race on the CPU."""
    from pagedllm import SamplingParams
    from pagedllm.worker.sampler import sample_random

    logits = torch.randn(16, 3000, generator=torch.Generator().manual_seed(5)) * 2
    temps = torch.linspace(0.2, 1.5, 16)
    keys, counters = torch.arange(16, dtype=torch.int64) * 31, torch.full((16,), 40)
    params = [SamplingParams(temperature=float(t)) for t in temps]
    full = sample_random(logits, params, keys, counters)
    plain, lps = sample_plain(logits, temps, keys, counters, random=True)
    assert torch.equal(full, plain) and torch.equal(plain, _race(logits, temps, keys, counters))
    torch.testing.assert_close(lps, logits.log_softmax(-1).gather(1, plain[:, None])[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", (0.05, 3.0, 30.0))  # nearly flat rows (whole-row fallbacks) to peaked ones
def test_filtered_race_keeps_what_filter_logits_keeps(scale: float) -> None:
    """top-k / top-p / min-p per row, without sorting rows: the same draws as filter_logits, then the race."""
    from pagedllm.worker.sampler import filter_logits

    g = torch.Generator().manual_seed(int(scale * 100))
    R, V = 48, 3001
    logits = torch.randn(R, V, generator=g) * scale
    temps = torch.rand(R, generator=g) + 0.3
    top_k = torch.tensor([[V, 1, 5, 40, V + 7, 2000][i % 6] for i in range(R)])
    top_p = torch.tensor([[1.0, 0.9, 0.5, 0.99, 0.05][i % 5] for i in range(R)])
    min_p = torch.tensor([[0.0, 0.0, 0.1, 0.5, 0.01, 0.0, 0.0][i % 7] for i in range(R)])
    keys, counters = torch.arange(R, dtype=torch.int64) * 977, torch.arange(R, dtype=torch.int64) + 3
    want = _aten_race(filter_logits(logits / temps[:, None], top_k.clamp(max=V), top_p, min_p), torch.ones(R), keys,
                      counters)
    got = torch.ops.pagedllm.filtered_race(logits, temps, top_k, top_p, min_p, keys, counters)
    assert int((got != want).sum()) <= 1, (got, want)
    assert bool((got[1::6] == (logits / temps[:, None]).argmax(-1)[1::6]).all()), "top_k 1 is greedy"
    plain = (top_k >= V) & (top_p == 1.0) & (min_p == 0.0)  # a batch mate's filter: these rows keep every token
    assert int(plain.sum()) >= 2
    assert torch.equal(got[plain], _race(logits, temps, keys, counters)[plain])
    with pytest.raises(RuntimeError, match="one entry per logits row"):
        torch.ops.pagedllm.filtered_race(logits, temps, top_k[:5], top_p, min_p, keys, counters)
