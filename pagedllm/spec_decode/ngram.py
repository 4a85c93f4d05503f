"""N-gram prompt lookup (vLLM's ``ngram``): find the last n tokens earlier in the sequence's own
history and propose the tokens that followed there.

All sequences are matched in one set of tensor ops: histories are right-aligned into one
``[B, L]`` matrix, ``unfold`` gives every window of ``prompt_lookup_max`` tokens ending at each
earlier position, and the length of the agreement with the sequence's tail is read off a
cumulative product. No Python loop runs over positions (vllm#16883: per-step CPU matching that
loops made n-gram slower than no speculation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.spec_decode.proposer import Proposal, Proposer, check_num_tokens

_PAD = -1  # never a token id: pads never match


def right_aligned(histories: Sequence[Sequence[int]], left_pad: int) -> torch.Tensor:
    """``[B, left_pad + max_len]`` int64, each history flush right, ``_PAD`` on the left."""
    width = left_pad + max(len(h) for h in histories)
    out = torch.full((len(histories), width), _PAD, dtype=torch.int64)
    for i, h in enumerate(histories):  # one slice copy per sequence
        if h:
            out[i, width - len(h):] = torch.as_tensor(h, dtype=torch.int64)
    return out


def ngram_lookup(histories: Sequence[Sequence[int]], k: int, min_n: int, max_n: int) -> list[list[int]]:
    """For each history, the ``k`` tokens (or fewer, at the end) after the most recent earlier
    occurrence of its longest matching tail n-gram, ``max_n >= n >= min_n``; [] when none matches."""
    if not histories:
        return []
    if k == 0 or max(len(h) for h in histories) <= min_n:
        return [[] for _ in histories]
    t = right_aligned(histories, max_n - 1)  # [B, W]
    W = t.shape[1]
    tail = t[:, W - max_n:]  # [B, max_n]: the n-gram to look up, oldest token first
    # windows[b, e] = t[b, e : e + max_n], the max_n tokens ending at padded position e + max_n - 1;
    # the last window is the tail itself, excluded (a match must lie strictly before it)
    windows = t[:, :-1].unfold(1, max_n, 1)  # [B, W - max_n, max_n]
    eq = (windows == tail[:, None, :]).flip(-1)  # column m: token m places before the window's end
    match_len = eq.to(torch.int32).cumprod(-1).sum(-1)  # [B, E]: agreement length with the tail
    match_len = torch.where(match_len >= min_n, match_len, 0)
    E = match_len.shape[1]
    # longest match first, most recent among equals
    score = match_len.to(torch.int64) * E + torch.arange(E)
    best = score.argmax(1)  # [B]
    found = match_len.gather(1, best[:, None]).squeeze(1) > 0
    found &= torch.tensor([len(h) > 0 for h in histories])  # an empty history's pads would match each other
    start = best + max_n  # padded position right after the matched n-gram
    idx = start[:, None] + torch.arange(k)  # [B, k]
    valid = (idx < W) & found[:, None]
    drafts = t.gather(1, idx.clamp(max=W - 1))
    counts = valid.sum(1).tolist()
    rows = drafts.tolist()
    return [row[:c] for row, c in zip(rows, counts)]


class NgramProposer(Proposer):
    """Prompt lookup over each sequence's prompt + output; stateless."""

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min "
                             f"({prompt_lookup_min})")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, histories, num_tokens, req_ids=None) -> Proposal:
        check_num_tokens(histories, num_tokens, req_ids)
        if not histories:
            return Proposal([])
        drafts = ngram_lookup(histories, max(num_tokens), self.min_n, self.max_n)
        return Proposal([d[:k] for d, k in zip(drafts, num_tokens)])
