"""Triton kernel writing a step's new K and V into the paged pool in one launch (vLLM's
``reshape_and_cache``): token ``t``'s rows go to slot ``slot_mapping[t]`` of every kv head."""

from __future__ import annotations

import torch

from pagedllm.attention.triton_common import HAS_TRITON, pad_pow2

if HAS_TRITON:  # pragma: no cover - exercised only where triton is installed
    import triton
    import triton.language as tl

    @triton.jit
    def _write_kv_kernel(K, V, KC, VC, SLOTS, sk0, sk1, sv0, sv1, skc0, skc1, svc0, svc1,
                         D: tl.constexpr, D_PAD: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, D_PAD)
        dmask = d < D
        slot = tl.load(SLOTS + t).to(tl.int64)
        k = tl.load(K + t * sk0 + h * sk1 + d, mask=dmask)
        v = tl.load(V + t * sv0 + h * sv1 + d, mask=dmask)
        tl.store(KC + h * skc0 + slot * skc1 + d, k.to(KC.dtype.element_ty), mask=dmask)
        tl.store(VC + h * svc0 + slot * svc1 + d, v.to(VC.dtype.element_ty), mask=dmask)


def write_kv_fused(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """``k, v [T, Hkv, D]`` into the pool ``[Hkv, slots, D]`` (cast to the pool's dtype) at ``slot_mapping [T]``."""
    T, Hkv, D = k.shape
    if T == 0:
        return
    _write_kv_kernel[(T, Hkv)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), D=D, D_PAD=pad_pow2(D, 16))
