"""Per-sequence grammar state and the batched bitmask: the engine keeps one ``GrammarState`` per
structured sequence, fills one bitmask row per sampled row each step, masks the logits in place,
then tells each state which token was sampled."""

from __future__ import annotations

import torch
import xgrammar as xgr


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar | None = None, *, matcher: xgr.GrammarMatcher | None = None):
        self._matcher = matcher if matcher is not None else xgr.GrammarMatcher(compiled)  # unlimited rollback

    def fork(self) -> "GrammarState":
        """An independent copy at the same position (a parallel sample forked from this sequence)."""
        return GrammarState(matcher=self._matcher.fork())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 words, one bit per token)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (state unchanged) if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a full match (only a stop token may follow, or more text)."""
        return self._matcher.is_completed()


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A ``[batch_size, ceil(vocab_size / 32)]`` int32 bitmask, every token allowed."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set the disallowed tokens' logits to -inf in place, for ``rows`` of the batch (all when None).

    ``bitmask`` has one row per logits row; rows not listed are left alone, so a batch that mixes
    structured and free sequences fills only the structured rows.
    """
    if rows is not None and not rows:
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=rows)
