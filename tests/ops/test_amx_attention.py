"""The AMX prefill attention (``ops/csrc/amx_attention.cpp``) and where the CPU backend takes it: causal attention of
bf16-rounded queries over a bf16 pool read through the block tables (prefix context, GQA, scattered blocks, fp32 or
bf16 queries and outputs) equals the math within bf16 rounding, and pool rows past a sequence's context never leak
in, NaN included. Without tiles the op runs VDPBF16PS on the same layouts (AVX512-BF16 CPUs) or computes the same
through ATen, so these run everywhere."""

from __future__ import annotations

import pytest
import torch

from pagedllm import ops
from pagedllm.attention import cpu as cpu_backend
from pagedllm.attention.cpu import CpuBackend
from pagedllm.bench.attention import make_random_batch

pytestmark = pytest.mark.skipif(not (ops.load("amx_attention") and ops.load("paged_attention")),
                                reason="no C++ compiler")

HKV, H, D, BS = 3, 9, 64, 64
# (query length, context length): whole prompts, chunks after a cached prefix, a single query, tile edges
SEQS = [(270, 270), (17, 17), (5, 100), (64, 64), (33, 200), (1, 1), (130, 260), (16, 48)]


def _pool_and_tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    nblocks = sum((s + BS - 1) // BS for _, s in SEQS) + 3
    kc = torch.full((HKV, nblocks * BS, D), float("nan")).bfloat16()
    vc = torch.full((HKV, nblocks * BS, D), float("nan")).bfloat16()
    perm = torch.randperm(nblocks, generator=g).int()
    width = max((s + BS - 1) // BS for _, s in SEQS)
    tables = torch.zeros(len(SEQS), width, dtype=torch.int32)
    c = 0
    for i, (_, s) in enumerate(SEQS):
        n = (s + BS - 1) // BS
        tables[i, :n] = perm[c : c + n]
        c += n
        slots = _slots(tables[i], s)
        kc[:, slots] = torch.randn(HKV, s, D, generator=g).bfloat16()  # only the context rows are numbers
        vc[:, slots] = torch.randn(HKV, s, D, generator=g).bfloat16()
    lens = torch.tensor([s for _, s in SEQS], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor([q for q, _ in SEQS]), 0).tolist(), dtype=torch.int32)
    return kc, vc, tables, lens, qsl


def _slots(table: torch.Tensor, s: int) -> torch.Tensor:
    pos = torch.arange(s)
    return table.long()[pos // BS] * BS + pos % BS


def _reference(q, kc, vc, tables, lens, qsl, scale):
    out = torch.empty(q.shape)
    for i, (ql, sl) in enumerate(SEQS):
        slots = _slots(tables[i], sl)
        k = kc[:, slots].float().repeat_interleave(H // HKV, 0)
        v = vc[:, slots].float().repeat_interleave(H // HKV, 0)
        qi = q[qsl[i] : qsl[i + 1]].bfloat16().float().transpose(0, 1)
        s = qi @ k.transpose(1, 2) * scale
        s = s.masked_fill(torch.arange(sl)[None, :] > (sl - ql + torch.arange(ql))[:, None], float("-inf"))
        out[qsl[i] : qsl[i + 1]] = (s.softmax(-1) @ v).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_is_causal_attention_over_the_pool(dtype):
    kc, vc, tables, lens, qsl = _pool_and_tables(0)
    T = int(qsl[-1])
    qkv = torch.randn(T, (H + 2 * HKV) * D, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)  # strided rows, as the backend passes the fused projection's view
    out = torch.full((T, H, D), float("nan"), dtype=dtype)
    scale = D**-0.5
    torch.ops.pagedllm.prefill_attention_amx(out, q, kc, vc, tables, lens, qsl, BS, scale, 0, len(SEQS))
    want = _reference(q, kc, vc, tables, lens, qsl, scale)
    assert out.isfinite().all()
    # P is rounded to bf16 before P V (as in torch's bf16 flash kernel): errors of a few 1e-3 on unit-scale values
    torch.testing.assert_close(out.float(), want, atol=1.5e-2, rtol=1e-2)


def test_prefill_attention_writes_only_its_sequences():
    kc, vc, tables, lens, qsl = _pool_and_tables(2)
    T = int(qsl[-1])
    q = torch.randn(T, H, D)
    out = torch.zeros(T, H, D)
    torch.ops.pagedllm.prefill_attention_amx(out, q, kc, vc, tables, lens, qsl, BS, 0.125, 2, 4)
    lo, hi = int(qsl[2]), int(qsl[4])
    assert (out[:lo] == 0).all() and (out[hi:] == 0).all() and (out[lo:hi] != 0).any()


def test_prefill_attention_refuses_what_it_does_not_serve():
    kc, vc, tables, lens, qsl = _pool_and_tables(3)
    T = int(qsl[-1])
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.pagedllm.prefill_attention_amx(torch.empty(T, H, D), torch.randn(T, H, D), kc, vc, tables, lens,
                                                 qsl, 16, 0.125, 0, 1)
    with pytest.raises(RuntimeError, match=r"\[T, H, 64\]"):
        torch.ops.pagedllm.prefill_attention_amx(torch.empty(T, H, 32), torch.randn(T, H, 32), kc, vc, tables, lens,
                                                 qsl, BS, 0.125, 0, 1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.pagedllm.prefill_attention_amx(torch.empty(T, H, D), torch.randn(T, H, D), kc.float(), vc.float(),
                                                 tables, lens, qsl, BS, 0.125, 0, 1)


def test_cpu_backend_sends_bf16_prefill_chunks_to_it_on_native_bf16_cpus(monkeypatch):
    """The backend's choice follows the CPU and the switch, and the chunks it sends come back as SDPA's would."""
    cpu_backend.amx_prefill_available.cache_clear()
    monkeypatch.setenv("PAGEDLLM_AMX_ATTENTION", "0")
    assert not cpu_backend.amx_prefill_available()
    monkeypatch.delenv("PAGEDLLM_AMX_ATTENTION")
    cpu_backend.amx_prefill_available.cache_clear()
    b = make_random_batch([1, 200, 160], [30, 200, 260], num_kv_heads=HKV, group=H // HKV, head_dim=D,
                          block_size=BS, cache_dtype=torch.bfloat16, spare_blocks=2)
    kc, vc = b.k_cache, b.v_cache
    backend = CpuBackend()
    calls = []
    real = torch.ops.pagedllm.prefill_attention_amx.default
    monkeypatch.setattr(cpu_backend, "_prefill_attention_amx", lambda *a: calls.append(a[-2:]) or real(*a))
    got = backend.forward(b.q, b.k, b.v, kc.clone(), vc.clone(), b.meta, b.scale)
    expected_amx = backend.bf16_sdpa and cpu_backend.amx_prefill_available()
    assert backend.amx_prefill == expected_amx
    assert calls == ([(1, 3)] if expected_amx else [])  # the decode row stays on the paged kernel
    backend.amx_prefill = False
    want = backend.forward(b.q, b.k, b.v, kc.clone(), vc.clone(), b.meta, b.scale)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
