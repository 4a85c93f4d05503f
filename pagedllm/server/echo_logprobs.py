"""The prompt's part of a completion's ``logprobs`` under ``echo``, shaped as lm-eval reads it:
one entry per prompt token from the first, whose logprob is None (nothing precedes it)."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.server.protocol import CompletionLogprobs


def prompt_completion_logprobs(prompt_ids: list[int], prompt_logprobs: list[dict[int, float] | None],
                               token_text: Callable[[int], str]) -> CompletionLogprobs:
    """``prompt_logprobs[i]`` is the engine's {token: logprob} at prompt position i (None at 0); it
    holds the prompt token's own logprob besides the top ones."""
    if len(prompt_logprobs) != len(prompt_ids):
        raise RuntimeError(f"engine returned {len(prompt_logprobs)} prompt logprobs for {len(prompt_ids)} tokens")
    lp = CompletionLogprobs()
    offset = 0
    for tid, entry in zip(prompt_ids, prompt_logprobs):
        tok = token_text(tid)
        lp.tokens.append(tok)
        lp.token_logprobs.append(None if entry is None else entry[tid])
        lp.top_logprobs.append(None if entry is None else {token_text(t): v for t, v in entry.items()})
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp
