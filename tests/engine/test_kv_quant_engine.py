"""The engine end to end with a quantized KV cache: a tiny model runs, SmolLM2 agrees with the fp32 cache."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.frontend.llm_engine import LLMEngine

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colours are",
           "Once upon a time, in a small village,"]


def _greedy(llm: LLM, n: int) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_tiny_model_runs_on_quantized_cache(tiny_model_dir, kv_dtype):
    llm = LLM(tiny_model_dir, kv_cache_dtype=kv_dtype, num_blocks=64, dtype="float32")
    kv = llm.engine.forward_pass.kv_cache
    assert kv.describe()["dtype"] == str(kv.dtype).removeprefix("torch.") and kv.scales is not None
    outs = _greedy(llm, 8)
    assert all(len(o) == 8 for o in outs)
    used = kv.data.view(torch.uint8) if kv_dtype.startswith("fp8") else kv.data
    assert bool(used.ne(0).any())  # the steps wrote codes into the pool
    if kv_dtype == "int8":  # block scales grow as blocks fill
        assert float(kv.scales.abs().sum()) > 0
    else:  # fp8: per-head scales stay at vLLM's uncalibrated 1.0
        assert bool((kv.scales == 1.0).all())


def test_bad_kv_cache_dtype_is_named(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLMEngine(model=tiny_model_dir, kv_cache_dtype="int4", num_blocks=8)


def test_smollm2_int8_cache_agrees_with_fp32_greedy(smollm2_path):
    """Greedy continuations from an int8 cache match the fp32 cache's on the first tokens of every prompt."""
    ref = _greedy(LLM(smollm2_path, dtype="float32", num_blocks=32), 12)
    got = _greedy(LLM(smollm2_path, dtype="float32", num_blocks=32, kv_cache_dtype="int8"), 12)
    agree = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got)]
    assert min(agree) >= 8, agree
    assert sum(agree) >= 0.9 * sum(len(r) for r in ref), agree
