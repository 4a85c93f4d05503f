"""The GPU oracle's HF side for lossy pools: HF over a PagedCache in that pool attends over K/V rounded as the
engine's pool rounds them, so the engine with that pool matches it token for token in fp32 (plain HF is only
close)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.bench import gpu_oracle
from pagedllm.models.paged_cache import hf_cache_kwargs


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _logits(model, ids: list[int], cache=None) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]), **hf_cache_kwargs(model, cache() if cache else None)).logits[0]


@pytest.mark.parametrize("kv", ["int8", "fp8_e5m2", "float16"])
def test_hf_over_the_pool_cache_sees_rounded_kv(tiny_hf, kv):
    """The pool's rounding reaches HF's logits (they move) and nothing else does (they stay close)."""
    ids = list(range(100, 140))
    cache = gpu_oracle.pool_cache(tiny_hf, "float32", kv, capacity=64)
    plain, pooled = _logits(tiny_hf, ids), _logits(tiny_hf, ids, cache)
    assert not torch.equal(plain, pooled)
    assert (plain - pooled).abs().max() < 0.1 * plain.abs().max()


def test_no_pool_cache_where_the_pool_keeps_the_model_dtype(tiny_hf):
    assert gpu_oracle.pool_cache(tiny_hf, "float32", "auto", 64) is None
    assert gpu_oracle.pool_cache(tiny_hf, "float32", "float32", 64) is None
    assert gpu_oracle.pool_cache(tiny_hf, "bfloat16", "bfloat16", 64) is None


@pytest.mark.parametrize("kv", ["int8", "fp8_e5m2"])
def test_the_engine_with_a_lossy_pool_matches_hf_over_the_same_pool(tiny_model_dir, kv):
    """fp32 weights: every token equal, no near-tie excused, on both CPU backends (prompts of 18-79 tokens end inside
    16-token blocks, so int8's per-block scales grow and re-round as decode fills them)."""
    rows = gpu_oracle.run(tiny_model_dir, "cpu", ["reference", "cpu"], ["float32"], [kv], n_prompts=3, max_tokens=10)
    assert [(r.backend, r.agreement, r.ties, r.verdict) for r in rows] == [
        ("reference", 1.0, 0, "close"), ("cpu", 1.0, 0, "close")]


@pytest.mark.parametrize("kv", ["fp8_e5m2", "fp8_e4m3"])
def test_the_engines_logprobs_are_hf_over_the_same_pool(tiny_model_dir, tiny_hf, kv):
    """The engine's greedy logprobs equal HF's over the pool cache (a pool that rounds each value alone: one forward
    over the whole sequence writes what the engine's prefill and decode steps wrote), not plain HF's."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.protocol.sampling_params import SamplingParams

    llm = LLM(tiny_model_dir, device="cpu", attention_backend="reference", dtype="float32", kv_cache_dtype=kv,
              block_size=16, kv_cache_memory=64 << 20)
    prompt = list(range(100, 140))
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.shutdown()
    ours = torch.tensor([lp[t] for t, lp in zip(out.token_ids, out.logprobs)])

    def hf(cache=None) -> torch.Tensor:
        logits = _logits(tiny_hf, prompt + out.token_ids[:-1], cache)[len(prompt) - 1:]
        return logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]

    pooled = (ours - hf(gpu_oracle.pool_cache(tiny_hf, "float32", kv, 64))).abs().max()
    plain = (ours - hf()).abs().max()
    assert pooled < 1e-4 and plain > 10 * pooled
