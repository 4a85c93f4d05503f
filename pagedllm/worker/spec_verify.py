"""Verification of draft tokens (speculative decoding) against the target's logits of one forward pass.

Greedy: the longest prefix of drafts equal to the target's argmax, plus the target's next token.
Sampling: the rejection rule of Leviathan et al. / Chen et al. (2023) for a proposer that gives
tokens without a distribution (n-gram, suffix: q is one-hot), so the output distribution is the
target's: draft ``d_t`` is kept with probability ``p_t(d_t)``; at the first rejection the token is
drawn from ``p_t`` with ``d_t`` removed (``norm(max(0, p - q))``); if every draft is kept, one more
token is drawn from ``p_k``. Each sequence is verified over all its positions at once.
"""

from __future__ import annotations

import torch

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.worker.sampler import filter_logits


def _probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution at every position (temperature, top-k/p, min-p)."""
    scaled = logits / p.temperature
    if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
        n, vocab = scaled.shape
        top_k = torch.full((n,), min(p.top_k, vocab) if p.top_k > 0 else vocab)
        scaled = filter_logits(scaled, top_k, torch.full((n,), float(p.top_p)), torch.full((n,), float(p.min_p)))
    return scaled.softmax(-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` (exponential race, as the batched sampler draws)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def verify(logits: torch.Tensor, drafts: list[int], p: SamplingParams,
           generator: torch.Generator | None) -> tuple[list[int], list[float]]:
    """``logits [k + 1, vocab]`` (float32) at the last real token and at each of the ``k`` drafts.
    Returns the kept drafts plus one token from the target, and each token's logprob."""
    k = len(drafts)
    d = torch.tensor(drafts, dtype=torch.int64)
    if p.temperature == 0:
        target = logits.argmax(-1)
        kept = int((target[:k] == d).to(torch.int64).cumprod(0).sum())
        tokens = drafts[:kept] + [int(target[kept])]
    else:
        probs = _probs(logits, p)
        u = torch.rand(k, generator=generator)
        kept = int((u < probs[torch.arange(k), d]).to(torch.int64).cumprod(0).sum())
        last = probs[kept].clone()
        if kept < k:
            last[drafts[kept]] = 0.0
        tokens = drafts[:kept] + [_draw(last / last.sum(), generator)]
    logprobs = logits[: kept + 1].log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return tokens, logprobs.tolist()
