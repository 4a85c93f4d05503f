"""Speculative decoding through the engine core: drafts verified in one forward pass, output token for
token the same as without speculation, rejected slots released, only verified tokens hashed, and the
rejection rule keeping the target's distribution."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode import Proposal, Proposer
from pagedllm.worker.spec_verify import verify_drafts


class OracleProposer(Proposer):
    """Proposes the known greedy continuation, with every third draft run wrong from its second token on
    (so both acceptance and rejection happen)."""

    def __init__(self, references: list[list[int]]) -> None:
        self.references = references
        self.calls = 0

    def propose(self, histories, num_tokens, req_ids=None) -> Proposal:
        out = []
        for h, k in zip(histories, num_tokens):
            self.calls += 1
            ref = next((r for r in self.references if r[: len(h)] == h), None)
            d = [] if ref is None else list(ref[len(h): len(h) + k])
            if self.calls % 3 == 0 and len(d) > 1:
                d[1:] = [(t + 1) % 1000 for t in d[1:]]
            out.append(d)
        return Proposal(out)


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_greedy_with_drafts_equals_greedy_without(model, tiny_model_dir, smollm2_path, wiki_texts):
    path = tiny_model_dir if model == "tiny" else smollm2_path
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [t[:200] for t in wiki_texts[:3]]
    # fp32: the exact path, whose tokens do not depend on how many rows a step has. (dtype auto on an AMX/AVX512-BF16
    # CPU is gguf-bf16: 3 plain decode rows read the exact blocks, 3 x 5 verify rows run as bf16 GEMMs)
    plain = LLM(path, kv_cache_memory=64 << 20, block_size=16, dtype="float32")
    ref = plain.generate(prompts, sp, use_tqdm=False)
    full = [o.prompt_token_ids + o.outputs[0].token_ids for o in ref]
    proposer = OracleProposer(full)
    spec = LLM(path, kv_cache_memory=64 << 20, check_integrity=True, dtype="float32",
               speculative_config='{"method": "ngram", "num_speculative_tokens": 4}', block_size=16)
    spec.engine.core.speculator.proposer = proposer
    got = spec.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    stats = spec.engine.core.speculator.stats
    assert 0 < stats.num_accepted < stats.num_drafts  # some drafts kept, some rejected
    assert stats.mean_accepted_length > 1.5
    assert spec.engine.stats.num_steps < plain.engine.stats.num_steps  # fewer forward passes
    spec.engine.kv.check_integrity()
    assert spec.engine.kv.stats()["used"] == 0


def test_rejection_rule_keeps_the_target_distribution():
    """Drafts without a distribution (one-hot q): the first token's law must be softmax(logits[0])."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8)
    want = logits[0].softmax(-1)
    g = torch.Generator().manual_seed(1)
    p = SamplingParams(temperature=1.0)
    counts = torch.zeros(8)
    n = 4000
    for _ in range(n):
        (toks, _), = verify_drafts(logits, [0], [[3, 5]], [p], [g])
        counts[toks[0]] += 1
    tv = 0.5 * (counts / n - want).abs().sum()
    assert tv < 0.05, f"total variation {tv:.3f}"  # ~0.016 expected at this n; a biased rule gives > 0.3


def test_ngram_drafts_under_preemption_and_abort(tiny_model_dir):
    """A random tiny model loops, so n-gram drafts get verified (kept and rejected); on a pool small
    enough to preempt, with an abort mid-speculation, the output equals speculation-free greedy and
    no block leaks."""
    prompts = [[100 + (i * 7 + j) % 50 for j in range(40)] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    small = dict(num_blocks=14, max_num_batched_tokens=64, check_integrity=True)
    ref = LLM(tiny_model_dir, block_size=16, **small).generate(prompts, sp, use_tqdm=False)
    llm = LLM(tiny_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, block_size=16,
              **small)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    eng = llm.engine
    stats = eng.core.speculator.stats
    assert stats.num_drafts > 0 and eng.scheduler.num_preemptions > 0
    before = stats.num_drafts
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative=False),
                 use_tqdm=False)
    assert stats.num_drafts == before  # the request opted out
    rid = eng.add_request(prompts[0], sp)
    for _ in range(45):  # into the decode phase, drafting
        eng.step()
    eng.abort_request(rid)
    eng.kv.check_integrity()
    assert eng.kv.stats()["used"] == 0 and not eng.has_unfinished()
