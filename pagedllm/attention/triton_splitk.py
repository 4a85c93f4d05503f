"""Split-K (flash-decoding) Triton kernel for decode steps over long contexts.

One decode sequence gives one program per kv head in the single-pass kernel: with a few long
sequences most of a GPU sits idle. Here the keys are also split into ``SPLIT``-token ranges, one
program each, each writing its partial result (output normalised by its own softmax sum, and the
log-sum-exp); the partials are merged by their log-sum-exp weights. Reads K/V in place through the
block table, from float or int8 / fp8 pools (dequantized as loaded); GQA: a program computes every
query head of its kv head.
"""

from __future__ import annotations

import torch

from pagedllm.attention.triton_common import HAS_TRITON, pad_pow2, pool_args

MAX_SPLITS = 64  # partial results per (sequence, head) at most: their buffer is [decodes, H, splits, D] fp32


def split_len(max_seq_len: int, split: int = 256) -> int:
    """Keys per split: ``split``, doubled until ``MAX_SPLITS`` splits cover ``max_seq_len``. Bounds the partials'
    memory (a decode graph sizes them by ``max_model_len``) with few distinct kernels (SPLIT is a constexpr)."""
    while -(-max_seq_len // split) > MAX_SPLITS:
        split *= 2
    return split

if HAS_TRITON:  # pragma: no cover - exercised only where triton is installed
    import triton
    import triton.language as tl

    from pagedllm.attention.triton_common import attend_range, load_group_queries

    # the table's width and the partials' strides (the split count) change from step to step: no variant for 1 or 16k
    @triton.jit(do_not_specialize=["sbt", "spo0", "spo1", "spl0", "spl1"])
    def _splitk_decode_kernel(
        Q, K, V, PO, PL, BT, SL, KS, VS,
        sq0, sq1, sk0, sk1, sv0, sv1, sbt, sks0, sks1, svs0, svs1,
        spo0, spo1, spo2, spl0, spl1,
        scale, block_size,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, FORMAT: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        seq_len = tl.load(SL + seq)
        q, heads, mask = load_group_queries(Q, seq, kvh, sq0, sq1, GROUP, GROUP_PAD, D, D_PAD)
        lo = part * SPLIT
        hi = tl.minimum(lo + SPLIT, seq_len)
        q_pos = tl.zeros([GROUP_PAD], tl.int32) + seq_len - 1
        acc, m_i, l_i = attend_range(q, q_pos, lo, hi, K, V, KS, VS, BT + seq * sbt, kvh, block_size, scale,
                                     sk0, sk1, sv0, sv1, sks0, sks1, svs0, svs1,
                                     GROUP_PAD, D, D_PAD, BLOCK_N, FORMAT, False)
        empty = l_i == 0  # a split past the sequence's end (or a padded head)
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        d = tl.arange(0, D_PAD)
        tl.store(PO + seq * spo0 + heads[:, None] * spo1 + part * spo2 + d[None, :], out, mask=mask)
        tl.store(PL + seq * spl0 + heads * spl1 + part, lse, mask=tl.arange(0, GROUP_PAD) < GROUP)


def splitk_decode(q: torch.Tensor, k_cache, v_cache, out: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, num_decodes: int, max_seq_len: int,
                  block_size: int, scale: float, split: int = 256, block_n: int = 64) -> None:
    """Attention of the first ``num_decodes`` rows of ``q [T, H, D]`` (one query each) into ``out``; the pool
    ``[Hkv, slots, D]`` is a float tensor or a :class:`~pagedllm.kv.kv_quant.QuantizedKV`. The grid depends on
    ``num_decodes`` and ``max_seq_len`` only (read from the host), never on the lengths in ``seq_lens``."""
    H, D = q.shape[1], q.shape[2]
    split = split_len(max_seq_len, split)
    Hkv = k_cache.shape[0]
    group = H // Hkv
    parts = triton.cdiv(max_seq_len, split)
    po = torch.empty((num_decodes, H, parts, D), dtype=torch.float32, device=q.device)
    pl = torch.empty((num_decodes, H, parts), dtype=torch.float32, device=q.device)
    kd, vd, ks, vs, fmt = pool_args(k_cache, v_cache)
    _splitk_decode_kernel[(num_decodes, Hkv, parts)](
        q, kd, vd, po, pl, block_tables, seq_lens, ks, vs,
        q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1), block_tables.stride(0),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        float(scale), block_size,
        GROUP=group, GROUP_PAD=pad_pow2(group, 2), D=D, D_PAD=pad_pow2(D, 16), SPLIT=split, BLOCK_N=block_n,
        FORMAT=fmt,
    )
    weights = torch.softmax(pl, dim=-1).nan_to_num_(0.0)  # exp(lse_s - logsumexp(lse)); empty splits weigh 0
    out[:num_decodes] = (weights[..., None] * po).sum(2).to(out.dtype)
