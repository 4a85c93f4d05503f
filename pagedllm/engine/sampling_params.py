"""Per-request generation settings, validated before anything is scheduled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.structured import StructuredOutputsParams

MAX_N = 16  # upper bound on parallel samples / beam width per request


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

        need(isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        need(isinstance(self.max_tokens, int) and self.max_tokens > 0, f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        need(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        need(isinstance(self.temperature, (int, float)) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        need(isinstance(self.top_k, int) and self.top_k >= -1, f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        need(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        need(isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            val = getattr(self, name)
            need(isinstance(val, (int, float)) and -2 <= val <= 2, f"{name} must be in [-2, 2], got {val!r}")
        need(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        need(isinstance(self.stop_token_ids, list) and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.use_beam_search:
            need(isinstance(self.beam_width, int) and 2 <= self.beam_width <= MAX_N,
                 f"beam_width must be an integer in [2, {MAX_N}], got {self.beam_width!r}")
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
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.logit_bias),
                f"logit_bias keys must be non-negative token ids, got {self.logit_bias!r}")
            need(all(isinstance(v, (int, float)) and -100 <= v <= 100 for v in self.logit_bias.values()),
                 f"logit_bias values must be numbers in [-100, 100], got {self.logit_bias!r}")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
             f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        need(isinstance(self.include_stop_str_in_output, bool),
             f"include_stop_str_in_output must be a boolean, got {self.include_stop_str_in_output!r}")
        need(self.truncate_prompt_tokens is None or (isinstance(self.truncate_prompt_tokens, int)
                                                     and self.truncate_prompt_tokens >= 1),
             f"truncate_prompt_tokens must be a positive integer, got {self.truncate_prompt_tokens!r}")
        if self.best_of is not None:
            need(isinstance(self.best_of, int) and self.n <= self.best_of <= MAX_N,
                 f"best_of must be an integer in [n, {MAX_N}] (n={self.n}), got {self.best_of!r}")
            need(not self.use_beam_search, "best_of cannot be combined with beam search (use beam_width)")
