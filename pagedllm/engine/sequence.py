"""Sequences (one stream of tokens with its own block table) and the requests that own them."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from pagedllm.engine.outputs import RequestMetrics
from pagedllm.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"  # blocks released; recomputes prompt + outputs when readmitted
    SWAPPED = "swapped"  # blocks copied to the host tier
    FINISHED = "finished"

    @property
    def is_running(self) -> bool:
        return self in (SequenceStatus.PREFILLING, SequenceStatus.DECODING)


_seq_ids = itertools.count()


class Sequence:
    """Token ids (prompt + output) and how many of them already have K/V in the pool."""

    __slots__ = (
        "seq_id", "request", "index", "token_ids", "num_prompt_tokens", "num_computed",
        "num_hashed", "status", "finish_reason", "stop_reason", "cumulative_logprob", "logprobs",
        "generator", "text",
    )

    def __init__(self, request: "Request", index: int, token_ids: list[int], generator: torch.Generator | None):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed = 0
        self.num_hashed = 0  # full blocks already registered in the prefix cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if request.params.logprobs is not None else None
        self.generator = generator
        self.text = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int, generator: torch.Generator | None) -> "Sequence":
        """A child with the same tokens and progress; the KV manager shares its blocks."""
        child = Sequence(self.request, index, list(self.token_ids), generator)
        child.num_computed = self.num_computed
        child.num_hashed = self.num_hashed
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        if self.logprobs is not None:
            child.logprobs = list(self.logprobs)
        return child


@dataclass
class Request:
    """One user request: a prompt, its settings and the sequences sampling from it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(init=False)
    beam_finished: list[tuple[float, Sequence]] = field(default_factory=list)  # beam search hypotheses

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    def make_generator(self, index: int) -> torch.Generator | None:
        """Seeded requests get one generator per sample so results do not depend on batch mates."""
        if self.params.seed is None:
            return None
        g = torch.Generator()
        g.manual_seed(self.params.seed * 1_000_003 + index)
        return g

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
