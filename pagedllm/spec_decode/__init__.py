"""Speculative decoding: proposers (n-gram lookup, suffix trees, a draft model) guess k tokens per
sequence, the target verifies them in one forward (``rejection``), the output is the target's."""

from pagedllm.spec_decode.config import METHODS, SpeculativeConfig, make_proposer
from pagedllm.spec_decode.proposer import Proposal, Proposer
from pagedllm.spec_decode.rejection import greedy_verify, pad_flat, rejection_sample, verify

__all__ = ["METHODS", "Proposal", "Proposer", "SpeculativeConfig", "greedy_verify", "make_proposer", "pad_flat",
           "rejection_sample", "verify"]
