"""Draft verification on the worker: the step's logits at each drafted sequence's last real token
and at its drafts become the target's distributions (raw logits for greedy rows; temperature,
top-k/p and min-p applied for sampled ones), and ``spec_decode.rejection`` keeps the longest
accepted prefix plus one token from the target, for the whole batch at once."""

from __future__ import annotations

from itertools import chain

import torch

from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.spec_decode.rejection import accept_argmax, pad_flat, verify
from pagedllm.worker.sampler import filter_logits


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution at every row of ``logits`` (temperature, top-k/p, min-p)."""
    scaled = logits / p.temperature
    if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
        n, vocab = scaled.shape
        top_k = torch.full((n,), min(p.top_k, vocab) if p.top_k > 0 else vocab)
        scaled = filter_logits(scaled, top_k, torch.full((n,), float(p.top_p)), torch.full((n,), float(p.min_p)))
    return scaled.softmax(-1)


def _spans(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Row indices ``starts[i] .. starts[i] + lens[i] - 1`` for every i, concatenated."""
    offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    return torch.repeat_interleave(starts, lens) + offsets


def verify_drafts(logits: torch.Tensor, firsts: list[int], drafts: list[list[int]], params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> list[tuple[list[int], list[float]]]:
    """Sequence i's drafts ``drafts[i]`` are scored by rows ``firsts[i] .. firsts[i] + len(drafts[i])``
    of the step's float32 logits ``[N, vocab]``; returns per sequence the kept drafts plus the target's
    token, and each token's logprob under the raw model."""
    counts = torch.tensor([len(d) + 1 for d in drafts])
    starts = torch.tensor(firsts)
    rows = _spans(starts, counts)
    width = int(counts.max()) - 1
    draft_ids = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.int64).reshape(len(drafts), width)
    num_drafts = counts - 1
    greedy = torch.tensor([p.temperature == 0 for p in params])
    if bool(greedy.all()):  # only each row's argmax matters (numpy's: ~10x torch's on the CPU), padded as ids
        best = torch.from_numpy(logits.numpy().argmax(-1))[rows]
        kept = accept_argmax(pad_flat(best, counts.tolist()), draft_ids, num_drafts)
    else:
        dists = [lg if p.temperature == 0 else target_probs(lg, p)
                 for lg, p in zip(logits[rows].split(counts.tolist()), params)]
        kept = verify(pad_flat(torch.cat(dists), counts.tolist()), draft_ids, num_drafts, greedy, None, generators)
    lens = torch.tensor([len(t) for t in kept])
    tokens = torch.tensor(list(chain.from_iterable(kept)))
    lp = logits[_spans(starts, lens)].log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    return [(toks, x.tolist()) for toks, x in zip(kept, lp.split(lens.tolist()))]
