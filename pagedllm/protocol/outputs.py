"""What generate() returns and the streaming interface yields."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Per-request timings (time.monotonic seconds) and prefix-cache reuse."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_tokens: int) -> float | None:
        if self.first_token_time is None or self.finished_time is None or num_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}, sampled token first
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # first entry None, as vLLM
    error: str | None = None  # serving the request failed (it was aborted; other requests went on)
    extra: dict = field(default_factory=dict)
