"""Engine behaviour on the embedded model: continuous batching must not change greedy output (in fp32: bf16
GEMMs round differently at each batch shape, so near-ties may flip)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow


def _prompts(tok, texts, n=40):
    """Mixed-length prompts (4..60 tokens) cut from real text, and per-request max_tokens."""
    prompts, params = [], []
    for i in range(n):
        ids = tok.encode(texts[i])[: 4 + (i * 7) % 57]
        prompts.append(ids)
        params.append(SamplingParams(temperature=0.0, max_tokens=4 + i % 5, ignore_eos=True))
    return prompts, params


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_clean(llm):
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.stats()["used"] == 0, "blocks still held after every request finished"


@pytest.fixture(scope="module")
def reference(smollm2_path, wiki_texts):
    """Every request run alone (batch of one) with plain settings."""
    llm = LLM(smollm2_path, dtype="float32", kv_cache_memory=256 << 20, block_size=16, enable_prefix_caching=False)
    prompts, params = _prompts(llm.tokenizer, wiki_texts)
    alone = [_tokens(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(prompts, params)]
    _assert_clean(llm)
    return prompts, params, alone


CONFIGS = {
    "continuous": dict(kv_cache_memory=256 << 20),
    "chunked-prefill": dict(kv_cache_memory=256 << 20, max_num_batched_tokens=24),
    "preempt-recompute": dict(num_blocks=24, max_num_batched_tokens=128),
    "preempt-swap": dict(num_blocks=24, max_num_batched_tokens=128, preemption_mode="swap", swap_space=64 << 20),
    "lpm": dict(kv_cache_memory=256 << 20, scheduling_policy="lpm"),
    "static": dict(kv_cache_memory=256 << 20, batching="static", max_num_seqs=16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_equals_alone(name, smollm2_path, reference):
    prompts, params, alone = reference
    llm = LLM(smollm2_path, dtype="float32", check_integrity=True, block_size=16, **CONFIGS[name])
    if name == "lpm":  # repeat a few prompts so prefix hits and reordering happen
        prompts, params, alone = prompts + prompts[30:], params + params[30:], alone + alone[30:]
    together = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert together == alone
    if name.startswith("preempt"):
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    if name == "lpm":
        assert llm.engine.stats.prompt_tokens_cached > 0
    _assert_clean(llm)
