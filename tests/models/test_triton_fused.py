"""The fused Triton kernels (pagedllm/ops/triton_fused.py) against the torch path of models/layers.py, in
Triton's CPU interpreter (TRITON_INTERPRET=1, set in tests/conftest.py); on CUDA the layers call them."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.metadata import write_kv
from pagedllm.models.layers import apply_rope_, rms_norm, rope_cos_sin
from pagedllm.ops.triton_fused import add_rms_norm_triton, rope_qkv_triton, silu_mul_triton

pytest.importorskip("triton", reason="the test set-up installs triton")  # never skipped in CI: setup installs it

DTYPES = [torch.float32, torch.bfloat16]


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # a few bf16 ulps: the interpreter's fp32 -> bf16 cast truncates (CUDA rounds to nearest)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(dtype, with_delta):
    torch.manual_seed(0)
    h = torch.randn(5, 96, dtype=dtype)
    delta = torch.randn(5, 96, dtype=dtype) if with_delta else None
    w = torch.rand(96, dtype=dtype) + 0.5
    h_ref = h.clone()
    if delta is not None:
        h_ref.add_(delta)
    want = rms_norm(h_ref, w, 1e-5)
    got = add_rms_norm_triton(h, delta, w, 1e-5)
    _close(h, h_ref, dtype)  # the residual is updated in place
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    torch.manual_seed(1)
    gate_up = torch.randn(3, 2 * 200, dtype=dtype)
    want = torch.nn.functional.silu(gate_up[:, :200]) * gate_up[:, 200:]
    _close(silu_mul_triton(gate_up), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("write", [False, True])
def test_rope_on_fused_qkv_and_kv_write(dtype, write):
    torch.manual_seed(2)
    T, H, Hkv, D = 4, 4, 2, 32
    qkv = torch.randn(T, (H + 2 * Hkv) * D, dtype=dtype)
    cos, sin = rope_cos_sin(D, 10000.0, None, 64, dtype)
    pos = torch.tensor([0, 7, 8, 63])
    c, s = cos[pos], sin[pos]
    want = qkv.clone()
    apply_rope_(want[:, : (H + Hkv) * D].view(T, H + Hkv, D), c, s)
    slots = torch.tensor([3, 9, 10, 1])
    kc = torch.zeros(Hkv, 16, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc_want, vc_want = kc.clone(), vc.clone()
    write_kv(want[:, H * D:(H + Hkv) * D].view(T, Hkv, D), want[:, (H + Hkv) * D:].view(T, Hkv, D),
             kc_want, vc_want, slots)
    rope_qkv_triton(qkv, H + Hkv, c, s, (kc, vc, slots, H) if write else None)
    _close(qkv, want, dtype)
    if write:
        _close(kc, kc_want, dtype)
        _close(vc, vc_want, dtype)
