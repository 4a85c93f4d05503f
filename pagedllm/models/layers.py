"""Building blocks of the Llama family: RMSNorm, rotary embeddings (with rope scaling).

Every op works on a flat batch of tokens ``[T, ...]`` from many sequences at once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.models.bf16_gemm import PackedBF16, bf16_linear, bf16_linear_silu
from pagedllm.models.quant import QuantizedWeight, quantized_linear

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight | PackedBF16, b: torch.Tensor | None = None,
           upcast: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear`` over a flat batch ``x [T, K]``.

    With ``upcast`` the weight is low precision and the math runs in fp32 on fp32 activations: on
    CPUs without native bf16 that is ~4x faster than a bf16 GEMM and more accurate. fp32 activations
    on the CPU go to the C++ kernel (``ops/csrc/gemm.cpp``; ATen where it can't be built, e.g. without AVX2)
    at every batch size: it streams the weights near memory bandwidth for decode steps and beats MKL and
    oneDNN by 10-40% on larger batches here (2-core EPYC, AVX2). GGUF block weights: see ``models/quant.py``;
    bf16 weights prepacked for oneDNN: ``models/bf16_gemm.py``. ``out_dtype`` is for those bf16 GEMMs only
    (see :func:`bf16_gemm_rows`): their result's dtype, bias added in it; default ``x``'s dtype.
    """
    if isinstance(w, QuantizedWeight):
        return quantized_linear(x, w, b, out_dtype)
    if isinstance(w, PackedBF16):
        return bf16_linear(x, w, b, out_dtype)
    if (x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu" and x.is_contiguous()
            and gemm_cpp_weight(w)):
        if ops.load("gemm"):
            return torch.ops.pagedllm.linear.default(x, w, b)
    if not upcast:
        return F.linear(x, w, b)
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def gemm_cpp_weight(w: torch.Tensor) -> bool:
    """Whether gemm.cpp's ``linear`` takes this weight (fp32 or bf16, contiguous, K a multiple of 8) for fp32 CPU
    rows: the one test :func:`linear` and the fused decode call (``models/decode_layer.py``) both route by."""
    return w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous() and w.dim() == 2 and w.shape[1] % 8 == 0


def bf16_gemm_rows(w: torch.Tensor | QuantizedWeight | PackedBF16, rows: int) -> bool:
    """Whether :func:`linear` runs ``rows`` rows through ``w`` as a bf16 GEMM (a prepacked bf16 matrix, or a GGUF
    matrix's bf16 copy from its ``min_rows``), so fp32 activations are rounded to bf16 at its input anyway."""
    packed = w.bf16 if isinstance(w, QuantizedWeight) else w if isinstance(w, PackedBF16) else None
    return packed is not None and rows >= packed.min_rows


def _fp32_cpu(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor (None aside) is contiguous float32 on the CPU, as the fused kernels require.
    A plain loop over the cheapest attributes: at batch 1 this check runs ~120 times a step."""
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous()):
            return False
    return True


def _fp32_or_bf16_cpu(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is None or a contiguous float32 or bfloat16 CPU tensor (a bf16 GEMM's output)."""
    return t is None or (t.dtype in (torch.float32, torch.bfloat16) and t.is_cpu and t.is_contiguous())


def _fused_cuda(*tensors: torch.Tensor | None):
    """The fused Triton kernels (ops/triton_fused.py, imported on first CUDA use) when every tensor (None aside)
    is contiguous on CUDA and triton is installed; else None."""
    if not all(t is None or (t.is_cuda and t.is_contiguous()) for t in tensors):
        return None
    from pagedllm.ops import triton_fused

    return triton_fused if triton_fused.HAS_TRITON else None


def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``h += delta`` in place (the residual add; skipped when ``delta`` is None), then ``rms_norm(h)``, returned
    in ``out_dtype`` (default: ``h``'s).

    For fp32 ``[T, E]`` on CPU this is one C++ op: ATen runs RMSNorm as ~8 small ops, which is most
    of the per-op overhead of a batch-1 decode step. There ``delta`` may be bf16 and ``out_dtype`` bf16 (the
    outputs and inputs of bf16 GEMMs, ``models/bf16_gemm.py``): the same values as casting around the fp32 op.
    Anything else goes through :func:`rms_norm`.
    """
    bf16_out = out_dtype == torch.bfloat16 and h.dtype == torch.float32
    if h.dim() == 2 and weight.dim() == 1 and _fp32_cpu(h, weight) and _fp32_or_bf16_cpu(delta):
        if ops.load("fused_ops"):
            return torch.ops.pagedllm.add_rms_norm.default(h, delta, weight, eps, bf16_out)
    elif h.dim() == 2 and weight.dim() == 1 and weight.dtype == h.dtype and (fused := _fused_cuda(h, delta, weight)):
        return fused.add_rms_norm_triton(h, delta, weight, eps)
    if delta is not None:
        h.add_(delta)
    y = rms_norm(h, weight, eps)
    return y if out_dtype is None else y.to(out_dtype)


def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up output ``[T, 2I]`` (gate first), in ``out_dtype`` (default:
    ``gate_up``'s); one C++ op on CPU for fp32, and for a bf16 ``gate_up`` (a bf16 GEMM's output) computed in fp32."""
    if gate_up.dim() == 2 and _fp32_or_bf16_cpu(gate_up) and (gate_up.dtype == torch.float32 or out_dtype is not None):
        if ops.load("fused_ops"):
            return torch.ops.pagedllm.silu_mul.default(gate_up, (out_dtype or gate_up.dtype) == torch.bfloat16)
    elif gate_up.dim() == 2 and (fused := _fused_cuda(gate_up)):
        y = fused.silu_mul_triton(gate_up)
        return y if out_dtype is None else y.to(out_dtype)
    inter = gate_up.shape[-1] // 2
    g = gate_up if out_dtype is None else gate_up.float()
    y = F.silu(g[..., :inter]).mul_(g[..., inter:])
    return y if out_dtype is None else y.to(out_dtype)


def linear_silu_mul(x: torch.Tensor, w: torch.Tensor | QuantizedWeight | PackedBF16, upcast: bool = False,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``silu_mul(linear(x, w), out_dtype)`` for a fused gate/up matrix ``w``, the same bits. With a bf16 result
    from a bf16 GEMM on an AMX copy, one pass (``bf16_gemm.bf16_linear_silu``) instead of the GEMM writing
    ``[T, 2I]`` and ``silu_mul`` reading it back (AMX Xeon, 2 threads, the 30 layers' gate/up out of cache: 6.2 -> 4.9
    ms at 64 rows, 25.3 -> 15.8 at 270, 69.2 -> 58.7 at 1,024)."""
    packed = w.bf16 if isinstance(w, QuantizedWeight) else w if isinstance(w, PackedBF16) else None
    if out_dtype == torch.bfloat16 and packed is not None and x.dim() == 2:
        y = bf16_linear_silu(x, packed)
        if y is not None:
            return y
    return silu_mul(linear(x, w, None, upcast), out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 like Hugging Face's ``LlamaRMSNorm``.

    For fp32 inputs this is one fused ATen op; for low-precision inputs the normalisation runs
    in float32 and the result is cast back before the weight multiply (HF's order).
    """
    if x.dtype == torch.float32:
        if weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight  # per-head weights [N, D]
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return y * weight


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), with Llama-3 / linear rope scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    rope_type = "default"
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; pagedllm implements {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def rope_cos_sin(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed ``cos, sin`` tables ``[max_positions, head_dim // 2]`` (computed in float32)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope_heads_(x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first ``num_heads`` heads of each row of a fused projection output ``x [T, W]`` in place
    (the q and k heads of qkv); one C++ op for fp32 on CPU, without building head views."""
    if x.dim() == 2 and _fp32_cpu(x, cos, sin):
        if ops.load("fused_ops"):
            torch.ops.pagedllm.rope.default(x, cos, sin, num_heads)
            return
    elif x.dim() == 2 and (fused := _fused_cuda(x, cos, sin)):
        fused.rope_qkv_triton(x, num_heads, cos, sin)
        return
    d = 2 * cos.shape[-1]
    apply_rope_(x[:, : num_heads * d].view(x.shape[0], num_heads, d), cos, sin)


def rope_widened(x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x.float()`` with :func:`apply_rope_heads_` applied to it, for a bf16 GEMM's fused output ``x [T, W]``: one
    C++ pass on CPU (the same bits as widening, then rotating), those two steps elsewhere."""
    if x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_cpu and x.is_contiguous() and _fp32_cpu(cos, sin):
        if ops.load("fused_ops"):
            return torch.ops.pagedllm.rope_widen.default(x, cos, sin, num_heads)
    y = x.float()
    apply_rope_heads_(y, num_heads, cos, sin)
    return y


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x [T, N, D]`` in place (Hugging Face's rotate-half layout) by per-token ``cos, sin [T, D/2]``.

    Same arithmetic as HF's ``x * cos + rotate_half(x) * sin`` (the halves of its duplicated tables
    are equal), on the whole batch and all heads at once. ``x`` may be the q/k heads viewed inside the
    fused qkv output (rows strided, each row's heads contiguous): fp32 on CPU is one C++ op then.
    """
    if (x.dim() == 3 and x.dtype == torch.float32 and x.is_cpu and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and _fp32_cpu(cos, sin)):
        if ops.load("fused_ops"):
            torch.ops.pagedllm.rope.default(x, cos, sin)
            return
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c = cos[:, None, :]
    s = sin[:, None, :]
    x1s = x1 * s
    x1.mul_(c).sub_(x2 * s)
    x2.mul_(c).add_(x1s)
