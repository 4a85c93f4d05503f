"""Triton kernel for prefill chunks and mixed batches: variable-length causal attention of each
chunk's queries over its sequence's K/V, read in place through the block table (flash-attention
style: online softmax in fp32, no gather of the context into a dense copy), from float or int8 / fp8
pools (dequantized as loaded).

One program per (sequence, query head, tile of ``BLOCK_M`` queries). A chunk of ``q_len`` new
tokens at the end of a ``seq_len``-token sequence puts query ``i`` at position ``seq_len - q_len + i``;
it attends to keys ``0..position``. Runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1``
(what CI uses to test it).
"""

from __future__ import annotations

import torch

from pagedllm.attention.triton_common import HAS_TRITON, pad_pow2, pool_args

if HAS_TRITON:  # pragma: no cover - exercised only where triton is installed
    import triton
    import triton.language as tl

    from pagedllm.attention.triton_common import attend_range

    # the table's width and the first chunk's index change from step to step: no variant for a 1 or a 16k
    @triton.jit(do_not_specialize=["sbt", "first_seq"])
    def _paged_prefill_kernel(
        Q, K, V, O, BT, QSL, SL, KS, VS,
        sq0, sq1, sk0, sk1, sv0, sv1, so0, so1, sbt, sks0, sks1, svs0, svs1,
        scale, block_size, first_seq,
        GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FORMAT: tl.constexpr, IEEE: tl.constexpr,
    ):
        seq = tl.program_id(0) + first_seq
        head = tl.program_id(1)
        tile = tl.program_id(2)
        q_start = tl.load(QSL + seq)
        q_len = tl.load(QSL + seq + 1) - q_start
        if tile * BLOCK_M < q_len:
            seq_len = tl.load(SL + seq)
            m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            d = tl.arange(0, D_PAD)
            mask = (m < q_len)[:, None] & (d < D)[None, :]
            q = tl.load(Q + (q_start + m)[:, None] * sq0 + head * sq1 + d[None, :], mask=mask, other=0.0)
            q_pos = seq_len - q_len + m  # logical position of each query
            end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)  # causal: no key past the tile
            acc, m_i, l_i = attend_range(q.to(tl.float32), q_pos, 0, end, K, V, KS, VS, BT + seq * sbt, head // GROUP,
                                         block_size, scale, sk0, sk1, sv0, sv1, sks0, sks1, svs0, svs1,
                                         BLOCK_M, D, D_PAD, BLOCK_N, FORMAT, True, IEEE)
            tl.store(O + (q_start + m)[:, None] * so0 + head * so1 + d[None, :],
                     (acc / l_i[:, None]).to(O.dtype.element_ty), mask=mask)


def paged_prefill(q: torch.Tensor, k_cache, v_cache, out: torch.Tensor,
                  block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  first_seq: int, num_seqs: int, max_query_len: int, block_size: int, scale: float,
                  block_m: int = 16, block_n: int = 32) -> None:
    """Write into ``out`` the attention of sequences ``first_seq..first_seq + num_seqs - 1`` of the flat
    batch (queries ``q [T, H, D]``; pool ``[Hkv, slots, D]``, a float tensor or a
    :class:`~pagedllm.kv.kv_quant.QuantizedKV`); other rows of ``out`` are untouched."""
    if num_seqs <= 0:
        return
    H, D = q.shape[1], q.shape[2]
    group = H // k_cache.shape[0]
    kd, vd, ks, vs, fmt = pool_args(k_cache, v_cache)
    grid = (num_seqs, H, triton.cdiv(max_query_len, block_m))
    _paged_prefill_kernel[grid](
        q, kd, vd, out, block_tables, query_start_loc, seq_lens, ks, vs,
        q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        float(scale), block_size, first_seq,
        GROUP=group, D=D, D_PAD=pad_pow2(D, 16), BLOCK_M=block_m, BLOCK_N=block_n, FORMAT=fmt,
        IEEE=q.dtype == torch.float32,  # an fp32 model's products stay fp32 (exact path); else TF32 suffices
    )
