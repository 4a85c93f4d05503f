"""Triton kernel for prefill chunks and mixed batches: variable-length causal attention of each
chunk's queries over its sequence's K/V, read in place through the block table (flash-attention
style: online softmax in fp32, no gather of the context into a dense copy).

One program per (sequence, query head, tile of ``BLOCK_M`` queries). A chunk of ``q_len`` new
tokens at the end of a ``seq_len``-token sequence puts query ``i`` at position ``seq_len - q_len + i``;
it attends to keys ``0..position``. Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1``
(what CI uses to test it).
"""

from __future__ import annotations

import torch

try:  # pragma: no cover - exercised only where triton is installed
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install without a driver
    triton = None
    tl = None
    HAS_TRITON = False


if HAS_TRITON:  # pragma: no cover

    @triton.jit
    def _paged_prefill_kernel(
        Q, K, V, O, BT, QSL, SL,
        sq0, sq1, sk0, sk1, sv0, sv1, so0, so1, sbt,
        scale, block_size, first_seq,
        GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        seq = tl.program_id(0) + first_seq
        head = tl.program_id(1)
        tile = tl.program_id(2)
        kvh = head // GROUP
        q_start = tl.load(QSL + seq)
        q_len = tl.load(QSL + seq + 1) - q_start
        if tile * BLOCK_M < q_len:
            seq_len = tl.load(SL + seq)
            m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            d = tl.arange(0, D_PAD)
            mmask = m < q_len
            dmask = d < D
            q_pos = seq_len - q_len + m  # logical position of each query
            q = tl.load(Q + (q_start + m)[:, None] * sq0 + head * sq1 + d[None, :],
                        mask=mmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
            end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)  # causal: no key past the tile
            for start in range(0, end, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                nmask = n < end
                phys = tl.load(BT + seq * sbt + n // block_size, mask=nmask, other=0).to(tl.int64)
                slot = phys * block_size + n % block_size
                kvmask = nmask[:, None] & dmask[None, :]
                k = tl.load(K + kvh * sk0 + slot[:, None] * sk1 + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
                s = tl.dot(q, tl.trans(k)) * scale
                allowed = (n[None, :] <= q_pos[:, None]) & nmask[None, :]
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + kvh * sv0 + slot[:, None] * sv1 + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, v)
                m_i = m_new
            out = acc / l_i[:, None]
            tl.store(O + (q_start + m)[:, None] * so0 + head * so1 + d[None, :], out.to(O.dtype.element_ty),
                     mask=mmask[:, None] & dmask[None, :])


def _pad_pow2(x: int, lo: int) -> int:
    return max(lo, 1 << max(0, (x - 1).bit_length()))


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  first_seq: int, num_seqs: int, max_query_len: int, block_size: int, scale: float,
                  block_m: int = 16, block_n: int = 32) -> None:
    """Write into ``out`` the attention of sequences ``first_seq..first_seq + num_seqs - 1`` of the flat
    batch (queries ``q [T, H, D]``; pool ``[Hkv, slots, D]``); other rows of ``out`` are untouched."""
    if num_seqs <= 0:
        return
    H, D = q.shape[1], q.shape[2]
    group = H // k_cache.shape[0]
    grid = (num_seqs, H, triton.cdiv(max_query_len, block_m))
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        float(scale), block_size, first_seq,
        GROUP=group, D=D, D_PAD=_pad_pow2(D, 16), BLOCK_M=block_m, BLOCK_N=block_n,
    )
