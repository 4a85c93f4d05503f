"""A draft model proposer: a smaller model with the target's tokenizer, run on its own paged KV
(its own ``KVCache``, ``BlockPool`` and ``ForwardPass``), drafting greedily k tokens per step.

The draft's KV follows the accepted history: at each step the tokens it cached are compared with
the sequence's history, everything after the first difference (rejected drafts) is rolled back by
truncation (blocks past the new end return to the pool), and only the new tokens are computed.
``self_speculative_draft`` builds the draft from the target itself: its first L layers, final norm
and LM head, sharing the weights (no extra memory but the draft's KV).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models.forward_pass import ForwardPass, SeqChunk
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.spec_decode.proposer import Proposal, Proposer, check_num_tokens


def self_speculative_draft(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """The target's first ``num_layers`` layers + its final norm and head, sharing every weight."""
    if not 1 <= num_layers <= target.config.num_layers:
        raise ValueError(f"num_layers must be in 1..{target.config.num_layers}, got {num_layers}")
    draft = copy.copy(target)  # shallow: same tensors; the module dicts are copied so the target is untouched
    draft._modules = dict(target._modules)
    draft._parameters = dict(target._parameters)
    draft._buffers = dict(target._buffers)
    draft.layers = nn.ModuleList(list(target.layers)[:num_layers])
    draft.config = replace(target.config, num_layers=num_layers)
    return draft


def _device_of(model: LlamaForCausalLM) -> torch.device:
    """Where the model's weights live: its draft KV pool goes there too."""
    return next(model.parameters()).device


def load_draft(path: str, target: LlamaForCausalLM) -> LlamaForCausalLM:
    """A separate draft checkpoint, in the target's weight dtype; ValueError if the vocabularies differ."""
    from pagedllm.models.loader import load_checkpoint

    draft = LlamaForCausalLM.from_checkpoint(load_checkpoint(path), target.dtype).to(_device_of(target))
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config.model {path!r} has vocabulary {draft.config.vocab_size}, the target "
                         f"{target.config.vocab_size}: a draft model must share the target's tokenizer")
    draft.gather_weights()  # on the CPU: its few-row decode steps gain from 2 MB pages as the target's do
    return draft


@dataclass
class _DraftSeq:
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V the draft cache holds, in order
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    """Greedy drafts from ``model`` with a KV pool of its own, ``num_blocks`` blocks of ``block_size`` (16 whatever
    the target's: the draft's block tables never meet the target's, and 1024 blocks of the CPU's 128 would hold 8x
    the tokens a draft needs).

    A sequence the pool cannot hold gets no drafts this step (speculation degrades, never fails).
    """

    def __init__(self, model: LlamaForCausalLM, backend, num_blocks: int, block_size: int = 16,
                 kv_dtype: torch.dtype = torch.float32):
        cfg = model.config
        self.kv_cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size, kv_dtype,
                                device=_device_of(model))
        self.pool = BlockPool(num_blocks, block_size)
        self.runner = ForwardPass(model, self.kv_cache, backend)
        self.block_size = block_size
        self.seqs: dict[str, _DraftSeq] = {}

    def finish_request(self, req_id) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            self._resize(seq, 0)

    def _resize(self, seq: _DraftSeq, num_tokens: int) -> bool:
        """Make ``seq.blocks`` cover exactly ``num_tokens`` tokens; False (unchanged) if the pool is short."""
        need = -(-num_tokens // self.block_size)
        if need > len(seq.blocks):
            if need - len(seq.blocks) > self.pool.num_free:
                return False
            seq.blocks += self.pool.allocate_many(need - len(seq.blocks))
        while len(seq.blocks) > need:
            self.pool.free(seq.blocks.pop())
        return True

    @staticmethod
    def _common_prefix(a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        if n == 0:
            return 0
        diff = (torch.as_tensor(a[:n]) != torch.as_tensor(b[:n])).nonzero()
        return int(diff[0]) if len(diff) else n

    def propose(self, histories, num_tokens, req_ids=None) -> Proposal:
        check_num_tokens(histories, num_tokens, req_ids)
        if req_ids is None:
            raise ValueError("DraftModelProposer needs req_ids: it keeps a KV cache per request")
        drafts: list[list[int]] = [[] for _ in histories]
        # first pass: roll each sequence's cache back to the history and compute what it lacks
        live, chunks = [], []
        for i, (rid, hist, k) in enumerate(zip(req_ids, histories, num_tokens)):
            hist = list(hist)
            if k == 0 or not hist:
                continue
            seq = self.seqs.setdefault(rid, _DraftSeq())
            keep = min(self._common_prefix(seq.tokens, hist), len(hist) - 1)  # >= 1 token to compute
            del seq.tokens[keep:]
            if not self._resize(seq, len(hist) + k - 1):
                self._resize(seq, keep)
                continue
            chunks.append(SeqChunk(hist[keep:], keep, seq.blocks))
            seq.tokens = hist
            live.append(i)
        # then one decode step per draft token, the whole batch in each forward
        while live:
            nxt = self.runner.execute(chunks).argmax(-1).tolist()
            chunks, still = [], []
            for i, tok in zip(live, nxt):
                drafts[i].append(tok)
                if len(drafts[i]) < num_tokens[i]:
                    seq = self.seqs[req_ids[i]]
                    chunks.append(SeqChunk([tok], len(seq.tokens), seq.blocks))
                    seq.tokens.append(tok)
                    still.append(i)
            live = still
        return Proposal(drafts)
