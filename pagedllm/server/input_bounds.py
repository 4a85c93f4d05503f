"""Refusals that cost nothing: a prompt whose length in characters already proves it cannot fit the
context is refused before it is tokenized (a 7.9 MB prompt took 16-34 s of CPU to tokenize, only to be
refused for its length, and slowed every other client meanwhile).

No token covers more characters than the longest entry of the vocabulary (for byte-level BPE a
token's text is one character per byte, so its decoded text is never longer), so a prompt of
``c`` characters has at least ``c / longest`` tokens.
"""

from __future__ import annotations

import math

from pagedllm.server.errors import APIError

NORMALIZER_MARGIN = 2  # a normalizer (NFKC, say) may merge characters before the model sees them


class InputBounds:
    """The most characters a prompt (or a text to tokenize) may have: ``max_model_len`` tokens of the
    vocabulary's longest entry."""

    def __init__(self, tokenizer, max_model_len: int):
        self.max_model_len = max_model_len
        self.token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        margin = NORMALIZER_MARGIN if backend is None or backend.normalizer is not None else 1
        self.max_chars = max_model_len * self.token_chars * margin

    def check(self, chars: int, param: str) -> None:
        """400 naming ``param`` when ``chars`` characters must be more tokens than the context holds."""
        if chars > self.max_chars:
            at_least = math.ceil(chars * self.max_model_len / self.max_chars)
            raise APIError(400, f"{param} is {chars} characters, at least {at_least} tokens, which exceeds the "
                           f"context limit (max_model_len {self.max_model_len})",
                           param=param, code="context_length_exceeded")


def prompt_chars(prompt: object) -> int:
    """The longest text prompt's length in characters (a token-id prompt counts 0: its length is checked
    exactly, and cheaply, after)."""
    prompts = prompt if isinstance(prompt, list) else [prompt]
    return max((len(p) for p in prompts if isinstance(p, str)), default=0)
