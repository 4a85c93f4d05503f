"""What crosses the boundary between a front end (tokenizer, detokenizer, API) and the engine
core: requests in, token-id deltas out. Plain data, so the core can live in another process."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.protocol.lora_request import LoRARequest
from pagedllm.protocol.outputs import RequestMetrics
from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.protocol.step_io import Logprobs


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float | None = None
    priority: int = 0  # lower first, under the "priority" scheduling policy (vLLM's)
    lora_request: LoRARequest | None = None  # the adapter to run with (None: the base model)


@dataclass
class SeqDelta:
    """New tokens of one sample since the last output (for beam search: the whole hypothesis)."""

    index: int
    new_token_ids: list[int]
    cumulative_logprob: float
    logprobs: Logprobs | None = None  # one row per new token: the chosen token first, then the top k
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    replace: bool = False  # beam search: new_token_ids is the full output, not an increment


@dataclass
class EngineCoreOutput:
    request_id: str
    seqs: list[SeqDelta] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: Logprobs | None = None  # positions computed this step (prompt token 1 onwards)
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # the request was aborted because serving it failed
