"""The interface every speculative proposer implements: the engine asks for up to k draft tokens per
sequence each step, verifies them with the target, and tells the proposer what it accepted."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """Draft tokens of a batch. ``token_ids[i]`` may be shorter than asked, or empty (no guess).
    ``probs[i]`` is the draft distribution ``[len(token_ids[i]), vocab]`` the tokens were sampled
    from, or the whole field is None when the drafts are deterministic (ngram, suffix, greedy draft
    model): the verifier then treats each draft as one-hot."""

    token_ids: list[list[int]]
    probs: list[torch.Tensor] | None = None
    match_len: list[int] | None = None  # context tokens each draft continues (ngram, suffix): its confidence


class Proposer(ABC):
    """Proposes draft tokens from each sequence's token history (prompt + accepted output).

    The request hooks are optional: stateless proposers ignore them, stateful ones (suffix trees, a
    draft model's KV, n-gram history arrays) keep per-request state between steps and release it on finish.
    ``reports_match``: proposals carry ``match_len`` and cost little, so the engine asks for the most
    drafts and keeps the ones worth verifying; otherwise (a draft model: every draft token is a forward)
    it decides how many to ask for first.
    """

    reports_match: bool = False

    @abstractmethod
    def propose(self, histories: Sequence[Sequence[int]], num_tokens: Sequence[int],
                req_ids: Sequence[str] | None = None) -> Proposal:
        """Up to ``num_tokens[i]`` drafts continuing ``histories[i]`` (prompt + accepted output)."""

    def start_request(self, req_id: str, prompt_ids: Sequence[int]) -> None:
        """A request entered the engine."""

    def finish_request(self, req_id: str) -> None:
        """A request finished or was aborted: drop (or archive) its state."""

    def on_accepted(self, req_id: str, accepted_ids: Sequence[int], num_drafts: int) -> None:
        """Feedback after verification: the tokens the request gained this step (accepted drafts +
        the target's own token) out of ``num_drafts`` proposed."""


def check_num_tokens(histories: Sequence[Sequence[int]], num_tokens: Sequence[int],
                     req_ids: Sequence[str] | None) -> None:
    """ValueError unless the batch arguments line up."""
    if len(num_tokens) != len(histories):
        raise ValueError(f"num_tokens has {len(num_tokens)} entries for {len(histories)} histories")
    if req_ids is not None and len(req_ids) != len(histories):
        raise ValueError(f"req_ids has {len(req_ids)} entries for {len(histories)} histories")
    if any(k < 0 for k in num_tokens):
        raise ValueError(f"num_tokens must be >= 0, got {list(num_tokens)}")
