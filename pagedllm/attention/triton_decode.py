"""CUDA backend: a Triton paged-decode kernel (block-table indirection, GQA) and a Triton paged
prefill kernel for the chunks (``triton_prefill.py``), both reading K/V in place.

Import-safe without triton or CUDA: the kernel is defined only when ``import triton`` works, and
``TritonBackend()`` raises a clear RuntimeError when it cannot run (it runs on the CPU under
``TRITON_INTERPRET=1``, which is how CI tests it). One program per (decode sequence, kv head)
computes all ``group`` query heads of that kv head together, walking the sequence's keys
``BLOCK_N`` positions at a time through the block table, with an online softmax in fp32.
"""

from __future__ import annotations

import os

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton_prefill import paged_prefill
from pagedllm.attention.triton_splitk import splitk_decode
from pagedllm.attention.triton_write import write_kv_fused

SPLITK_MIN_LEN = 1024  # decodes over contexts this long split their keys across programs (flash-decoding)

try:  # pragma: no cover - exercised only on machines with triton
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install without a driver
    triton = None
    tl = None
    HAS_TRITON = False


if HAS_TRITON:  # pragma: no cover

    @triton.jit
    def _paged_decode_kernel(
        Q, K, V, O, BT, SL,
        sq0, sq1, sk0, sk1, sv0, sv1, so0, so1, sbt,
        scale, block_size,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        seq_len = tl.load(SL + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        gmask = g < GROUP
        dmask = d < D
        heads = kvh * GROUP + g
        q = tl.load(Q + seq * sq0 + heads[:, None] * sq1 + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        q = q.to(tl.float32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        for start in range(0, seq_len, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < seq_len
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
        out = acc / l_i[:, None]
        tl.store(
            O + seq * so0 + heads[:, None] * so1 + d[None, :],
            out.to(O.dtype.element_ty),
            mask=gmask[:, None] & dmask[None, :],
        )


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class TritonBackend:
    name = "triton"

    def __init__(self, block_n: int = 64, splitk_min_len: int = SPLITK_MIN_LEN) -> None:
        if not HAS_TRITON:
            raise RuntimeError("the 'triton' attention backend needs the triton package (pip install triton)")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the 'triton' attention backend needs a CUDA GPU (or TRITON_INTERPRET=1, for tests); "
                               "use 'cpu' or 'flex' on CPU")
        self.block_n = block_n
        self.splitk_min_len = splitk_min_len

    def prepare(self, meta: AttentionMetadata) -> None:
        return None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        write_kv_fused(k, v, k_cache, v_cache, meta.slot_mapping.to(k.device))
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        H, D = q.shape[1], q.shape[2]
        Hkv = k_cache.shape[0]
        group = H // Hkv
        nd = meta.num_decodes
        max_decode_len = max(meta.seq_lens_list[:nd], default=0)
        if nd > 0 and max_decode_len >= self.splitk_min_len:
            splitk_decode(q, k_cache, v_cache, out, meta.block_tables.to(q.device), meta.seq_lens.to(q.device), nd,
                          max_decode_len, meta.block_size, scale)
        elif nd > 0:
            bt = meta.block_tables.to(q.device)
            sl = meta.seq_lens.to(q.device)
            _paged_decode_kernel[(nd, Hkv)](
                q, k_cache, v_cache, out, bt, sl,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), bt.stride(0),
                float(scale), meta.block_size,
                GROUP=group, GROUP_PAD=max(2, _next_pow2(group)), D=D, D_PAD=max(16, _next_pow2(D)),
                BLOCK_N=self.block_n,
            )
        if nd < meta.num_seqs:  # prefill chunks: varlen causal attention over the paged K/V
            paged_prefill(q, k_cache, v_cache, out, meta.block_tables.to(q.device), meta.query_start_loc.to(q.device),
                          meta.seq_lens.to(q.device), nd, meta.num_seqs - nd, meta.max_query_len, meta.block_size,
                          scale)
        return out
