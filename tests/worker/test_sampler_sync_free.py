"""The sampler without host syncs: hashed exponential-race noise draws from the right distribution,
seeded rows do not depend on their batch mates, and no step reads a tensor back to the host."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.worker.noise import exponential_noise, noise_key
from pagedllm.worker.sampler import Sampler, SamplingBatch


class SyncTrap(torch.Tensor):
    """A tensor that fails on every read back to the host (what a device tensor would sync on)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.READS:
            raise AssertionError(f"host sync: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _batch(params, vocab=64, width=8, trap=False):
    n = len(params)
    wrap = (lambda t: t.as_subclass(SyncTrap)) if trap else (lambda t: t)
    torch.manual_seed(0)
    logits = wrap(torch.randn(n, vocab))
    history = wrap(torch.randint(0, vocab, (n, width)))
    keys = wrap(torch.tensor([noise_key(p.seed, 0) for p in params], dtype=torch.int64))
    return logits, SamplingBatch(params, keys, history, wrap(torch.full((n,), 3)), wrap(torch.full((n,), width)))


def test_no_host_sync_with_every_setting():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=5, seed=1),
              SamplingParams(temperature=1.0, seed=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.2, min_tokens=10, max_tokens=20, stop_token_ids=[3, 7], logprobs=4,
                             logit_bias={5: 2.0})]
    logits, batch = _batch(params, trap=True)
    out = Sampler([2])(logits, batch)
    with pytest.raises(AssertionError, match="host sync"):
        out.token_ids.tolist()  # the trap works: the results are still trapped tensors
    plain_logits, plain = _batch(params)
    want = Sampler([2])(plain_logits, plain)
    assert torch.equal(out.token_ids.as_subclass(torch.Tensor), want.token_ids)
    assert out.top_ids.shape == (3, 5)


def test_the_sampler_never_writes_its_logits():
    """The model runner hands the step's logits themselves to the sampler when every row is sampled once, in order
    (no copy): every setting leaves them as they were."""
    params = [SamplingParams(temperature=0, logit_bias={1: 5.0}, min_tokens=9, stop_token_ids=[4]),
              SamplingParams(temperature=0.7, top_k=3, top_p=0.8, min_p=0.1, seed=3, repetition_penalty=1.5,
                             presence_penalty=0.5, frequency_penalty=0.3, logprobs=2)]
    logits, batch = _batch(params)
    before = logits.clone()
    Sampler([2])(logits, batch)
    assert torch.equal(logits, before)


def test_min_tokens_bans_stop_tokens_until_reached():
    params = [SamplingParams(temperature=0, min_tokens=10, stop_token_ids=[9]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9])]
    logits = torch.zeros(2, 16)
    logits[:, 9] = 5.0  # the stop id would win
    logits[:, 2] = 4.0  # then eos
    batch = SamplingBatch(params, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.int64),
                          torch.tensor([3, 3]), torch.tensor([8, 8]))  # 5 outputs so far
    assert Sampler([2])(logits, batch).token_ids.tolist() == [0, 9]  # row 0: stop id and eos banned


def test_exponential_race_draws_the_distribution():
    """Many rows with different keys sample a known 4-token distribution at its frequencies."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    keys = torch.arange(n, dtype=torch.int64) * 7919
    noise = exponential_noise(keys, torch.full((n,), 11), 4)
    assert float(noise.mean()) == pytest.approx(1.0, abs=0.02)
    freq = torch.bincount((probs / noise).argmax(-1), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.012), freq
    # one row over many steps (counters) too: a sequence's own draws follow the distribution
    steps = exponential_noise(torch.full((n,), 12345), torch.arange(n), 4)
    freq = torch.bincount((probs / steps).argmax(-1), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.012), freq


def test_seeded_rows_ignore_batch_mates_and_order():
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    torch.manual_seed(1)
    row = torch.randn(1, 200)
    key = torch.tensor([noise_key(77, 0)])
    alone = Sampler([0])(row, SamplingBatch([sp], key, torch.zeros(1, 0, dtype=torch.int64), torch.tensor([4]),
                                            torch.tensor([9])))
    mates = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), sp]
    logits = torch.cat([torch.randn(2, 200), row])
    keys = torch.tensor([noise_key(None, 0), 0, noise_key(77, 0)])
    mixed = Sampler([0])(logits, SamplingBatch(mates, keys, torch.zeros(3, 0, dtype=torch.int64),
                                               torch.tensor([1, 2, 4]), torch.tensor([5, 6, 9])))
    assert int(mixed.token_ids[2]) == int(alone.token_ids[0])
    assert noise_key(77, 0) != noise_key(77, 1) and noise_key(77, 1) == noise_key(77, 1)


def test_exponential_noise_is_never_zero_so_masked_tokens_are_never_drawn():
    """Every draw is > 0. The largest 24-bit value once rounded to u = 1.0 in float32, so E = -0.0 and a masked
    token's 0 / -0 = NaN won the argmax: structured outputs sampled tokens their grammar forbids (about 1 row
    in 300 at SmolLM2's vocabulary). 64M draws hold several of those values."""
    from pagedllm.worker.noise import exponential_noise

    vocab = 1 << 16
    for start in range(0, 1024, 256):
        keys = torch.arange(start, start + 256, dtype=torch.int64)
        draws = exponential_noise(keys, torch.full((256,), 7, dtype=torch.int64), vocab)
        assert bool((draws > 0).all()), f"a zero draw among keys {start}..{start + 255}"


class DeviceTrap(SyncTrap):
    """Also fails a move to the host: what the logits of a device step must never take whole."""

    READS = SyncTrap.READS | {torch.Tensor.cpu}


def test_step_logits_stay_on_the_device_and_only_results_come_back(tiny_model_dir, monkeypatch):
    """An eager step samples (filters, penalties, bias, min_tokens, seeds), ranks prompt logprobs and beam
    candidates from logits left where the model made them: nothing but ``to_host`` of the small results
    reads them back (the logits are trapped here as a device tensor would be)."""
    from pagedllm import LLM
    from pagedllm.worker import model_runner

    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=1, max_tokens=6, logprobs=2,
                             repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.1, min_tokens=2,
                             logit_bias={7: 1.5}, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=5, n=2, beam_width=3, use_beam_search=True),
              SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, logprobs=1)]
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41, 42, 43]]

    def run(trap: bool):
        llm = LLM(tiny_model_dir, kv_cache_memory=16 << 20, check_integrity=True)
        if trap:
            model = llm.engine.core.executor.worker.model_runner.forward_pass.model
            make = model.compute_logits
            monkeypatch.setattr(model, "compute_logits", lambda h, out=None: make(h, out).as_subclass(DeviceTrap))
        res = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.kv.stats()["used"] == 0
        return [([o.token_ids for o in r.outputs], [o.finish_reason for o in r.outputs],
                 r.prompt_logprobs is not None) for r in res]

    want = run(False)
    untrap = model_runner.to_host
    monkeypatch.setattr(model_runner, "to_host", lambda *ts: untrap(*(t.as_subclass(torch.Tensor) for t in ts)))
    assert run(True) == want
    assert all(w[1][0] in ("length", "stop") for w in want) and want[0][2] and want[2][2]
