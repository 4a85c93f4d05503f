"""What crosses the boundary between the engine core and a worker: plain data only.

The core sends one ``SchedulerOutput`` per step. A sequence's prompt, settings and blocks travel
once (``NewSeqData``); afterwards each step carries only what changed (``ScheduledSeq``: the
tokens the worker has not seen, a block-table diff, how many tokens to compute). The worker
answers with a ``ModelRunnerOutput``: sampled token ids, plus logprobs when asked. Nothing here
holds a live engine object, so both pickle (``encode``/``decode``) to cross a process boundary.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedllm.protocol.lora_request import AdapterPages, LoRARequest
from pagedllm.protocol.sampling_params import SamplingParams

BlockPairs = list[tuple[int, int]]
PENDING_TOKEN = -1  # async scheduling: a token the worker sampled last step and the core has not seen yet


@dataclass
class NewSeqData:
    """A sequence the worker has not seen: its tokens so far, its settings, its sample index."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    sample_index: int = 0  # seeds its generator (seed * 1_000_003 + index), as parallel samples must differ
    lora: LoRARequest | None = None  # the adapter its tokens run with (None: the base model)


@dataclass
class ScheduledSeq:
    """One sequence's share of a step, as a diff against what the worker already holds."""

    seq_id: int
    num_computed: int  # tokens already in the KV cache (= first position computed now)
    num_tokens: int  # tokens computed this step
    new_token_ids: list[int] = field(default_factory=list)  # appended to the worker's copy first
    table_keep: int = 0  # the worker keeps this many leading block ids of its table ...
    new_block_ids: list[int] = field(default_factory=list)  # ... and appends these
    needs_logits: bool = True  # the chunk reaches the sequence's last token
    num_samples: int = 1  # > 1: a request's first token for n parallel samples (children forked next)
    beam_topk: int = 0  # > 0: return this many top logprobs for beam search instead of sampling
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt position computed in this chunk
    spec_token_ids: list[int] = field(default_factory=list)  # drafts, the last of num_tokens: verify them


@dataclass
class SchedulerOutput:
    """One step for the worker. Applied in field order: forks, finished, new, scheduled diffs,
    then swap-out, swap-in and copy-on-write block copies, adapter pages, then the forward pass."""

    forks: list[tuple[int, int, int]] = field(default_factory=list)  # (parent, child, child sample index)
    finished_seq_ids: list[int] = field(default_factory=list)  # rows the worker drops
    new_seqs: list[NewSeqData] = field(default_factory=list)
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # in the order outputs come back
    swap_out: BlockPairs = field(default_factory=list)  # (device, host)
    swap_in: BlockPairs = field(default_factory=list)  # (host, device)
    copies: BlockPairs = field(default_factory=list)  # copy-on-write (src, dst)
    grammar_bitmask: torch.Tensor | None = None  # [len(scheduled), words]: allowed next tokens, one bit each
    grammar_rows: list[int] = field(default_factory=list)  # indices into scheduled that the bitmask constrains
    lora_pages: list[AdapterPages] = field(default_factory=list)  # adapters to store in their pages (before the forward)
    defer_output: bool = False  # the core folds this step in after it launched the next: the worker may answer
    # with a ``DeferredOutput`` (its executor says whether it ever does: ``Executor.defers``)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class Logprobs:
    """Top logprobs of several positions as two tensors, not per-token dicts of Python objects."""

    token_ids: torch.Tensor  # [positions, k] int64, the chosen token first where there is one
    logprobs: torch.Tensor  # [positions, k] float32

    def as_dicts(self, k: int | None = None) -> list[dict[int, float]]:
        ids, vals = self.token_ids.tolist(), self.logprobs.tolist()
        return [dict(zip(i[:k], v[:k])) for i, v in zip(ids, vals)]


@dataclass
class SeqOutput:
    """What one scheduled sequence produced in a step (nothing for a mid-prompt chunk)."""

    seq_id: int
    token_ids: list[int] = field(default_factory=list)  # one per sample (num_samples); with drafts: the
    # accepted drafts then one token from the target; empty: no logits
    logprobs: list[float] = field(default_factory=list)  # of each sampled token
    top_logprobs: Logprobs | None = None  # [num_samples, 1 + k] when the request asked for logprobs
    beam_topk: Logprobs | None = None  # [1, beam_topk] for beam search
    prompt_logprobs: Logprobs | None = None  # [chunk positions, 1 + k]: next-token logprobs inside the prompt
    error: str | None = None  # sampling this sequence failed (the core aborts its request; others go on)


@dataclass
class ModelRunnerOutput:
    outputs: list[SeqOutput] = field(default_factory=list)  # one per ScheduledSeq, same order


class DeferredOutput:
    """A step's ``ModelRunnerOutput`` still on its way from the device (async scheduling, the worker in the
    core's own process): ``get`` waits for it once, and whoever needs it first (the core folding the step in,
    or the worker needing the host's copy of its tokens) pays that wait."""

    def __init__(self, settle: Callable[[], ModelRunnerOutput]) -> None:
        self._settle: Callable[[], ModelRunnerOutput] | None = settle
        self._out: ModelRunnerOutput | None = None

    @property
    def settled(self) -> bool:
        return self._settle is None

    def get(self) -> ModelRunnerOutput:
        if self._settle is not None:
            self._out, self._settle = self._settle(), None
        return self._out


def resolve(out: ModelRunnerOutput | DeferredOutput) -> ModelRunnerOutput:
    """The output itself, waited for if it was deferred."""
    return out.get() if isinstance(out, DeferredOutput) else out


def encode(obj: SchedulerOutput | ModelRunnerOutput) -> bytes:
    """Bytes for a pipe or socket (tensors included)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> SchedulerOutput | ModelRunnerOutput:
    obj = pickle.loads(data)
    if not isinstance(obj, (SchedulerOutput, ModelRunnerOutput)):
        raise TypeError(f"not a step message: {type(obj).__name__}")
    return obj
