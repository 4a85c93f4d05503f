"""``pagedllm bench steptime --w1`` (issue 36, item 4): a W1 run's step time split by part. Structure and
bookkeeping only, never timings: the parts add up to the steps, the timed attention split returns what the one
kernel call returns, and every patched function is restored."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.bench.attention import make_random_batch
from pagedllm.bench.step_split import ATTENTION, GEMM_PARTS, PARTS, ExclusiveTimers, timed_parts


def test_exclusive_timers_charge_nested_parts_to_themselves():
    timers = ExclusiveTimers()
    with timers.part("outer"):
        with timers.part("inner"):
            sum(range(20000))
        with timers.part("opaque", opaque=True), timers.part("hidden"):  # inside an opaque part: not timed
            sum(range(20000))
    assert set(timers.seconds) == {"outer", "inner", "opaque"} and timers.calls["inner"] == 1
    assert all(v >= 0 for v in timers.seconds.values()) and all(v >= 0 for v in timers.cpu.values())


@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1, 1, 20, 33, 5], [5, 64, 1000, 84, 33, 48]),
                                                  ([1, 1], [7, 300]), ([37, 64], [37, 64])])
def test_split_attention_equals_one_kernel_call(query_lens, seq_lens):
    """Decode rows and prefill chunks timed in two kernel calls: the same pool writes and output bit for bit."""
    from pagedllm.attention import BACKENDS, get_backend

    if "cpu" not in BACKENDS:
        pytest.skip("no C++ compiler: the cpu backend cannot be built")
    backend = get_backend("cpu")
    b = make_random_batch(query_lens, seq_lens, seed=3)
    T, H, _ = b.q.shape
    qkv = torch.cat([b.q.reshape(T, -1), b.k.reshape(T, -1), b.v.reshape(T, -1)], 1)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    want = backend.forward_qkv(qkv, H, kc, vc, b.meta, b.scale)
    timers = ExclusiveTimers()
    kc2, vc2 = b.k_cache.clone(), b.v_cache.clone()
    got = timers.attention_split(backend)(qkv, H, kc2, vc2, b.meta, b.scale)
    assert torch.equal(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
    n_dec = sum(q == 1 for q in query_lens)
    assert timers.calls[ATTENTION[0]] == (n_dec > 0) and timers.calls[ATTENTION[1]] == (n_dec < len(query_lens))


def test_timed_parts_restores_every_function():
    import importlib

    from pagedllm.frontend.llm_engine import LLMEngine

    owners = [(importlib.import_module(m) if c is None else getattr(importlib.import_module(m), c), a)
              for m, c, a, _ in PARTS.values()]
    before = [getattr(o, a) for o, a in owners] + [LLMEngine.step]

    class Backend:  # not the cpu backend: forward_qkv is left alone
        name = "other"

    with timed_parts(ExclusiveTimers(), Backend()):
        assert all(getattr(o, a) is not f for (o, a), f in zip(owners, before))
    assert [getattr(o, a) for o, a in owners] + [LLMEngine.step] == before


def test_bench_steptime_w1_quick(tmp_path, capsys):
    from pagedllm.bench.cli import main

    assert main(["steptime", "--w1", "--quick", "--out", str(tmp_path)]) == 0
    assert "W1 step time by part" in capsys.readouterr().out
    r = json.loads((tmp_path / "steptime.json").read_text())["result"]["w1"]
    assert r["steps"] > 0 and r["output_tokens"] > 0
    assert sum(r["seconds"].values()) == pytest.approx(r["step_s"])
    for part in (*GEMM_PARTS, "LM head", "sampler", "schedule", *ATTENTION):
        assert r["seconds"][part] > 0, part  # the gate/up GEMM too (it was once left in the layer's glue)
    flops = sum(g[4] for g in r["gemm"])
    assert flops > 0 and sum(g[2] for g in r["gemm"]) == pytest.approx(sum(r["seconds"][p] for p in GEMM_PARTS))
