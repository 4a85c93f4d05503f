"""Sampling for the whole batch at once: logit bias, penalties, temperature, top-k/p, min-p, logprobs.

Every transform is one tensor op over ``[rows, vocab]``, with each row's settings gathered from
the persistent batch; only the random draw of a seeded request uses its own generator (so its
samples do not depend on its batch mates). Logprobs come back as tensors, never as per-token
dicts of Python objects (they are what a step returns for thousands of tokens at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.protocol.logit_bias import apply_logit_bias
from pagedllm.protocol.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """The settings and histories of the rows being sampled, one entry per logits row."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    token_ids: torch.Tensor  # [R, width] prompt + output so far (only read when a penalty is set)
    num_prompt: torch.Tensor  # [R]
    num_tokens: torch.Tensor  # [R]


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] float32: log-probability of each sampled token (raw model distribution)
    top_ids: torch.Tensor | None  # [R, 1 + k]: the sampled token, then the top k (when any row asked)
    top_logprobs: torch.Tensor | None


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, as in vLLM: counts
    come from one scatter over the rows' token histories."""
    params = batch.params
    if all(p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in params):
        return logits
    rows, vocab = logits.shape
    width = int(batch.num_tokens.max())
    toks = batch.token_ids[:, :width]
    pos = torch.arange(width)[None, :]
    valid = pos < batch.num_tokens[:, None]
    is_out = valid & (pos >= batch.num_prompt[:, None])
    counts = torch.zeros((rows, vocab + 1), dtype=logits.dtype)
    counts.scatter_add_(1, torch.where(is_out, toks, vocab), torch.ones_like(toks, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros((rows, vocab + 1), dtype=torch.bool)
    seen.scatter_(1, torch.where(valid, toks, vocab), True)
    seen = seen[:, :vocab]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)[:, None]
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def suppress_stop_tokens(logits: torch.Tensor, batch: SamplingBatch, eos_ids: list[int]) -> torch.Tensor:
    """min_tokens: stop tokens cannot be sampled before a sequence has that many outputs."""
    rows, cols = [], []
    num_out = (batch.num_tokens - batch.num_prompt).tolist()
    for i, p in enumerate(batch.params):
        if num_out[i] < p.min_tokens:
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

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        params = batch.params
        logits = logits.float().clone() if any(p.logit_bias for p in params) else logits.float()
        apply_logit_bias(logits, [p.logit_bias for p in params])
        logits = apply_penalties(logits, batch)
        logits = suppress_stop_tokens(logits, batch, self.eos_token_ids)
        vocab = logits.shape[1]
        logprobs_all = logits.log_softmax(-1)

        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        greedy = temps == 0
        tokens = logits.argmax(-1)
        if not bool(greedy.all()):
            scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
            if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
                top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
                top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
                min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype)
                scaled = filter_logits(scaled, top_k, top_p, min_p)
            probs = scaled.softmax(-1)
            # exponential race: argmax(p / E) with E ~ Exp(1) draws from p
            noise = torch.empty_like(probs).exponential_()
            for i, g in enumerate(batch.generators):
                if g is not None:
                    noise[i].exponential_(generator=g)
            sampled = (probs / noise).argmax(-1)
            tokens = torch.where(greedy, tokens, sampled)

        chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        top_ids = top_vals = None
        if asked:
            k = max(max(asked), 1)
            vals, ids = logprobs_all.topk(k, dim=-1)
            top_ids = torch.cat([tokens[:, None], ids], 1)
            top_vals = torch.cat([chosen[:, None], vals], 1)
        return SampleResult(tokens, chosen, top_ids, top_vals)
