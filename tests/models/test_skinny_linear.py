"""The streaming small-batch GEMM behind ``layers.linear`` matches ``F.linear``."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.models import layers

kernel = layers._skinny_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the AVX2 C++ kernel could not be built on this machine")


@needs_kernel
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("n,k", [(1, 8), (7, 16), (960, 576), (13, 1536)])
def test_kernel_matches_f_linear(wdtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(wdtype)
    b = torch.randn(n, generator=g)
    want = F.linear(x, w.float(), b)
    torch.testing.assert_close(kernel.skinny_linear(x, w, b), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernel.skinny_linear(x, w, None), want - b, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_linear_routes_small_batches_to_kernel_and_large_to_onednn(monkeypatch):
    calls, big = [], []
    real = kernel.skinny_linear

    class Spy:
        def skinny_linear(self, *a):
            calls.append(a[0].shape[0])
            return real(*a)

    onednn = layers._onednn_linear()

    def onednn_spy(*a):
        big.append(a[0].shape[0])
        return onednn(*a)

    monkeypatch.setattr(layers, "_skinny_kernel", lambda: Spy())
    monkeypatch.setattr(layers, "_onednn_linear", lambda: onednn_spy if onednn is not None else None)
    w, b = torch.randn(64, 32), torch.randn(64)
    for rows in (1, layers.SKINNY_MAX_ROWS, layers.SKINNY_MAX_ROWS + 1):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(layers.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert calls == [1, layers.SKINNY_MAX_ROWS]  # the larger batch went to oneDNN (or ATen without it)
    assert big == ([layers.SKINNY_MAX_ROWS + 1] if onednn is not None else [])
    x = torch.randn(layers.LOGITS_SKINNY_MAX_ROWS + 1, 32)
    layers.linear(x, w, skinny_max_rows=layers.LOGITS_SKINNY_MAX_ROWS)  # the LM head's cut-off
    assert calls == [1, layers.SKINNY_MAX_ROWS]
    x, wb = torch.randn(2, 32), w.bfloat16()
    torch.testing.assert_close(layers.linear(x, wb, upcast=True), F.linear(x, wb.float()), rtol=1e-5, atol=1e-5)
    assert calls[-1] == 2  # bf16 weights stream through the kernel without an fp32 copy


def test_bad_shapes_raise():
    if kernel is None:
        pytest.skip("the AVX2 C++ kernel could not be built on this machine")
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernel.skinny_linear(torch.randn(1, 12), torch.randn(4, 12), None)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.skinny_linear(torch.randn(1, 16).double(), torch.randn(4, 16), None)
