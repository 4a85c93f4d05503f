"""Split-K (flash-decoding) Triton kernel for decode steps over long contexts.

One decode sequence gives one program per kv head in the single-pass kernel: with a few long
sequences most of a GPU sits idle. Here the keys are also split into ``SPLIT``-token ranges, one
program each, each writing its partial result (output normalised by its own softmax sum, and the
log-sum-exp); the partials are merged by their log-sum-exp weights. Reads K/V in place through the
block table; GQA: a program computes every query head of its kv head.
"""

from __future__ import annotations

import torch

from pagedllm.attention.triton_prefill import HAS_TRITON, _pad_pow2

if HAS_TRITON:  # pragma: no cover - exercised only where triton is installed
    import triton
    import triton.language as tl

    @triton.jit
    def _splitk_decode_kernel(
        Q, K, V, PO, PL, BT, SL,
        sq0, sq1, sk0, sk1, sv0, sv1, sbt,
        spo0, spo1, spo2, spl0, spl1,
        scale, block_size,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        seq_len = tl.load(SL + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        gmask = g < GROUP
        dmask = d < D
        heads = kvh * GROUP + g
        q = tl.load(Q + seq * sq0 + heads[:, None] * sq1 + d[None, :], mask=gmask[:, None] & dmask[None, :],
                    other=0.0).to(tl.float32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        lo = part * SPLIT
        hi = tl.minimum(lo + SPLIT, seq_len)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < hi
            phys = tl.load(BT + seq * sbt + n // block_size, mask=nmask, other=0).to(tl.int64)
            slot = phys * block_size + n % block_size
            kvmask = nmask[:, None] & dmask[None, :]
            k = tl.load(K + kvh * sk0 + slot[:, None] * sk1 + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kvh * sv0 + slot[:, None] * sv1 + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        empty = l_i == 0  # a split past the sequence's end (or a padded head)
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(PO + seq * spo0 + heads[:, None] * spo1 + part * spo2 + d[None, :], out,
                 mask=gmask[:, None] & dmask[None, :])
        tl.store(PL + seq * spl0 + heads * spl1 + part, lse, mask=gmask)


def splitk_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, num_decodes: int, max_seq_len: int,
                  block_size: int, scale: float, split: int = 256, block_n: int = 64) -> None:
    """Attention of the first ``num_decodes`` rows of ``q [T, H, D]`` (one query each) into ``out``."""
    H, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[0]
    group = H // Hkv
    parts = triton.cdiv(max_seq_len, split)
    po = torch.empty((num_decodes, H, parts, D), dtype=torch.float32, device=q.device)
    pl = torch.empty((num_decodes, H, parts), dtype=torch.float32, device=q.device)
    _splitk_decode_kernel[(num_decodes, Hkv, parts)](
        q, k_cache, v_cache, po, pl, block_tables, seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        float(scale), block_size,
        GROUP=group, GROUP_PAD=_pad_pow2(group, 2), D=D, D_PAD=_pad_pow2(D, 16), SPLIT=split, BLOCK_N=block_n,
    )
    weights = torch.softmax(pl, dim=-1).nan_to_num_(0.0)  # exp(lse_s - logsumexp(lse)); empty splits weigh 0
    out[:num_decodes] = (weights[..., None] * po).sum(2).to(out.dtype)
