"""The fp32 GEMM behind ``layers.linear`` (``ops/csrc/gemm.cpp``) matches ``F.linear`` on both of its paths."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.models import layers

kernel = torch.ops.pagedllm if ops.load("gemm") else None
needs_kernel = pytest.mark.skipif(kernel is None, reason="the AVX2 C++ kernel could not be built on this machine")


@needs_kernel
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 15, 16, 17, 64, 131])  # dot-product tiles below 16 rows, panels above
@pytest.mark.parametrize("n,k", [(1, 8), (7, 16), (960, 576), (13, 1536), (40, 72)])
def test_kernel_matches_f_linear(wdtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(wdtype)
    b = torch.randn(n, generator=g)
    want = F.linear(x, w.float(), b)
    torch.testing.assert_close(kernel.linear(x, w, b), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernel.linear(x, w, None), want - b, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_panel_rows_do_not_depend_on_the_batch_around_them():
    """From 16 rows up every output is the same sequential sum over k whichever tile its row falls in, so a
    sequence's logits don't change with what else is in the batch (fp32 greedy outputs stay batch-invariant)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(50, 576, generator=g), torch.randn(45, 576, generator=g), torch.randn(45, generator=g)
    full = kernel.linear(x, w, b)
    for start, rows in ((0, 16), (3, 17), (5, 23), (31, 19)):
        assert torch.equal(kernel.linear(x[start:start + rows].contiguous(), w, b), full[start:start + rows])


@needs_kernel
def test_linear_sends_fp32_cpu_batches_of_every_size_to_the_kernel(monkeypatch):
    calls = []
    real = kernel.linear.default

    def spy(*a):
        calls.append(a[0].shape[0])
        return real(*a)

    monkeypatch.setattr(torch.ops.pagedllm.linear, "default", spy)
    w, b = torch.randn(64, 32), torch.randn(64)
    for rows in (1, 16, 300):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(layers.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert calls == [1, 16, 300]
    x, wb = torch.randn(2, 32), w.bfloat16()
    torch.testing.assert_close(layers.linear(x, wb, upcast=True), F.linear(x, wb.float()), rtol=1e-5, atol=1e-5)
    assert calls[-1] == 2  # bf16 weights stream through the kernel without an fp32 copy
    x, w12 = torch.randn(4, 12), torch.randn(5, 12)  # K not a multiple of 8: ATen
    torch.testing.assert_close(layers.linear(x, w12), F.linear(x, w12))
    assert calls[-1] == 2


def test_bad_shapes_raise():
    if kernel is None:
        pytest.skip("the AVX2 C++ kernel could not be built on this machine")
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernel.linear(torch.randn(1, 12), torch.randn(4, 12), None)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.linear(torch.randn(1, 16).double(), torch.randn(4, 16), None)
