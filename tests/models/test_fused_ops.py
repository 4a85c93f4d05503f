"""The fused C++ norm / rotary / activation ops (``torch.ops.pagedllm``) against ATen, and their ATen fallback
(bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.models import layers
from pagedllm.models.layers import add_rms_norm_, apply_rope_, silu_mul

pytestmark = pytest.mark.skipif(not ops.load("fused_ops"), reason="the fused C++ ops can't be built here")

ROWS = (1, 3, 65, 200)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of ``x [T, N, D]`` out of place, in ATen ops of the input dtype."""
    half = x.shape[-1] // 2
    x1, x2, c, s = x[..., :half], x[..., half:], cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("E", (576, 104, 13))
@pytest.mark.parametrize("with_delta", (False, True))
def test_add_rms_norm(T: int, E: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(T * E)
    h, d, w = torch.randn(T, E, generator=g), torch.randn(T, E, generator=g), torch.randn(E, generator=g)
    ref_h = h + d if with_delta else h.clone()
    ref = F.rms_norm(ref_h, (E,), w, 1e-5)
    got = torch.ops.pagedllm.add_rms_norm(h, d if with_delta else None, w, 1e-5)
    assert torch.equal(h, ref_h)  # the residual add is exact and in place
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("I", (1536, 100))
def test_silu_mul(T: int, I: int) -> None:
    gate_up = 4 * torch.randn(T, 2 * I, generator=torch.Generator().manual_seed(T + I))
    ref = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    torch.testing.assert_close(torch.ops.pagedllm.silu_mul(gate_up), ref, rtol=1e-6, atol=1e-7)


def test_silu_mul_16_lanes_give_atens_bits_on_avx512() -> None:
    """Under AVX-512 the op runs 16 lanes through Sleef_expf16_u10, as ATen's AVX-512 silu does: the same bits as
    ``F.silu(g) * u`` over five decades of inputs (elsewhere the 8-lane path, checked to 1e-6 above)."""
    g = torch.Generator().manual_seed(3)
    gate_up = torch.cat([torch.randn(64, 2 * 1536, generator=g) * s for s in (0.1, 1.0, 5.0, 30.0, 100.0)])
    ref = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    got = torch.ops.pagedllm.silu_mul(gate_up)
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("T", ROWS)
def test_rope_in_qkv_view(T: int) -> None:
    """Rotates the q and k heads inside a fused qkv row in place, leaving v alone."""
    H, Hkv, D = 9, 3, 64
    g = torch.Generator().manual_seed(T)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
    qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
    ref, v = _rope_ref(qk, cos, sin), qkv[:, (H + Hkv) * D :].clone()
    torch.ops.pagedllm.rope(qk, cos, sin)
    torch.testing.assert_close(qk, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (H + Hkv) * D :], v)


@pytest.mark.parametrize("T", ROWS)
def test_rope_on_fused_rows(T: int) -> None:
    """``apply_rope_heads_`` rotates the first H + Hkv heads of each qkv row like the 3-D form does on their
    view (the same values bit for bit), leaving v alone."""
    H, Hkv, D = 9, 3, 64
    g = torch.Generator().manual_seed(T + 1)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
    want = qkv.clone()
    apply_rope_(want[:, : (H + Hkv) * D].view(T, H + Hkv, D), cos, sin)
    layers.apply_rope_heads_(qkv, H + Hkv, cos, sin)
    assert torch.equal(qkv, want)
    with pytest.raises(RuntimeError, match="num_heads"):
        torch.ops.pagedllm.rope(qkv, cos, sin, H + 2 * Hkv + 1)


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("D", (64, 20))
def test_rope_widened_is_widening_then_rotating(T: int, D: int) -> None:
    """A bf16 GEMM's qkv widened and rotated in one pass: the bits of ``qkv.float()`` then ``apply_rope_heads_``
    (v heads widened only), on 8-lane bodies and their tails (D 20: half 10)."""
    H, Hkv = 9, 3
    g = torch.Generator().manual_seed(T + D)
    qkv = _with_specials(4 * torch.randn(T, (H + 2 * Hkv) * D + 3, generator=g)).bfloat16()  # + 3: a ragged tail
    cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
    want = qkv.float()
    layers.apply_rope_heads_(want, H + Hkv, cos, sin)
    got = layers.rope_widened(qkv, H + Hkv, cos, sin)
    assert got.dtype == torch.float32
    _same(got, want)
    with pytest.raises(RuntimeError, match="num_heads"):
        torch.ops.pagedllm.rope_widen(qkv, cos, sin, H + 2 * Hkv + 1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.pagedllm.rope_widen(qkv.float(), cos, sin, H + Hkv)


def test_wrappers_fall_back_to_aten_for_bf16() -> None:
    T, E, N, D = 5, 64, 4, 16
    g = torch.Generator().manual_seed(0)
    h, d, w = (torch.randn(*s, generator=g).bfloat16() for s in ((T, E), (T, E), (E,)))
    ref = F.rms_norm((h + d).float(), (E,), None, 1e-6).bfloat16() * w
    out = add_rms_norm_(h, d, w, 1e-6)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    gate_up = torch.randn(T, 2 * E, generator=g).bfloat16()
    assert torch.equal(silu_mul(gate_up), F.silu(gate_up[:, :E]) * gate_up[:, E:])
    x = torch.randn(T, N, D, generator=g).bfloat16()
    cos, sin = torch.randn(T, D // 2, generator=g).bfloat16(), torch.randn(T, D // 2, generator=g).bfloat16()
    ref = _rope_ref(x, cos, sin)
    apply_rope_(x, cos, sin)
    assert torch.equal(x, ref)


def test_fp32_wrappers_match_aten() -> None:
    """The fp32 wrappers match the ATen path on the shapes of a decode layer."""
    T, E, N, D = 2, 576, 12, 64
    g = torch.Generator().manual_seed(1)
    h, d, w = torch.randn(T, E, generator=g), torch.randn(T, E, generator=g), torch.randn(E, generator=g)
    torch.testing.assert_close(add_rms_norm_(h.clone(), d, w, 1e-5), F.rms_norm(h + d, (E,), w, 1e-5),
                               rtol=1e-6, atol=1e-6)
    x = torch.randn(T, N, D, generator=g)
    cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
    ref = _rope_ref(x, cos, sin)
    apply_rope_(x, cos, sin)
    torch.testing.assert_close(x, ref, rtol=1e-6, atol=1e-6)
    gate_up = torch.randn(T, 2 * E, generator=g)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate_up[:, :E]) * gate_up[:, E:], rtol=1e-6, atol=1e-7)


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    """``x`` with values whose bf16 rounding is a tie (both ways), a bf16 subnormal, a NaN, an overflow to inf."""
    flat = x.view(-1)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x00018000, 0x7F7FFFFF], dtype=torch.int32).view(torch.float32)
    flat[: len(ties)] = ties
    flat[-1] = float("nan")
    return x


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same dtype and values, NaN where the other has NaN (their payloads may differ)."""
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("E", (576, 104, 13))
def test_add_rms_norm_reads_bf16_deltas_and_writes_bf16_like_casts(T: int, E: int) -> None:
    """gguf-bf16's layers: the delta a bf16 GEMM returned is widened as it is added, and the norm written for the
    next bf16 GEMM is rounded like ``.to(torch.bfloat16)`` (nearest even): the same bits as the casts around the
    fp32 op."""
    g = torch.Generator().manual_seed(T * E + 1)
    h, w = torch.randn(T, E, generator=g), torch.randn(E, generator=g)
    d = torch.randn(T, E, generator=g).bfloat16()
    ref_h, h0 = h.clone(), h.clone()
    ref = torch.ops.pagedllm.add_rms_norm(ref_h, d.float(), w, 1e-5).bfloat16()
    got = torch.ops.pagedllm.add_rms_norm(h, d, w, 1e-5, True)
    assert got.dtype == torch.bfloat16 and torch.equal(h, ref_h) and torch.equal(got, ref)
    y = _with_specials(torch.randn(T, E, generator=g) * 3)  # the rounding alone: a unit norm weight, no delta
    h2 = y.clone()
    rounded = torch.ops.pagedllm.add_rms_norm(h2, None, torch.ones(E), 1e-5, True)
    want = torch.ops.pagedllm.add_rms_norm(y.clone(), None, torch.ones(E), 1e-5).bfloat16()
    _same(rounded, want)
    assert torch.equal(add_rms_norm_(h0, d, w, 1e-5, torch.bfloat16), got)  # the wrapper takes the op


def _a_bf16_neighbour(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` (bf16) is ``want`` (fp32) as a cast rounds it, or its other bf16 neighbour (within one bf16 ulp);
    NaN where ``want`` has NaN."""
    assert got.dtype == torch.bfloat16
    g, w, cast = got.float(), want.float(), want.bfloat16().float()
    assert torch.equal(g.isnan(), w.isnan())
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(w).exponent - 8)  # bf16 keeps 8 significant bits
    ok = (g == cast) | ((g - w).abs() <= ulp) | w.isnan()
    assert ok.all(), (g[~ok], w[~ok])


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("I", (1536, 100, 13))
def test_silu_mul_in_and_out_of_bf16(T: int, I: int) -> None:
    """fp32 outputs keep ATen's bits whatever the input dtype; bf16 outputs (a faster exp) are the fp32 result
    rounded, up to one bf16 ulp."""
    g = torch.Generator().manual_seed(T + I + 2)
    gate_up = _with_specials(4 * torch.randn(T, 2 * I, generator=g))
    want = torch.ops.pagedllm.silu_mul(gate_up)
    _a_bf16_neighbour(torch.ops.pagedllm.silu_mul(gate_up, True), want)
    gb = gate_up.bfloat16()
    want_b = torch.ops.pagedllm.silu_mul(gb.float())
    _same(torch.ops.pagedllm.silu_mul(gb), want_b)  # bf16 in, fp32 out
    _a_bf16_neighbour(torch.ops.pagedllm.silu_mul(gb, True), want_b)
    _same(silu_mul(gb, torch.bfloat16), torch.ops.pagedllm.silu_mul(gb, True))  # the wrapper takes the op


def test_silu_mul_bf16_outputs_round_like_casts_but_rarely() -> None:
    """Over 6M outputs the fast exp moves fewer than one in 10,000 bf16 outputs off the rounded fp32 value."""
    gate_up = 4 * torch.randn(4096, 2 * 1536, generator=torch.Generator().manual_seed(5))
    got = torch.ops.pagedllm.silu_mul(gate_up, True)
    want = torch.ops.pagedllm.silu_mul(gate_up)
    _a_bf16_neighbour(got, want)
    assert (got != want.bfloat16()).sum().item() < gate_up.numel() // 2 // 10_000
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.pagedllm.silu_mul(gate_up.half())
