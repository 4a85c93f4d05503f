"""Suffix decoding (vLLM's ``suffix``, after Arctic Inference): each request gets a suffix trie
over its own prompt + output, and one global trie holds the outputs of recently finished requests
(an LRU of at most ``max_cached_requests``, evicted streams are removed from the trie so memory
stays bounded). A proposal follows the most frequent continuation of the sequence's tail in
whichever trie scores higher."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from pagedllm.spec_decode.proposer import Proposal, Proposer, check_num_tokens
from pagedllm.spec_decode.suffix_tree import SuffixTrie


@dataclass
class _Request:
    trie: SuffixTrie
    seen: int  # history tokens already in the trie
    output: list[int] = field(default_factory=list)  # tokens after the prompt, for the global trie


class SuffixProposer(Proposer):
    reports_match = True

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000, max_match: int = 16,
                 min_token_prob: float = 0.1):
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {max_match}")
        self.max_depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.max_match = max_match
        self.min_prob = min_token_prob
        self.global_trie = SuffixTrie(max_tree_depth)
        self.cached: OrderedDict[int, list[int]] = OrderedDict()  # finished outputs, oldest first
        self._keys = itertools.count()
        self.requests: dict[str, _Request] = {}

    def start_request(self, req_id, prompt_ids) -> None:
        trie = SuffixTrie(self.max_depth)
        trie.extend(req_id, prompt_ids)
        self.requests[req_id] = _Request(trie, len(prompt_ids))

    def finish_request(self, req_id) -> None:
        req = self.requests.pop(req_id, None)
        if req is None or self.max_cached == 0:
            return
        output = req.output
        if not output:
            return
        key = next(self._keys)  # not req_id: an id may be reused, each stream must be removable
        self.global_trie.extend(key, output)
        self.global_trie.close(key)
        self.cached[key] = output
        while len(self.cached) > self.max_cached:
            _, old = self.cached.popitem(last=False)
            self.global_trie.remove(old)

    def _sync(self, req_id: str, history) -> _Request:
        """The request's trie brought up to ``history`` (a request seen for the first time starts
        with its whole history as the prompt)."""
        req = self.requests.get(req_id)
        if req is None or len(history) < req.seen:  # unknown, or history rewritten: start over
            self.start_request(req_id, list(history))
            return self.requests[req_id]
        new = history[req.seen:]
        if new:
            req.trie.extend(req_id, new)
            req.output.extend(new)
            req.seen = len(history)
        return req

    def propose(self, histories, num_tokens, req_ids=None) -> Proposal:
        check_num_tokens(histories, num_tokens, req_ids)
        if req_ids is None:
            raise ValueError("SuffixProposer needs req_ids: it keeps a suffix tree per request")
        drafts, lens = [], []
        for rid, hist, k in zip(req_ids, histories, num_tokens):
            req = self._sync(rid, hist)
            if k == 0:
                drafts.append([])
                lens.append(0)
                continue
            own = req.trie.continuation(hist, k, self.max_match, self.min_prob)
            other = self.global_trie.continuation(hist, k, self.max_match, self.min_prob)
            tokens, _, match = max(own, other, key=lambda c: (c[1], c[2]))
            drafts.append(tokens)
            lens.append(match if tokens else 0)
        return Proposal(drafts, match_len=lens)
