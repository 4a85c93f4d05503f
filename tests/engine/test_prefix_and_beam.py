"""Prefix reuse across requests and beam search against Hugging Face."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams


def test_shared_system_prompt_computed_once(tiny_model_dir):
    """32 requests sharing a 500-token system prompt: it is prefilled once and its blocks are shared."""
    system = [1000 + (i * 37) % 20000 for i in range(500)]
    prompts = [system + [30000 + i, 30100 + i, 30200 + i] for i in range(32)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    used = {}
    computed = {}
    for caching in (True, False):
        llm = LLM(tiny_model_dir, kv_cache_memory=256 << 20, enable_prefix_caching=caching, check_integrity=True,
                  max_num_batched_tokens=4096, block_size=16)
        eng = llm.engine
        llm.generate([prompts[0]], sp, use_tqdm=False)  # warm the cache with one request
        rids = [eng.add_request(p, sp) for p in prompts[1:]]
        peak, finals = 0, {}
        while eng.has_unfinished():
            finals.update((o.request_id, o) for o in eng.step() if o.finished)
            peak = max(peak, eng.kv.stats()["used"])
        used[caching], computed[caching] = peak, eng.stats.prompt_tokens_computed
        reqs = [finals[r] for r in rids]
        eng.kv.check_integrity()
        assert eng.kv.stats()["used"] == 0
        if caching:
            # 31 full blocks of the system prompt, and its last 4 tokens from the first request's tail
            assert all(r.num_cached_tokens == 500 for r in reqs)
    assert computed[True] == 503 + 31 * 3  # prompt once, then each request's own 3 tokens (500 cached)
    assert computed[False] == 32 * 503
    assert used[True] < used[False]


def test_cache_salt_isolates_tenants(tiny_model_dir):
    llm = LLM(tiny_model_dir, kv_cache_memory=64 << 20, block_size=16)
    prompt = list(range(200, 300))
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], sp, use_tqdm=False, cache_salt="tenant-a")
    other = llm.generate([prompt], sp, use_tqdm=False, cache_salt="tenant-b")[0]
    same = llm.generate([prompt], sp, use_tqdm=False, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 99  # all but the last token: 6 blocks + tail
    assert llm.reset_prefix_cache() > 0
    llm.engine.kv.check_integrity()
    again = llm.generate([prompt], sp, use_tqdm=False, cache_salt="tenant-a")[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == same.outputs[0].token_ids


@pytest.mark.slow
def test_beam_search_matches_hf(smollm2_path, wiki_texts):
    """Width-4 beam search equals HF generate(num_beams=4, do_sample=False, early_stopping=True)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    llm = LLM(smollm2_path, dtype="float32", kv_cache_memory=128 << 20, block_size=16, check_integrity=True)
    tok = llm.tokenizer
    prompts = [tok.encode(t)[:12 + 5 * i] for i, t in enumerate(wiki_texts[10:15])]
    sp = SamplingParams(use_beam_search=True, beam_width=4, temperature=0, max_tokens=10, length_penalty=1.0)
    ours = llm.generate(prompts, sp, use_tqdm=False)
    for p, o in zip(prompts, ours):
        ref = hf.generate(torch.tensor([p]), num_beams=4, do_sample=False, early_stopping=True, max_new_tokens=10,
                          length_penalty=1.0, pad_token_id=tok.eos_token_id)[0, len(p):].tolist()
        while ref and ref[-1] == tok.eos_token_id and len(ref) > len(o.outputs[0].token_ids):
            ref.pop()  # HF pads finished hypotheses with eos
        assert o.outputs[0].token_ids == ref
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats()["used"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_arriving_together_share_a_prefix_being_computed(tiny_model_dir, async_scheduling):
    """8 requests with one 64-token system prompt submitted at once: the first computes it, the others
    wait a step and read its blocks instead of prefilling the same tokens concurrently (under async scheduling
    too, where the first step is still in flight when the second is scheduled: CUDA's default)."""
    llm = LLM(tiny_model_dir, device="cpu", kv_cache_memory=64 << 20, check_integrity=True,
              async_scheduling=async_scheduling, block_size=16)
    system = [500 + i for i in range(64)]
    prompts = [system + [9000 + i, 9100 + i, 9200 + i] for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert llm.engine.stats.prompt_tokens_computed == 67 + 7 * 3
    assert [o.num_cached_tokens for o in outs] == [0] + [64] * 7
    assert llm.engine.kv.stats()["used"] == 0
