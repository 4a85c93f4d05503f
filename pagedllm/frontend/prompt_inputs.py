"""vLLM's prompt forms for ``LLM.generate``: a string, a list of token ids, ``{"prompt": str}`` or
``{"prompt_token_ids": [...]}``, or a list of any of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PromptInput = str | list[int] | dict[str, Any]

_KEYS = ("prompt", "prompt_token_ids")


def _one(p: Any) -> str | list[int]:
    if isinstance(p, dict):
        given = [k for k in _KEYS if k in p]
        unknown = sorted(set(p) - set(_KEYS))
        if unknown:
            raise ValueError(f"prompt dict has unsupported keys {unknown}; use 'prompt' or 'prompt_token_ids'")
        if len(given) != 1:
            raise ValueError(f"a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids', got {sorted(p)}")
        p = p[given[0]]
        if given[0] == "prompt" and not isinstance(p, str):
            raise ValueError(f"'prompt' must be a string, got {type(p).__name__}")
        if given[0] == "prompt_token_ids" and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise ValueError("'prompt_token_ids' must be a list of integers")
    return p


def normalize_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[str | list[int]]:
    """Every prompt as text or token ids; one prompt of any form becomes a list of one."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [_one(p) for p in prompts]
