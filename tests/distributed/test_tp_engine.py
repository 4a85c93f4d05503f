"""The engine with --tensor-parallel-size 2: the core drives two sharded worker processes; outputs equal
TP=1's token for token (greedy, seeded parallel samples, beam search), with chunked prefill and the
prefix cache on, and no block leaks."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams


def test_tp2_engine_equals_tp1(tiny_model_dir, wiki_texts):
    prompts = [t[:300] for t in wiki_texts[:3]] + [wiki_texts[0][:300] + " And"]  # a shared prefix
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
              SamplingParams(use_beam_search=True, beam_width=2, temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    kw = dict(kv_cache_memory=16 << 20, max_num_batched_tokens=64, check_integrity=True)
    one = LLM(tiny_model_dir, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **kw)
    two = llm.generate(prompts, params, use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in two] == [[o.token_ids for o in r.outputs] for r in one]
    assert two[3].num_cached_tokens > 0
    assert llm.engine.kv.stats()["used"] == 0
    llm.engine.shutdown()
