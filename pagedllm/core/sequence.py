"""The engine core's view of requests: sequences (one stream of tokens with its own block table)
and the requests that own them. Workers hold their own copy of what they need (step_io.py); the
front end holds the text (output_processor.py)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from pagedllm.protocol.lora_request import LoRARequest, lora_id_of
from pagedllm.protocol.outputs import RequestMetrics
from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.protocol.step_io import PENDING_TOKEN


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
        "seq_id", "request", "index", "token_ids", "num_prompt_tokens", "num_computed", "num_sent",
        "status", "finish_reason", "stop_reason", "cumulative_logprob", "spec_token_ids", "num_pending",
    )

    def __init__(self, request: "Request", index: int, token_ids: list[int]):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed = 0
        self.num_sent = 0  # leading tokens the worker holds (0: the worker has not seen this sequence)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.cumulative_logprob = 0.0
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step (never hashed)
        self.num_pending = 0  # trailing PENDING_TOKENs: sampled by a step in flight (async scheduling)

    def add_pending(self) -> None:
        """A step in flight will sample this sequence's next token: hold its place (async scheduling)."""
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending += 1

    def append(self, token: int) -> None:
        """A sampled token: it fills the oldest pending place, if any, else goes at the end."""
        if self.num_pending:
            self.token_ids[len(self.token_ids) - self.num_pending] = token
            self.num_pending -= 1
        else:
            self.token_ids.append(token)

    def drop_pending(self) -> None:
        """A finished sequence forgets the tokens its steps in flight will sample (never shown)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0

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

    def fork(self, index: int) -> "Sequence":
        """A child with the same tokens and progress; the KV manager shares its blocks and the
        worker copies the parent's row (the child has seen what the parent has seen)."""
        child = Sequence(self.request, index, list(self.token_ids))
        child.num_computed = self.num_computed
        child.num_sent = self.num_sent
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
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
    priority: int = 0  # lower first, under the "priority" policy
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(init=False)
    beam_finished: list[tuple[float, Sequence]] = field(default_factory=list)  # beam search hypotheses
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def lora_id(self) -> int:
        return lora_id_of(self.lora_request)
