"""Async scheduling (step N+1 scheduled and run before step N's tokens are folded in) equals the
synchronous path token for token, shows no token past a stop found a step late, and leaks no block
after stops, aborts and preemptions."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams


def _pair(path, **kw):
    return [LLM(path, check_integrity=True, async_scheduling=flag, block_size=16, **kw) for flag in (False, True)]


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir):
    return _pair(tiny_model_dir, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def small_pool_pair(tiny_model_dir):
    """A pool of 24 blocks of 16: a dozen 40-token requests growing to 100 tokens must preempt."""
    return _pair(tiny_model_dir, num_blocks=24, max_num_seqs=12)


@pytest.fixture(scope="module")
def smol_pair(smollm2_path):
    return _pair(smollm2_path, kv_cache_memory=128 << 20)


def _clean(llm):
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats()["used"] == 0
    assert not llm.engine.has_unfinished()


def _outs(llm, prompts, params):
    res = llm.generate(prompts, params, use_tqdm=False)
    return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in r.outputs] for r in res]


def test_async_flag_and_overlap_happen(tiny_pair):
    sync, on = tiny_pair
    assert not sync.engine.core.async_scheduling and on.engine.core.async_scheduling
    eng = on.engine
    eng.add_request([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.step()  # the prefill stays in flight: no token comes back yet
    assert eng.core._in_flight is not None
    seq = eng.core.scheduler.running[0].seqs[0]
    assert seq.num_pending == 1 and seq.token_ids[-1] == -1
    while eng.has_unfinished():
        eng.step()
    _clean(on)


def test_greedy_identical_with_stops_and_lengths(tiny_pair):
    prompts = [[100 + i] * (3 + 7 * i) for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=1 + 5 * i, ignore_eos=True) for i in range(8)]
    sync, on = tiny_pair
    want = _outs(sync, prompts, params)
    assert _outs(on, prompts, params) == want
    # a stop id found a step late: the token after it is never shown
    long = _outs(sync, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stops = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[o[0][0][2]]) for o in long]
    want = _outs(sync, prompts, stops)
    assert all(o[0][2] == "stop" and len(o[0][0]) <= 3 for o in want)
    assert _outs(on, prompts, stops) == want
    _clean(sync)
    _clean(on)


def test_seeded_and_penalised_sampling_identical(tiny_pair):
    prompts = [[300 + i] * (5 + i) for i in range(5)]
    params = [SamplingParams(temperature=0.9, top_k=40, seed=11 + i, max_tokens=12, repetition_penalty=1.2,
                             ignore_eos=True, logprobs=2) for i in range(5)]
    sync, on = tiny_pair
    assert _outs(on, prompts, params) == _outs(sync, prompts, params)
    _clean(on)


def test_preemptions_under_overlap_identical_and_leak_free(small_pool_pair):
    prompts = [[400 + i] * 40 for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    sync, on = small_pool_pair
    want = _outs(sync, prompts, params)
    assert _outs(on, prompts, params) == want
    assert on.engine.core.scheduler.num_preemptions > 0
    _clean(on)


def test_aborts_while_in_flight_leak_nothing(tiny_pair):
    _, on = tiny_pair
    eng = on.engine
    ids = [eng.add_request([7 + i] * 20, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
           for i in range(6)]
    for _ in range(3):
        eng.step()
    assert eng.core._in_flight is not None
    for rid in ids[::2]:
        eng.abort_request(rid)
    eng.step()
    for rid in ids[1::2]:  # aborted right after they were scheduled again
        eng.abort_request(rid)
    while eng.has_unfinished():
        eng.step()
    _clean(on)


def test_mixed_with_requests_that_run_synchronously(tiny_pair):
    """Parallel samples and beam search need their tokens before the next step: they share the engine."""
    prompts = [[50] * 10, [60] * 12, [70] * 9]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True),
              SamplingParams(use_beam_search=True, beam_width=2, n=2, temperature=0, max_tokens=5, ignore_eos=True)]
    sync, on = tiny_pair
    assert _outs(on, prompts, params) == _outs(sync, prompts, params)
    _clean(on)


def test_stop_strings_on_real_text(smol_pair):
    sync, on = smol_pair
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    base = _outs(sync, prompts, SamplingParams(temperature=0, max_tokens=16))
    assert _outs(on, prompts, SamplingParams(temperature=0, max_tokens=16)) == base
    stops = [SamplingParams(temperature=0, max_tokens=16, stop=[o[0][1].split()[1]]) for o in base]
    want = _outs(sync, prompts, stops)
    assert all(o[0][2] == "stop" for o in want)
    assert _outs(on, prompts, stops) == want
    _clean(sync)
    _clean(on)
