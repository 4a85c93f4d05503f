"""Speculative decoding on the engine core's side: which sequences get drafts this step, how many,
and what came of them.

A proposer (``pagedllm.spec_decode``: n-gram, suffix, draft model) reads token histories and
returns draft tokens; the draft policy (``spec_decode.policy``) keeps the ones whose expected gain pays
for their verify rows, from the acceptance it has seen per confidence class and per request and from
the engine's measured step times; the scheduler gives each drafted sequence ``1 + k`` slots in one
chunk, the worker verifies the drafts in that same forward pass (``worker/spec_verify.py``), and the
core keeps the accepted ones, releases the rejected ones' slots and hashes only verified tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.sequence import Request, Sequence
from pagedllm.spec_decode import Proposer, SpeculativeConfig, make_proposer
from pagedllm.spec_decode.policy import DraftPolicy


@dataclass
class SpecStats:
    num_steps: int = 0  # sequence-steps that verified drafts
    num_drafts: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted sequence gains per step (accepted drafts + the target's own token)."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0


@dataclass
class Speculator:
    proposer: Proposer
    num_speculative_tokens: int
    stats: SpecStats = field(default_factory=SpecStats)

    def __post_init__(self) -> None:
        self.policy = DraftPolicy(self.num_speculative_tokens)

    @classmethod
    def from_config(cls, config: str | dict[str, Any] | None, worker=None) -> "Speculator | None":
        """vLLM's ``speculative_config`` (a dict or its JSON text); None: no speculation. A draft model
        needs the target's weights: ``worker`` is the in-process worker (the ``uni`` executor)."""
        if config is None or config == "":
            return None
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        cfg = SpeculativeConfig.from_dict(config)
        if cfg.method == "draft_model" and worker is None:
            raise ValueError("speculative_config.method 'draft_model' runs the draft beside the target: use "
                             "distributed_executor_backend='uni'")
        target, backend = (worker.model, worker.forward_pass.backend) if worker is not None else (None, None)
        return cls(make_proposer(cfg, target, backend), cfg.num_speculative_tokens)

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Drafts only where verification is exact and cheap: one sample, no beam, no penalty or bias
        (their values would change inside the drafted run), no logprobs asked, not opted out."""
        p = seq.request.params
        return (seq.num_uncomputed == 1 and seq.num_output_tokens >= max(p.min_tokens, 1) and p.n == 1
                and not p.use_beam_search and p.logprobs is None and not p.logit_bias
                and p.structured_outputs is None and p.speculative
                and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)

    def propose(self, running: list[Request], max_model_len: int) -> None:
        """Set ``spec_token_ids`` of the running sequences the policy drafts for (the scheduler may
        still drop them)."""
        seqs, caps, base = [], [], 0
        for req in running:
            for seq in req.seqs:
                if seq.finished:
                    continue
                base += 1
                if not self.eligible(seq):
                    continue
                p = req.params
                k = min(self.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                        max_model_len - seq.num_tokens - 1)
                if k > 0:
                    seqs.append(seq)
                    caps.append(k)
        if not seqs:
            return
        hists, ids = [s.token_ids for s in seqs], [s.request.request_id for s in seqs]
        if self.proposer.reports_match:  # cheap drafts: ask for the most, verify the ones worth it
            proposal = self.proposer.propose(hists, caps, ids)
            drafts = [d[:k] for d, k in zip(proposal.token_ids, caps)]
            keep = self.policy.choose(ids, proposal.match_len or [0] * len(seqs), [len(d) for d in drafts], base)
        else:  # every draft token costs a draft forward: decide first
            keep = self.policy.choose(ids, [0] * len(seqs), caps, base)
            drafts = self.proposer.propose(hists, keep, ids).token_ids if any(keep) else [[] for _ in seqs]
        for seq, d, k in zip(seqs, drafts, keep):
            seq.spec_token_ids = list(d[:k])

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.policy.observe_step(num_tokens, seconds)

    def start(self, request_id: str, prompt_ids: list[int]) -> None:
        self.proposer.start_request(request_id, prompt_ids)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int, gained: list[int]) -> None:
        """After verification: ``gained`` are the tokens the sequence got (kept drafts + the target's)."""
        self.proposer.on_accepted(seq.request.request_id, gained, num_drafts)
        self.stats.num_steps += 1
        self.stats.num_drafts += num_drafts
        self.stats.num_accepted += num_accepted
        self.policy.record(seq.request.request_id, num_drafts, num_accepted)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
        self.proposer.finish_request(request_id)
