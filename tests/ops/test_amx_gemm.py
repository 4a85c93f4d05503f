"""The packed bf16 GEMM (``ops/csrc/amx_gemm.cpp``: AMX tiles, VDPBF16PS without them) and where ``bf16_linear``
takes it: it computes the bf16 product of fp32 arithmetic on bf16 inputs, rounded to bf16, for every padding case (N
not a multiple of 16, K not of 32, M not of 16, odd row-tile and column-block counts at the 32 x 32 blocks' edges);
on AMX and AVX512-BF16 CPUs GEMMs of up to COPY_MAX_ROWS rows of packed matrices go to it, larger ones to oneDNN
with their rows padded to a bucket; elsewhere no matrix gets the copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.models import bf16_gemm
from pagedllm.models.bf16_gemm import (COPY_MAX_ROWS, EXACT_ROWS, PackedBF16, amx_bf16_available, bf16_linear,
                                      dpbf16_available, onednn_bf16_available, packed_copy_available, padded_rows)

pytestmark = pytest.mark.skipif(not ops.load("amx_gemm"), reason="no C++ compiler")

SHAPES = [(1, 64, 48), (5, 96, 64), (16, 576, 960), (17, 70, 100), (32, 1536, 576), (33, 40, 33), (37, 64, 48),
          (48, 576, 960), (64, 576, 3072), (100, 70, 112), (270, 576, 576)]


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_amx_linear_is_the_bf16_product_rounded_once(M, K, N):
    """On the tiles or through VDPBF16PS where the CPU has them, through ATen on the unpacked matrix elsewhere: the
    same product."""
    gen = torch.Generator().manual_seed(M * 1000 + N)
    w, x = torch.randn(N, K, generator=gen).bfloat16(), torch.randn(M, K, generator=gen).bfloat16()
    y = torch.ops.pagedllm.amx_linear_bf16(x, torch.ops.pagedllm.amx_pack_bf16(w), N)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    exact = x.double() @ w.double().T  # bf16 products are exact; only fp32 sums and the final rounding differ
    torch.testing.assert_close(y.double(), exact, rtol=2 ** -8, atol=1e-4 * K ** 0.5)
    assert torch.equal(y[:1], torch.ops.pagedllm.amx_linear_bf16(x[:1], torch.ops.pagedllm.amx_pack_bf16(w), N))


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("M", [2, 7, 9, 15, 17, 26, 33, 63])
def test_a_row_does_not_depend_on_its_batch_mates(M, silu):
    """Rows go through the kernel in runs of up to 8 (row counts split evenly over the runs, x's K pairs transposed
    per run): each row's result is the one it gets alone, bit for bit, whatever run and slot it lands in."""
    gen = torch.Generator().manual_seed(M)
    K, N = 200, 96  # K: a partial 32-wide step and pairs left over after the 8 x 8 transposes
    w, x = torch.randn(N, K, generator=gen).bfloat16(), torch.randn(M, K, generator=gen).bfloat16()
    p = torch.ops.pagedllm.amx_pack_bf16(w)
    op = torch.ops.pagedllm.amx_linear_silu_bf16 if silu else torch.ops.pagedllm.amx_linear_bf16
    alone = torch.cat([op(x[r:r + 1], p, N) for r in range(M)])
    assert torch.equal(op(x, p, N), alone)


SILU_SHAPES = [(1, 576, 3072), (5, 64, 64), (17, 70, 96), (33, 576, 3072), (100, 70, 64), (270, 576, 3072)]


@pytest.mark.parametrize("M,K,N", SILU_SHAPES)
def test_amx_linear_silu_is_silu_mul_of_the_product(M, K, N):
    """The fused gate/up op returns silu(gate) * up of the product's bf16 output: on the tiles and through VDPBF16PS,
    silu_mul's own bits (one row tile, 2 x 2 blocks, runs of 8 rows, K and M padding); through its ATen fallback
    elsewhere, the same to rounding."""
    gen = torch.Generator().manual_seed(M * 7 + N)
    w, x = torch.randn(N, K, generator=gen).bfloat16(), torch.randn(M, K, generator=gen).bfloat16()
    p = torch.ops.pagedllm.amx_pack_bf16(w)
    y = torch.ops.pagedllm.amx_linear_silu_bf16(x, p, N)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N // 2)
    gate_up = torch.ops.pagedllm.amx_linear_bf16(x, p, N)
    if packed_copy_available() and ops.load("fused_ops"):
        assert torch.equal(y, torch.ops.pagedllm.silu_mul(gate_up, True))
    g, u = gate_up.double().chunk(2, 1)
    torch.testing.assert_close(y.double(), g * torch.sigmoid(g) * u, rtol=2 ** -7, atol=1e-3)


def test_amx_linear_refuses_what_it_was_not_packed_for():
    p = torch.ops.pagedllm.amx_pack_bf16(torch.zeros(48, 64, dtype=torch.bfloat16))
    assert p.shape == (3, 2, 16, 32)
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.pagedllm.amx_linear_bf16(torch.zeros(2, 96, dtype=torch.bfloat16), p, 48)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.pagedllm.amx_linear_bf16(torch.zeros(2, 64), p, 48)
    with pytest.raises(RuntimeError, match="multiple of 16 columns each"):
        torch.ops.pagedllm.amx_linear_silu_bf16(torch.zeros(2, 64, dtype=torch.bfloat16), p, 48)


def test_bf16_linear_takes_the_copy_up_to_its_rows(monkeypatch):
    """The dispatch, on every CPU: without tiles the op runs VDPBF16PS or its ATen fallback, the same product."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(80, 64, generator=gen)
    assert (PackedBF16.of(w).amx is not None) == packed_copy_available()
    monkeypatch.setattr(bf16_gemm, "dpbf16_available", lambda: True)
    p = PackedBF16.of(w)
    calls = []
    real = torch.ops.pagedllm.amx_linear_bf16
    monkeypatch.setattr(bf16_gemm.torch.ops.pagedllm, "amx_linear_bf16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 200, COPY_MAX_ROWS, COPY_MAX_ROWS + 1):
        x = torch.randn(rows, 64, generator=gen)
        ref = torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).float()
        torch.testing.assert_close(bf16_linear(x, p), ref, rtol=2 ** -7, atol=1e-3)
    assert calls == [1, 200, COPY_MAX_ROWS]


def test_gate_up_takes_the_fused_op_on_the_packed_copy_only(monkeypatch):
    """``layers.linear_silu_mul``: with a bf16 result on the packed copy's rows, the fused op, the bits of
    ``silu_mul(linear(...))``; with an fp32 result, past COPY_MAX_ROWS or without the copy, that pair itself."""
    from pagedllm.models import layers

    real_copy = packed_copy_available()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 64, generator=gen)
    monkeypatch.setattr(bf16_gemm, "amx_bf16_available", lambda: True)
    p, plain = PackedBF16.of(w), torch.randn(64, 64, generator=gen)
    calls = []
    real = torch.ops.pagedllm.amx_linear_silu_bf16
    monkeypatch.setattr(bf16_gemm.torch.ops.pagedllm, "amx_linear_silu_bf16",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows, out in ((3, torch.bfloat16), (40, torch.bfloat16), (40, None), (COPY_MAX_ROWS + 1, torch.bfloat16)):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        y = layers.linear_silu_mul(x, p, False, out)
        ref = layers.silu_mul(layers.linear(x, p), out)
        assert y.dtype == ref.dtype and y.shape == (rows, 32)
        if real_copy or rows > COPY_MAX_ROWS or out is None:
            assert torch.equal(y, ref)
        else:  # the op's ATen fallback without tiles or VDPBF16PS: the same to rounding
            torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
    assert calls == [3, 40]
    y = layers.linear_silu_mul(x[:5].float(), plain, False, None)  # a plain matrix: the pair
    assert torch.equal(y, layers.silu_mul(layers.linear(x[:5].float(), plain), None))


def test_padded_rows_buckets():
    """Every row count maps to a bucket at least as large: itself below EXACT_ROWS, then a multiple of 16, under 1/32
    larger from 1,024 rows, and each octave holds at most 32 buckets (oneDNN compiles a primitive per bucket, not
    per row count)."""
    sizes = range(1, 8193)
    buckets = [padded_rows(m) for m in sizes]
    assert all(b == m for m, b in zip(sizes, buckets) if m < EXACT_ROWS)
    assert all(b >= m and b % 16 == 0 for m, b in zip(sizes, buckets) if m >= EXACT_ROWS)
    assert all(b - m < max(16, m / 32) for m, b in zip(sizes, buckets))
    for lo in (1024, 2048, 4096):
        assert len({padded_rows(m) for m in range(lo, 2 * lo)}) <= 33
    assert padded_rows(17) == 17 and padded_rows(130) == 144 and padded_rows(270) == 272 and padded_rows(1691) == 1696


def test_onednn_gets_padded_rows_and_the_kept_rows_product(monkeypatch):
    """Where oneDNN runs bf16 the real prepacked primitive; elsewhere a stand-in for it (F.linear on the plain bf16
    matrix), so the padding is checked on every CPU."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=gen)
    monkeypatch.setattr(bf16_gemm, "amx_bf16_available", lambda: False)
    p = PackedBF16.of(w)
    rows_seen = []
    real = torch.ops.mkldnn._linear_pointwise if onednn_bf16_available() else lambda x, w, *a: F.linear(x, w)
    monkeypatch.setattr(bf16_gemm.torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: rows_seen.append(x.shape[0]) or real(x, *a))
    for rows in (33, 130, 144, 1100):
        x = torch.randn(rows, 64, generator=gen)
        y = bf16_gemm._onednn_linear(x, p.data)
        assert y.shape == (rows, 48) and y.dtype == torch.bfloat16
        exact = x.bfloat16().double() @ w.bfloat16().double().T
        torch.testing.assert_close(y.double(), exact, rtol=2 ** -8, atol=1e-3)
    assert rows_seen == [33, 144, 144, 1120]


def test_amx_copy_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_AMX_GEMM", "0")
    amx_bf16_available.cache_clear(), dpbf16_available.cache_clear()
    try:
        assert not packed_copy_available() and PackedBF16.of(torch.ones(16, 32)).amx is None
    finally:
        amx_bf16_available.cache_clear(), dpbf16_available.cache_clear()
