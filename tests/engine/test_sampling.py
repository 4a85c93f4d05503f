"""Sampling settings, parallel samples via fork/CoW, stop rules, logprobs, bad input."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(tiny_model_dir, kv_cache_memory=64 << 20, block_size=16, check_integrity=True)


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return LLM(smollm2_path, kv_cache_memory=128 << 20, block_size=16, check_integrity=True)


def _clean(llm):
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats()["used"] == 0


def test_n4_shares_prompt_blocks(tiny):
    """Seed 001: a 64-token prompt (4 blocks of 16) and 4 samples share the prompt blocks."""
    eng = tiny.engine
    prompt = list(range(100, 164))
    rid = eng.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True))
    req = eng.core.requests[rid]  # the core's view: its sequences and their blocks
    peak_used, prompt_refs, out = 0, [], None
    while out is None or not out.finished:
        out = next(o for o in eng.step() if o.request_id == rid)
        live = [s for s in req.seqs if not s.finished]
        if len(live) == 4:
            tables = [eng.kv.block_table(s.seq_id) for s in live]
            assert all(t[:4] == tables[0][:4] for t in tables), "prompt blocks must be shared, not copied"
            prompt_refs = [sum(t[:4] == tt[:4] for tt in tables) for t in tables]
            peak_used = max(peak_used, eng.kv.stats()["used"])
    # 4 shared prompt blocks + one private block per sample (10 tokens fit one block) = 8; naive: 4 x 5 = 20
    assert peak_used == 8
    assert prompt_refs == [4, 4, 4, 4]
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 10 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "4 samples at temperature 1 should differ"
    _clean(tiny)


def test_seed_reproducible_regardless_of_batch_mates(tiny, wiki_texts):
    sp = SamplingParams(n=2, temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tiny.generate([wiki_texts[0]], [sp], use_tqdm=False)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=5 + i, ignore_eos=True) for i in range(5)]
    mixed = tiny.generate(wiki_texts[1:6] + [wiki_texts[0]], others + [sp], use_tqdm=False)[-1]
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in mixed.outputs]
    _clean(tiny)


def test_stop_strings_stop_ids_min_tokens_and_logprobs(smol):
    base = smol.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    text = base.outputs[0].text
    word = text.split()[1] if len(text.split()) > 1 else text.strip()
    out = smol.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, stop=[word]),
                        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == word and word not in out.text
    first = base.outputs[0].token_ids[2]
    out = smol.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[first]),
                        use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == first and out.finish_reason == "stop" and len(out.token_ids) <= 3
    out = smol.generate(["Hi"], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == pytest.approx(max(lp.values()), abs=1e-5)  # greedy picks the top token
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)), abs=1e-4)
    eos = smol.engine.eos_token_ids[0]
    ids = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = smol.generate([list(ids)], SamplingParams(temperature=0, max_tokens=40, min_tokens=30), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 30 and eos not in out.outputs[0].token_ids[:30]
    _clean(smol)


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(max_tokens=-1), dict(top_p=0.0), dict(top_p=1.5), dict(n=0), dict(n=10_000),
    dict(temperature=-1), dict(stop=[3]), dict(use_beam_search=True, beam_width=2, n=3), dict(logprobs=99),
])
def test_bad_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_bad_requests_raise_before_scheduling(tiny):
    eng = tiny.engine
    for prompt in ["", [], [-1], [10**9], None, 3.5]:
        with pytest.raises(ValueError):
            tiny.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        tiny.generate([[5] * (eng.max_model_len + 1)], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError):  # one bad prompt: nothing of the batch is scheduled
        tiny.generate(["fine", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not eng.has_unfinished()
    _clean(tiny)


def test_penalties_change_distribution_vectorised():
    """The batched penalty transform equals a per-row loop (vLLM semantics)."""
    from pagedllm.worker.sampler import SamplingBatch, apply_penalties

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    settings = [dict(repetition_penalty=1.5), dict(presence_penalty=0.7, frequency_penalty=0.3), dict()]
    history = torch.tensor([[1, 2, 3, 7, 7, 9, 0, 0]] * 3)  # prompt [1, 2, 3], outputs [7, 7, 9], then padding
    batch = SamplingBatch([SamplingParams(**kw) for kw in settings], torch.zeros(3, dtype=torch.int64), history,
                          torch.tensor([3, 3, 3]), torch.tensor([6, 6, 6]))
    got = apply_penalties(logits.clone(), batch)
    want = logits.clone()
    for tok in {1, 2, 3, 7, 9}:
        want[0, tok] = want[0, tok] / 1.5 if want[0, tok] > 0 else want[0, tok] * 1.5
    want[1, 7] -= 0.7 + 2 * 0.3
    want[1, 9] -= 0.7 + 0.3
    assert torch.allclose(got, want)


def test_penalties_touch_only_history_tokens_with_the_dense_masks_values():
    """Gathering a row's history tokens, adjusting and scattering them back gives the bits of the dense
    ``[rows, vocab]`` masks, whatever the rows' lengths (padding slots repeat a row's first token)."""
    from pagedllm.worker.sampler import SamplingBatch, apply_penalties

    g = torch.Generator().manual_seed(4)
    rows, vocab, width = 6, 300, 40
    logits = torch.randn(rows, vocab, generator=g) * 3
    history = torch.randint(0, vocab, (rows, width), generator=g)
    num_prompt = torch.tensor([5, 1, 20, 39, 10, 2])
    num_tokens = torch.tensor([12, 1, 40, 39, 25, 2])  # outputs from num_prompt on; slots past num_tokens are padding
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
              SamplingParams(repetition_penalty=0.8), SamplingParams(frequency_penalty=-0.5),
              SamplingParams(presence_penalty=1.0), SamplingParams(), SamplingParams(repetition_penalty=2.0)]
    got = apply_penalties(logits, SamplingBatch(params, torch.zeros(rows, dtype=torch.int64), history, num_prompt,
                                                num_tokens))
    pos = torch.arange(width)[None, :]
    valid, out = pos < num_tokens[:, None], (pos < num_tokens[:, None]) & (pos >= num_prompt[:, None])
    counts = torch.zeros(rows, vocab + 1).scatter_add_(1, torch.where(out, history, vocab), torch.ones(rows, width))
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool).scatter_(1, torch.where(valid, history, vocab), True)
    counts, seen = counts[:, :vocab], seen[:, :vocab]
    rep = torch.tensor([p.repetition_penalty for p in params])[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params])[:, None]
    pres = torch.tensor([p.presence_penalty for p in params])[:, None]
    want = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    want = want - freq * counts - pres * (counts > 0).float()
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)
    empty = SamplingBatch(params, torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, 0, dtype=torch.int64),
                          torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64))
    assert apply_penalties(logits, empty) is logits


def test_top_k_top_p_min_p_filter():
    from pagedllm.worker.sampler import filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    out = filter_logits(logits, torch.tensor([2, 4, 4]), torch.tensor([1.0, 0.7, 1.0]), torch.tensor([0.0, 0.0, 0.2]))
    kept = torch.isfinite(out).tolist()
    assert kept == [[True, True, False, False], [True, True, False, False], [True, True, True, False]]
