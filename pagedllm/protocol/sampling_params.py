"""Per-request generation settings, validated before anything is scheduled."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.structured import StructuredOutputsParams

MAX_N = 16  # upper bound on parallel samples / beam width per request
# Documented bounds (vLLM's, made strict: out of range is an error, never a silent clamp).
MAX_INT32 = 2**31 - 1  # max_tokens, min_tokens, top_k, truncate_prompt_tokens
SEED_RANGE = (-(2**63), 2**63)  # seeds are 64-bit signed integers (half-open range)
MIN_TEMPERATURE = 1e-2  # below this (but above 0, greedy) the softmax overflows in fp32; vLLM clamps here
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 2.0


def is_int(v: object) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` in Python, never a count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object, lo: float, hi: float) -> bool:
    """A finite int or float in [lo, hi] (NaN and infinities fail)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi


def is_text(v: object) -> bool:
    """A str that encodes to UTF-8 (a lone surrogate such as "\\ud800" does not)."""
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class SamplingParams:
    """vLLM-shaped sampling settings. ``temperature == 0`` means greedy."""

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    use_beam_search: bool = False
    beam_width: int = 4
    length_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # the output must match a grammar
    logit_bias: dict[int, float] | None = None  # added to the token's logit before sampling
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (the first is None)
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    speculative: bool = True  # False: no draft tokens for this request when the engine speculates

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the bad field; called on construction and on admission."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        need(is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT32,
             f"max_tokens must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}")
        need(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        need(is_number(self.temperature, 0, MAX_TEMPERATURE)
             and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE),
             f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {self.temperature!r}")
        need(is_int(self.top_k) and -1 <= self.top_k <= MAX_INT32,
             f"top_k must be -1, 0 (off) or a positive integer up to {MAX_INT32}, got {self.top_k!r}")
        need(is_number(self.top_p, 0, 1) and self.top_p > 0, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(is_number(self.min_p, 0, 1), f"min_p must be in [0, 1], got {self.min_p!r}")
        need(is_number(self.repetition_penalty, 0, MAX_REPETITION_PENALTY) and self.repetition_penalty > 0,
             f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            val = getattr(self, name)
            need(is_number(val, -2, 2), f"{name} must be in [-2, 2], got {val!r}")
        need(self.seed is None or (is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
             f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        need(isinstance(self.stop, list) and all(is_text(s) and s for s in self.stop),
             f"stop must be a non-empty UTF-8 string or a list of them, got {self.stop!r}")
        need(isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        need(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
             f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        for name in ("ignore_eos", "use_beam_search", "skip_special_tokens"):
            need(isinstance(getattr(self, name), bool), f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.use_beam_search:
            need(is_int(self.beam_width) and 2 <= self.beam_width <= MAX_N,
                 f"beam_width must be an integer in [2, {MAX_N}], got {self.beam_width!r}")
            need(is_number(self.length_penalty, -100, 100),
                 f"length_penalty must be a number in [-100, 100], got {self.length_penalty!r}")
            need(self.n <= self.beam_width, f"n ({self.n}) must not exceed beam_width ({self.beam_width})")
        self._validate_extras(need)

    def _validate_extras(self, need) -> None:
        """The vLLM extras: structured outputs, logit bias, prompt logprobs, best_of, truncation."""
        if self.structured_outputs is not None:
            from pagedllm.structured import StructuredOutputsParams

            need(isinstance(self.structured_outputs, StructuredOutputsParams),
                 f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
            need(not self.use_beam_search, "structured_outputs cannot be combined with beam search")
        if self.logit_bias is not None:
            need(isinstance(self.logit_bias, dict) and all(
                is_int(t) and t >= 0 for t in self.logit_bias),
                f"logit_bias keys must be non-negative token ids, got {self.logit_bias!r}")
            need(all(is_number(v, -100, 100) for v in self.logit_bias.values()),
                 f"logit_bias values must be numbers in [-100, 100], got {self.logit_bias!r}")
        need(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
             f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        need(isinstance(self.speculative, bool), f"speculative must be a boolean, got {self.speculative!r}")
        need(isinstance(self.include_stop_str_in_output, bool),
             f"include_stop_str_in_output must be a boolean, got {self.include_stop_str_in_output!r}")
        need(self.truncate_prompt_tokens is None or (is_int(self.truncate_prompt_tokens)
                                                     and 1 <= self.truncate_prompt_tokens <= MAX_INT32),
             f"truncate_prompt_tokens must be an integer in [1, {MAX_INT32}], got {self.truncate_prompt_tokens!r}")
        if self.best_of is not None:
            need(is_int(self.best_of) and self.n <= self.best_of <= MAX_N,
                 f"best_of must be an integer in [n, {MAX_N}] (n={self.n}), got {self.best_of!r}")
            need(not self.use_beam_search, "best_of cannot be combined with beam search (use beam_width)")
