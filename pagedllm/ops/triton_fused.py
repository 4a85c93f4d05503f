"""Fused Triton kernels for the decode step on CUDA: residual add + RMSNorm, SiLU * up, and rotary on the
q/k heads of the fused qkv output (optionally writing the rotated K and V to the paged pool in the same
launch). Each replaces several eager ATen ops (and their memory passes) with one launch per step.

The arithmetic follows the torch path of ``models/layers.py`` rounding for rounding: fp32 inside, each
intermediate the torch path stores in the activation dtype is rounded to it here too. Import-safe without
triton (``HAS_TRITON``); tested in Triton's CPU interpreter (``TRITON_INTERPRET=1``) against the torch path.
"""

from __future__ import annotations

import torch

try:  # pragma: no cover - exercised only where triton is installed
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install without a driver
    HAS_TRITON = False

if HAS_TRITON:  # pragma: no cover - exercised only where triton is installed

    @triton.jit
    def _add_rms_norm_kernel(H, DELTA, W, OUT, E, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < E
        h = tl.load(H + row * E + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(DELTA + row * E + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + d.to(tl.float32)).to(H.dtype.element_ty)
            tl.store(H + row * E + cols, h, mask=mask)
        x = h.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / E + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x * r).to(OUT.dtype.element_ty).to(tl.float32) * w
        tl.store(OUT + row * E + cols, y.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(GU + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * inter + cols, (a * u).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_qkv_kernel(QKV, COS, SIN, SLOTS, KC, VC, width, num_heads, num_q_heads, skc0, skc1, svc0, svc1,
                         HALF: tl.constexpr, HALF_PAD: tl.constexpr, WRITE_KV: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)  # a rotated head (q, then k)
        i = tl.arange(0, HALF_PAD)
        mask = i < HALF
        base = QKV + t * width + h * 2 * HALF
        x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(COS + t * HALF + i, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * HALF + i, mask=mask, other=0.0).to(tl.float32)
        # torch rounds each product to the activation dtype before combining them
        ty = QKV.dtype.element_ty
        y1 = ((x1 * c).to(ty).to(tl.float32) - (x2 * s).to(ty).to(tl.float32)).to(ty)
        y2 = ((x2 * c).to(ty).to(tl.float32) + (x1 * s).to(ty).to(tl.float32)).to(ty)
        tl.store(base + i, y1, mask=mask)
        tl.store(base + HALF + i, y2, mask=mask)
        if WRITE_KV:
            if h >= num_q_heads:  # a k head: it and its v head go to the pool
                kh = h - num_q_heads
                slot = tl.load(SLOTS + t).to(tl.int64)
                dst = KC + kh * skc0 + slot * skc1
                tl.store(dst + i, y1.to(KC.dtype.element_ty), mask=mask)
                tl.store(dst + HALF + i, y2.to(KC.dtype.element_ty), mask=mask)
                vsrc = QKV + t * width + (num_heads + kh) * 2 * HALF  # v heads follow the rotated heads
                vdst = VC + kh * svc0 + slot * svc1
                tl.store(vdst + i, tl.load(vsrc + i, mask=mask).to(VC.dtype.element_ty), mask=mask)
                tl.store(vdst + HALF + i, tl.load(vsrc + HALF + i, mask=mask).to(VC.dtype.element_ty), mask=mask)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def add_rms_norm_triton(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (skipped when None), then RMSNorm of ``h [T, E]`` times ``weight [E]``: one launch."""
    T, E = h.shape
    out = torch.empty_like(h)
    if T:
        _add_rms_norm_kernel[(T,)](h, h if delta is None else delta, weight, out, E, eps,
                                   HAS_DELTA=delta is not None, BLOCK=_pow2(E))
    return out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2I]`` (gate first): one launch."""
    T, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(inter))
    if T:
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


def rope_qkv_triton(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """Rotate the first ``num_heads`` heads of ``qkv [T, W]`` in place by ``cos, sin [T, D/2]`` (HF's rotate-half
    layout). ``kv = (k_cache, v_cache, slot_mapping, num_q_heads)``: the heads past ``num_q_heads`` are k heads;
    they and the v heads after them are written to the pool ``[Hkv, slots, D]`` in the same launch."""
    T, width = qkv.shape
    half = cos.shape[-1]
    if not T:
        return
    if kv is None:
        _rope_qkv_kernel[(T, num_heads)](qkv, cos, sin, qkv, qkv, qkv, width, num_heads, num_heads, 0, 0, 0, 0,
                                         HALF=half, HALF_PAD=_pow2(half), WRITE_KV=False)
        return
    k_cache, v_cache, slots, num_q = kv
    _rope_qkv_kernel[(T, num_heads)](qkv, cos, sin, slots, k_cache, v_cache, width, num_heads, num_q,
                                     k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                                     HALF=half, HALF_PAD=_pow2(half), WRITE_KV=True)
