"""The sampler's per-row reductions: ``argmax_logsumexp`` (``ops/csrc/sampling.cpp``) against ATen's argmax and
logsumexp, ATen's rules included (first index of the maximum, NaN, rows of -inf), and the sampler on top of it."""

from __future__ import annotations

import pytest
import torch

from pagedllm import ops
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
