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
    kw = dict(device="cpu", kv_cache_memory=16 << 20, max_num_batched_tokens=64, check_integrity=True)  # gloo ranks
    one = LLM(tiny_model_dir, block_size=16, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, block_size=16, **kw)
    two = llm.generate(prompts, params, use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in two] == [[o.token_ids for o in r.outputs] for r in one]
    assert two[3].num_cached_tokens > 0
    assert llm.engine.kv.stats()["used"] == 0
    llm.engine.shutdown()


def test_tp2_engine_preempts_like_tp1(tiny_model_dir, wiki_texts):
    """A pool too small for the batch: sequences are preempted (recomputed, or swapped to each rank's host tier)
    and the greedy tokens still equal an unconstrained TP=1 run's."""
    prompts = [t[:240] for t in wiki_texts[4:10]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = LLM(tiny_model_dir, device="cpu", kv_cache_memory=16 << 20, block_size=16).generate(prompts, params,
               use_tqdm=False)
    for mode in ({}, {"preemption_mode": "swap", "swap_space": 8 << 20}):
        llm = LLM(tiny_model_dir, device="cpu", tensor_parallel_size=2, num_blocks=16, block_size=16,
                  check_integrity=True, **mode)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in want], mode
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"
        assert llm.engine.kv.stats()["used"] == 0
        llm.engine.shutdown()
