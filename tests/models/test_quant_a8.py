"""The approximate W4A8/W8A8 GEMM (``ops/csrc/quant_a8.cpp``): activations quantized to int8 per 32-block,
integer dot products against GGUF Q4_1/Q8_0 blocks. It must compute exactly its stated formula on the
quantized values (checked against a float64 reference) and stay close to the true fp32 product."""

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from pagedllm import ops

kernel = torch.ops.pagedllm if ops.load("quant_a8") else None
pytestmark = pytest.mark.skipif(kernel is None, reason="the AVX2 C++ kernel quant_a8.cpp could not be built here")
Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0


def make_weight(qtype, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF blocks (uint8 [n, k/32*bytes]) and gguf-py's dequantization of them."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    blocks = quantize(w, qtype)
    return torch.from_numpy(blocks), torch.from_numpy(np.require(dequantize(blocks, qtype), np.float32, ["C", "W"]))


def decode_blocks(data: torch.Tensor, qtype) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q [N, KB, 32] integers, d [N, KB], m [N, KB] or None) read from the raw block bytes."""
    raw = data.numpy()
    n = raw.shape[0]
    if qtype == Q4_1:
        b = raw.reshape(n, -1, 20)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        qs = b[..., 4:20]
        return np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64), d, m
    b = raw.reshape(n, -1, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    return b[..., 2:34].copy().view(np.int8).astype(np.float64), d, None


def quantize_ref(x: torch.Tensor):
    """The stated activation quantization in torch: d = amax / 127, q = round-half-even(x / d), s = sum."""
    xb = x.view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d[..., None] > 0, torch.round(xb / safe[..., None]), torch.zeros_like(xb))
    return q.to(torch.int8).view_as(x), d, xb.double().sum(-1)


def linear_ref(x: torch.Tensor, data: torch.Tensor, qtype, bias: torch.Tensor | None) -> torch.Tensor:
    """float64: per block d_w d_x sum(q_w q_x) (+ m_w s_x for Q4_1), on the kernel's own quantized x.
    The Q4_1 kernel centres the nibbles (q_w - 8, m_w + 8 d_w), which adds 8 d_w (s_x - d_x sum q_x): the
    quantization error of the block's sum, taken exactly from s_x (halves the error for typical blocks)."""
    q, d, s = (t.double() for t in kernel.quantize_a8(x))
    qw, dw, mw = (None if a is None else torch.from_numpy(a) for a in decode_blocks(data, qtype))
    qx = q.view(x.shape[0], -1, 32)
    dots = torch.einsum("mbk,nbk->mnb", qx, qw)  # exact integers
    y = (dots * dw[None] * d[:, None]).sum(-1)
    if qtype == Q4_1:
        y = y + (mw[None] * s[:, None]).sum(-1)
        y = y + (8 * dw[None] * (s - d * qx.sum(-1))[:, None]).sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y


def test_quantize_a8_matches_torch_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1536, generator=g) * torch.rand(5, 1, generator=g) * 10
    x[1, 32:64] = 0  # an all-zero block: d = 0, q = 0
    q, d, s = kernel.quantize_a8(x)
    assert q.dtype == torch.int8 and q.shape == (5, 1536) and d.shape == s.shape == (5, 48)
    qr, dr, sr = quantize_ref(x)
    assert torch.equal(d, dr)
    assert torch.equal(q, qr)
    torch.testing.assert_close(s.double(), sr, rtol=1e-6, atol=1e-5)
    assert int(q.abs().max()) == 127 and torch.equal(d[1, 1], torch.tensor(0.0)) and not q[1, 32:64].any()


def test_quantize_a8_rounds_ties_to_even():
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])  # d = 1: x / d lands exactly on ties
    q, d, _ = kernel.quantize_a8(x)
    assert d.item() == 1.0
    assert q[0, :6].tolist() == [127, 0, 2, 2, 0, -2]


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 2, 5, 64, 200])
@pytest.mark.parametrize("n,k", [(7, 64), (13, 576), (96, 1536), (40, 32)])
def test_linear_a8_computes_its_formula(qtype, m, n, k):
    data, _ = make_weight(qtype, n, k, seed=n + k)
    g = torch.Generator().manual_seed(m * 31 + n)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    for bias in (None, b):
        y = kernel.linear_a8(x, data, int(qtype), bias)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        ref = linear_ref(x, data, qtype, bias)
        err = (y.double() - ref).abs().max().item()
        assert err <= 1e-5 * ref.abs().max().item(), err


@pytest.mark.parametrize("qtype,bound", [(Q4_1, 1e-2), (Q8_0, 1e-2)], ids=["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (64, 576, 1536), (200, 136, 896)])
def test_linear_a8_is_close_to_the_fp32_product(qtype, bound, m, n, k):
    data, dense = make_weight(qtype, n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    y, ref = kernel.linear_a8(x, data, int(qtype), None), x @ dense.T
    rel = ((y - ref).norm() / ref.norm()).item()
    assert 1e-5 < rel < bound  # approximate, but only by the 8-bit activations


def test_bad_inputs_raise():
    data, _ = make_weight(Q4_1, 4, 64, seed=1)
    x = torch.randn(2, 64)
    kernel.linear_a8(x, data, 3, None)  # the valid call
    with pytest.raises(RuntimeError, match="float32"):
        kernel.linear_a8(x.double(), data, 3, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.linear_a8(torch.randn(64, 2).T, data, 3, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.linear_a8(torch.randn(2, 48), data, 3, None)
    with pytest.raises(RuntimeError, match="blocks"):
        kernel.linear_a8(x, data, 8, None)  # Q4_1 bytes read as Q8_0: width mismatch
    with pytest.raises(RuntimeError, match="blocks"):
        kernel.linear_a8(torch.randn(2, 96), data, 3, None)
    with pytest.raises(RuntimeError, match="qtype"):
        kernel.linear_a8(x, data, 2, None)
    with pytest.raises(RuntimeError, match="uint8"):
        kernel.linear_a8(x, data.to(torch.int8), 3, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear_a8(x, data, 3, torch.randn(5))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.quantize_a8(torch.randn(2, 40))


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(7, 64), (13, 576), (203, 576), (96, 1536), (40, 32), (1, 32)])
def test_packed_gemm_equals_linear_a8_bit_for_bit(qtype, n, k):
    """pack_a8 moves linear_a8's per-call repack to load time; the GEMM on it (direct tiles for few rows of x,
    unpacked panels for many) must give the same bits, partial last group of 8 rows included."""
    data, _ = make_weight(qtype, n, k, seed=3 * n + k)
    packed = kernel.pack_a8(data, int(qtype))
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == ((n + 7) // 8, 8 * data.shape[1])  # 8 rows' bytes
    g = torch.Generator().manual_seed(n * k)
    b = torch.randn(n, generator=g)
    for m in (1, 3, 17, 64, 300):
        x = torch.randn(m, k, generator=g) * 3
        for bias in (None, b):
            y = kernel.linear_a8_packed(x, packed, int(qtype), n, bias)
            assert y.shape == (m, n) and torch.equal(y, kernel.linear_a8(x, data, int(qtype), bias)), (m, bias is None)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(7, 64), (203, 576), (96, 1536)])
def test_packed_parts_give_the_whole_calls_bits(qtype, n, k):
    """decode_layer's team computes a GEMV as parts, one per thread: any split must give linear_a8_packed's bits."""
    data, _ = make_weight(qtype, n, k, seed=n + k)
    packed = kernel.pack_a8(data, int(qtype))
    g = torch.Generator().manual_seed(n)
    for m in (1, 3):
        x = torch.randn(m, k, generator=g) * 3
        want = kernel.linear_a8_packed(x, packed, int(qtype), n)
        for parts in (1, 2, 3, 5):
            y = torch.full((m, n), float("nan"))
            for p in range(parts):
                kernel.linear_a8_packed_part(x, packed, int(qtype), n, y, p, parts)
            assert torch.equal(y, want), (m, parts)


def test_packed_part_bad_inputs_raise():
    data, _ = make_weight(Q4_1, 9, 64, seed=2)
    packed, x = kernel.pack_a8(data, 3), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="pack_a8"):
        kernel.linear_a8_packed_part(x, packed, 3, 17, torch.empty(2, 17), 0, 1)
    for part, parts in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(RuntimeError, match="part must be in"):
            kernel.linear_a8_packed_part(x, packed, 3, 9, torch.empty(2, 9), part, parts)
    for bad in (torch.empty(2, 8), torch.empty(1, 9), torch.empty(2, 9, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="y must be"):
            kernel.linear_a8_packed_part(x, packed, 3, 9, bad, 0, 1)
    with pytest.raises(RuntimeError, match="rows"):
        kernel.linear_a8_packed_part(torch.randn(65, 64), packed, 3, 9, torch.empty(65, 9), 0, 1)


def test_packed_bad_inputs_raise():
    data, _ = make_weight(Q4_1, 9, 64, seed=2)
    packed, x = kernel.pack_a8(data, 3), torch.randn(2, 64)
    kernel.linear_a8_packed(x, packed, 3, 9)  # the valid call
    for n in (8, 17):  # the group count must match N
        with pytest.raises(RuntimeError, match="pack_a8"):
            kernel.linear_a8_packed(x, packed, 3, n)
    with pytest.raises(RuntimeError, match="pack_a8"):
        kernel.linear_a8_packed(torch.randn(2, 96), packed, 3, 9)  # another K
    with pytest.raises(RuntimeError, match="pack_a8"):
        kernel.linear_a8_packed(x, packed, 8, 9)  # Q4_1 layout read as Q8_0
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear_a8_packed(x, packed, 3, 9, torch.randn(8))
    with pytest.raises(RuntimeError, match="whole"):
        kernel.pack_a8(data[:, :30].contiguous(), 3)
    with pytest.raises(RuntimeError, match="qtype"):
        kernel.pack_a8(data, 2)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=lambda q: q.name)
def test_quantized_weight_pack_a8_routes_to_the_packed_gemm(qtype):
    from pagedllm.models.quant import QuantizedWeight, quantized_linear

    data, _ = make_weight(qtype, 21, 96, seed=5)
    w = QuantizedWeight(data, int(qtype), (21, 96), int8_activations=True)
    p = w.pack_a8()
    assert p.packed and p.int8_activations and p.shape == w.shape and p.data.shape[0] == 3
    x, b = torch.randn(4, 96), torch.randn(21)
    assert torch.equal(quantized_linear(x, p, b), quantized_linear(x, w, b))
    with pytest.raises(ValueError, match="packed"):
        p.dequantize()
    with pytest.raises(ValueError, match="before packing"):
        QuantizedWeight.cat([p, p])
