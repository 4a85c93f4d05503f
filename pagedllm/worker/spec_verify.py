"""Draft verification on the worker: the step's logits at each drafted sequence's last real token
and at its drafts become the target's distributions (raw logits for greedy rows; temperature,
top-k/p and min-p applied for sampled ones), and ``spec_decode.rejection.verify`` keeps the longest
accepted prefix plus one token from the target, for the whole batch at once."""

from __future__ import annotations

import torch

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.spec_decode.rejection import pad_flat, verify
from pagedllm.worker.sampler import filter_logits


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution at every row of ``logits`` (temperature, top-k/p, min-p)."""
    scaled = logits / p.temperature
    if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
        n, vocab = scaled.shape
        top_k = torch.full((n,), min(p.top_k, vocab) if p.top_k > 0 else vocab)
        scaled = filter_logits(scaled, top_k, torch.full((n,), float(p.top_p)), torch.full((n,), float(p.min_p)))
    return scaled.softmax(-1)


def verify_drafts(logits: list[torch.Tensor], drafts: list[list[int]], params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> list[tuple[list[int], list[float]]]:
    """``logits[i] [k_i + 1, vocab]`` for sequence i's drafts ``drafts[i]``; returns per sequence the
    kept drafts plus the target's token, and each token's logprob under the raw model."""
    greedy = torch.tensor([p.temperature == 0 for p in params])
    dists = [lg if p.temperature == 0 else target_probs(lg, p) for lg, p in zip(logits, params)]
    counts = [len(d) + 1 for d in drafts]
    target = pad_flat(torch.cat(dists), counts)
    width = max(counts) - 1
    draft_ids = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.int64).reshape(len(drafts), width)
    kept = verify(target, draft_ids, torch.tensor([len(d) for d in drafts]), greedy, None, generators)
    out = []
    for lg, toks in zip(logits, kept):
        lp = lg[: len(toks)].log_softmax(-1).gather(1, torch.tensor(toks)[:, None])[:, 0]
        out.append((toks, lp.tolist()))
    return out
