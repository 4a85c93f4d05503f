"""Verification of draft tokens against the target's distributions, for a whole batch at once.

Inputs are padded per sequence: ``target_probs [B, K + 1, V]`` (row j is the target's distribution
for the token after the history plus the first j drafts), ``draft_ids [B, K]`` and ``num_drafts
[B]`` (sequence i's drafts are ``draft_ids[i, :num_drafts[i]]``; the rest is padding). Each
sequence gains its accepted drafts plus one token from the target (the correction at the first
rejection, or the bonus token when every draft was accepted), so always at least one token.

Sampling follows Leviathan et al. 2023 / Chen et al. 2023: draft x ~ q is accepted with
probability min(1, p(x) / q(x)); at the first rejection the token is drawn from
norm(max(0, p - q)). The output is then distributed exactly as the target's. A proposer without a
distribution (ngram, suffix, a greedy draft) has q one-hot at x: accept with probability p(x),
else draw from p with x removed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_flat(flat: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``[sum(counts), ...]`` rows (sequence i owns ``counts[i]`` consecutive rows) -> zero-padded
    ``[B, max(counts), ...]``."""
    counts_t = torch.as_tensor(list(counts), dtype=torch.int64)
    if int(counts_t.sum()) != flat.shape[0]:
        raise ValueError(f"counts sum to {int(counts_t.sum())} but flat has {flat.shape[0]} rows")
    B, width = len(counts_t), int(counts_t.max()) if len(counts_t) else 0
    out = flat.new_zeros((B, width, *flat.shape[1:]))
    row = torch.repeat_interleave(torch.arange(B), counts_t)
    starts = torch.cumsum(counts_t, 0) - counts_t
    col = torch.arange(flat.shape[0]) - starts.repeat_interleave(counts_t)
    out[row, col] = flat
    return out


def _check(target_probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor) -> None:
    B, K1, _ = target_probs.shape
    if draft_ids.shape != (B, K1 - 1):
        raise ValueError(f"draft_ids must be [{B}, {K1 - 1}] to match target_probs, got {tuple(draft_ids.shape)}")
    if num_drafts.shape != (B,) or bool((num_drafts < 0).any()) or bool((num_drafts > K1 - 1).any()):
        raise ValueError(f"num_drafts must be [{B}] with values in 0..{K1 - 1}")


def _split(tokens: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    return [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist())]


def _num_accepted(accept: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Length of the accepted prefix per row of ``accept [B, K]``, within each row's drafts."""
    K = accept.shape[1]
    accept = accept & (torch.arange(K) < num_drafts[:, None])
    return accept.to(torch.int64).cumprod(1).sum(1)


def greedy_verify(target_probs: torch.Tensor, draft_ids: torch.Tensor,
                  num_drafts: torch.Tensor) -> list[list[int]]:
    """Accept the longest prefix of drafts equal to the target's argmax, plus the target's argmax
    after it (the bonus token when all matched). ``target_probs`` may as well be logits."""
    _check(target_probs, draft_ids, num_drafts)
    return accept_argmax(target_probs.argmax(-1), draft_ids, num_drafts)


def accept_argmax(best: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor) -> list[list[int]]:
    """``greedy_verify`` from the target's argmax ``best [B, K + 1]`` (taken before padding, the
    vocabulary-wide rows are never copied)."""
    n = _num_accepted(draft_ids == best[:, :-1], num_drafts)
    # accepted drafts equal best there, so the output is best[:, : n + 1]
    return _split(best, n + 1)


def _uniform_and_exponential(B: int, K: int, V: int, generators: Sequence[torch.Generator | None] | None,
                             device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: K uniforms for the accept tests and V exponentials for one categorical draw (the
    exponential race argmax p / E picks token v with probability p_v). Rows with a generator draw
    from it (one call per row, so a seeded request's stream does not depend on its batch)."""
    u = torch.rand(B, K, device=device)
    e = torch.empty(B, V, device=device).exponential_()
    for i, g in enumerate(generators or ()):
        if g is not None:
            u[i] = torch.rand(K, generator=g, device=device)
            e[i] = torch.empty(V, device=device).exponential_(generator=g)
    return u, e


def rejection_sample(target_probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None = None,
                     generators: Sequence[torch.Generator | None] | None = None) -> list[list[int]]:
    """Accepted tokens per sequence under the rejection rule; ``draft_probs [B, K, V]`` is q, or
    None for one-hot drafts. ``generators[i]`` (or None) seeds row i."""
    _check(target_probs, draft_ids, num_drafts)
    B, K1, V = target_probs.shape
    K = K1 - 1
    if generators is not None and len(generators) != B:
        raise ValueError(f"generators has {len(generators)} entries for {B} sequences")
    if draft_probs is not None and draft_probs.shape != (B, K, V):
        raise ValueError(f"draft_probs must be [{B}, {K}, {V}], got {tuple(draft_probs.shape)}")
    p = target_probs.float()
    u, e = _uniform_and_exponential(B, K, V, generators, p.device)
    ids = draft_ids.long().clamp(0, V - 1)[..., None]
    p_draft = p[:, :K].gather(2, ids).squeeze(2)  # [B, K]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.float().gather(2, ids).squeeze(2)
    n = _num_accepted(u * q_draft < p_draft, num_drafts)  # u < p / q without dividing by q = 0
    # the distribution of the token after the accepted drafts: residual at a rejection, p as bonus
    rows = torch.arange(B)
    p_next = p[rows, n]  # [B, V]
    rejected = n < num_drafts
    at = n.clamp(max=K - 1) if K else n
    if draft_probs is None:
        q_next = torch.zeros_like(p_next)
        if K:
            q_next[rows, draft_ids.long()[rows, at].clamp(0, V - 1)] = 1.0
    else:
        q_next = draft_probs.float()[rows, at] if K else torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp_min(0)
    empty = residual.sum(1, keepdim=True) <= 0  # p == q there: a rejection had probability 0
    residual = torch.where(empty, p_next, residual)
    dist = torch.where(rejected[:, None], residual, p_next)
    token = (dist / e).argmax(1)  # the exponential race: a draw from dist (unnormalised is fine)
    out = draft_ids.long().clone() if K else torch.empty(B, 0, dtype=torch.int64)
    out = torch.cat([out, torch.zeros(B, 1, dtype=torch.int64)], 1)
    out[rows, n] = token
    return _split(out, n + 1)


def verify(target_probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor, greedy: torch.Tensor,
           draft_probs: torch.Tensor | None = None,
           generators: Sequence[torch.Generator | None] | None = None) -> list[list[int]]:
    """A mixed batch: rows where ``greedy [B]`` is True go through ``greedy_verify``, the others
    through ``rejection_sample``; results in row order."""
    out: list[list[int]] = [[] for _ in range(len(greedy))]
    g_rows, s_rows = greedy.nonzero().flatten(), (~greedy).nonzero().flatten()
    if len(g_rows):
        part = greedy_verify(target_probs[g_rows], draft_ids[g_rows], num_drafts[g_rows])
        for r, toks in zip(g_rows.tolist(), part):
            out[r] = toks
    if len(s_rows):
        gens = None if generators is None else [generators[i] for i in s_rows.tolist()]
        q = None if draft_probs is None else draft_probs[s_rows]
        part = rejection_sample(target_probs[s_rows], draft_ids[s_rows], num_drafts[s_rows], q, gens)
        for r, toks in zip(s_rows.tolist(), part):
            out[r] = toks
    return out
