"""The LoRA delta on CUDA as two gathered Triton kernels (Punica's BGMV): each token reads only its own
adapter's A and B, so a step costs what its tokens' adapters cost, whatever the number of slots.

``shrink``: one program per (token, target) computes ``s = A[slot, target] x`` (``[R]``, fp32) over K tiles;
``expand``: one program per (token, output tile) adds ``B[slot]^T s`` into the projection's columns. Base-model
tokens (slot -1) return at once. Runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``) for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.lora.slots import GroupWeights

BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _shrink(x_ptr, a_ptr, slot_ptr, s_ptr, K, stride_x, stride_as, stride_at, stride_ar, N_T: tl.constexpr,
            R: tl.constexpr, R_P2: tl.constexpr, BK: tl.constexpr):
    tok, t = tl.program_id(0), tl.program_id(1)  # (token, target)
    slot = tl.load(slot_ptr + tok)
    r = tl.arange(0, R_P2)
    if slot >= 0:
        acc = tl.zeros((R_P2,), dtype=tl.float32)
        base = a_ptr + slot.to(tl.int64) * stride_as + t * stride_at
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            xv = tl.load(x_ptr + tok.to(tl.int64) * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            av = tl.load(base + r[:, None] * stride_ar + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K),
                         other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(s_ptr + (tok * N_T + t) * R_P2 + r, acc)


@triton.jit
def _expand(s_ptr, b_ptr, slot_ptr, y_ptr, N, stride_y, stride_bs, stride_br, t, N_T: tl.constexpr,
            R: tl.constexpr, R_P2: tl.constexpr, BN: tl.constexpr):
    tok = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # this program's output columns
    slot = tl.load(slot_ptr + tok)
    if slot >= 0:
        r = tl.arange(0, R_P2)
        sv = tl.load(s_ptr + (tok * N_T + t) * R_P2 + r)
        bv = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + r[:, None] * stride_br + n[None, :],
                     mask=(r[:, None] < R) & (n[None, :] < N), other=0.0).to(tl.float32)
        delta = tl.sum(sv[:, None] * bv, axis=0)
        yp = y_ptr + tok.to(tl.int64) * stride_y + n
        yv = tl.load(yp, mask=n < N, other=0.0)
        tl.store(yp, (yv.to(tl.float32) + delta).to(yv.dtype), mask=n < N)


def bgmv_add_(y: torch.Tensor, x: torch.Tensor, w: GroupWeights, slot_of_token: torch.Tensor) -> None:
    """``y[:, target columns] += B_slot A_slot x`` per token (slot -1: nothing), in place."""
    T, K = x.shape
    _, n_t, R, _ = w.a.shape
    if T == 0:
        return
    x = x.contiguous()
    r_p2 = max(16, triton.next_power_of_2(R))
    s = torch.empty(T, n_t, r_p2, dtype=torch.float32, device=x.device)
    _shrink[(T, n_t)](x, w.a, slot_of_token, s, K, x.stride(0), w.a.stride(0), w.a.stride(1), w.a.stride(2),
                      N_T=n_t, R=R, R_P2=r_p2, BK=BLOCK_K)
    for t, (b, (lo, hi)) in enumerate(zip(w.b, w.bounds)):
        n = hi - lo
        out = y[:, lo:hi]
        _expand[(T, triton.cdiv(n, BLOCK_N))](s, b, slot_of_token, out, n, out.stride(0), b.stride(0), b.stride(1),
                                               t, N_T=n_t, R=R, R_P2=r_p2, BN=BLOCK_N)
