"""vLLM's ``prompt_logprobs`` response field: per prompt token, {token id: {logprob, rank, decoded_token}} for
the prompt's own token and the top ones (None at the first position, which nothing precedes)."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None  # 1 = most likely; None: the prompt's own token fell outside the top N
    decoded_token: str


def vllm_prompt_logprobs(entries: list[dict[int, float] | None], top_n: int,
                         token_text: Callable[[int], str]) -> list[dict[int, PromptLogprob] | None]:
    """``entries[i]`` is the engine's {token: logprob} at prompt position i, the prompt's token first, then
    the top ``top_n`` in order."""
    out: list[dict[int, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        items = list(entry.items())
        own, top = items[0], sorted(items[1:] if len(items) > top_n else items, key=lambda kv: -kv[1])[:top_n]
        ranks = {tid: r for r, (tid, _) in enumerate(top, 1)}
        out.append({tid: PromptLogprob(logprob=lp, rank=ranks.get(tid), decoded_token=token_text(tid))
                    for tid, lp in [own, *top]})
    return out
