"""Sampling for the whole batch at once: penalties, temperature, top-k/p, min-p, logprobs.

Every transform is one tensor op over ``[batch, vocab]``; only the random draw of a seeded
request uses its own generator (so its samples do not depend on its batch mates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token (raw model distribution, after penalties)
    top_logprobs: list[dict[int, float]] | None  # per row {token: logprob}, sampled token first


def _pad(rows: list[list[int]], fill: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), fill, dtype=torch.int64)
    for i, r in enumerate(rows):  # one row copy per sequence
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, as in vLLM."""
    params = [s.request.params for s in seqs]
    if all(p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in params):
        return logits
    vocab = logits.shape[1]
    out_ids = _pad([s.output_token_ids for s in seqs], vocab)
    counts = torch.zeros((len(seqs), vocab + 1), dtype=logits.dtype)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros((len(seqs), vocab + 1), dtype=torch.bool)
    seen.scatter_(1, _pad([s.token_ids for s in seqs], vocab), True)
    seen = seen[:, :vocab]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)[:, None]
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def suppress_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> torch.Tensor:
    """min_tokens: stop tokens cannot be sampled before a sequence has that many outputs."""
    rows, cols = [], []
    for i, s in enumerate(seqs):
        p = s.request.params
        if s.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            rows += [i] * len(banned)
            cols += sorted(banned)
    if rows:
        logits = logits.clone()
        logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return logits


def filter_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside top-k, the top-p nucleus and the min-p floor (per-row settings)."""
    sorted_logits, idx = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    ranks = torch.arange(scaled.shape[1])[None, :]
    drop = ranks >= top_k[:, None]
    drop |= (probs.cumsum(-1) - probs) > top_p[:, None]  # the most likely token always stays
    drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, idx, sorted_logits)


class Sampler:
    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        logits = apply_penalties(logits.float(), seqs)
        logits = suppress_stop_tokens(logits, seqs, self.eos_token_ids)
        params = [s.request.params for s in seqs]
        vocab = logits.shape[1]
        logprobs_all = logits.log_softmax(-1)

        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        greedy = temps == 0
        tokens = logits.argmax(-1)
        if not bool(greedy.all()):
            scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
            if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
                top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
                top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
                min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype)
                scaled = filter_logits(scaled, top_k, top_p, min_p)
            probs = scaled.softmax(-1)
            # exponential race: argmax(p / E) with E ~ Exp(1) draws from p
            noise = torch.empty_like(probs).exponential_()
            for i, s in enumerate(seqs):
                if s.generator is not None:
                    noise[i].exponential_(generator=s.generator)
            sampled = (probs / noise).argmax(-1)
            tokens = torch.where(greedy, tokens, sampled)

        chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
        top: list[dict[int, float]] | None = None
        max_n = max((p.logprobs or 0) for p in params if p.logprobs is not None) if any(
            p.logprobs is not None for p in params) else None
        if max_n is not None:
            top_vals, top_ids = logprobs_all.topk(max(max_n, 1), dim=-1)
            top = []
            for i, p in enumerate(params):
                entry = {int(tokens[i]): float(chosen[i])}
                for t, v in zip(top_ids[i, : p.logprobs or 0].tolist(), top_vals[i, : p.logprobs or 0].tolist()):
                    entry.setdefault(t, v)
                top.append(entry)
        return SampleResult(tokens.tolist(), chosen.tolist(), top)
