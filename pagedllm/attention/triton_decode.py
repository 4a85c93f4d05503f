"""CUDA backend: Triton paged kernels reading the K/V pool in place (float, int8 or fp8 blocks, dequantized
as they are loaded): this decode kernel, split-K decode for long contexts (``triton_splitk.py``) and varlen
causal prefill for the chunks (``triton_prefill.py``), all built on the helpers of ``triton_common.py``.

Import-safe without triton or CUDA: the kernel is defined only when ``import triton`` works, and
``TritonBackend()`` raises a clear RuntimeError when it cannot run (it runs on the CPU under
``TRITON_INTERPRET=1``, which is how CI tests it). One program per (decode sequence, kv head)
computes all ``group`` query heads of that kv head together, walking the sequence's keys
``BLOCK_N`` positions at a time through the block table, with an online softmax in fp32.
"""

from __future__ import annotations

import os

import torch

from pagedllm.attention.metadata import AttentionMetadata, write_kv
from pagedllm.attention.triton_common import HAS_TRITON, pad_pow2, pool_args
from pagedllm.attention.triton_prefill import paged_prefill
from pagedllm.attention.triton_splitk import splitk_decode
from pagedllm.attention.triton_write import write_kv_fused
from pagedllm.kv.kv_quant import QuantizedKV
from pagedllm.ops.triton_fused import rope_qkv_triton

SPLITK_MIN_LEN = 1024  # decodes over contexts this long split their keys across programs (flash-decoding)
SPLITK_MAX_SEQS = 64  # ... in batches of at most this many decodes (larger ones fill the GPU without splitting)

if HAS_TRITON:  # pragma: no cover - exercised only where triton is installed
    import triton
    import triton.language as tl

    from pagedllm.attention.triton_common import attend_range, load_group_queries

    # the block table's width changes from step to step: no variant compiled for a width of 1 or 16k
    @triton.jit(do_not_specialize=["sbt"])
    def _paged_decode_kernel(
        Q, K, V, O, BT, SL, KS, VS,
        sq0, sq1, sk0, sk1, sv0, sv1, so0, so1, sbt, sks0, sks1, svs0, svs1,
        scale, block_size,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, FORMAT: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        seq_len = tl.load(SL + seq)
        q, heads, mask = load_group_queries(Q, seq, kvh, sq0, sq1, GROUP, GROUP_PAD, D, D_PAD)
        q_pos = tl.zeros([GROUP_PAD], tl.int32) + seq_len - 1  # a decode's query sees its whole context
        acc, m_i, l_i = attend_range(q, q_pos, 0, seq_len, K, V, KS, VS, BT + seq * sbt, kvh, block_size, scale,
                                     sk0, sk1, sv0, sv1, sks0, sks1, svs0, svs1,
                                     GROUP_PAD, D, D_PAD, BLOCK_N, FORMAT, False)
        d = tl.arange(0, D_PAD)
        tl.store(O + seq * so0 + heads[:, None] * so1 + d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
                 mask=mask)


def interpreted() -> bool:
    """Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` set before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend:
    name = "triton"
    graph_safe = True  # decode reads only the metadata's tensors

    def __init__(self, block_n: int = 64, splitk_min_len: int = SPLITK_MIN_LEN) -> None:
        if not HAS_TRITON:
            raise RuntimeError("the 'triton' attention backend needs the triton package (pip install triton)")
        if not (torch.cuda.is_available() or interpreted()):
            raise RuntimeError("the 'triton' attention backend needs a CUDA GPU (or TRITON_INTERPRET=1, for tests); "
                               "use 'cpu' or 'flex' on CPU")
        self.block_n = block_n
        self.splitk_min_len = splitk_min_len

    def prepare(self, meta: AttentionMetadata) -> None:
        return None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        quantized = isinstance(k_cache, QuantizedKV)
        if quantized:  # quantizing write (codes + block scales)
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            if k.stride(-1) != 1 or v.stride(-1) != 1:
                k, v = k.contiguous(), v.contiguous()
            write_kv_fused(k, v, k_cache, v_cache, meta.slot_mapping.to(k.device))
        return self._attend(q, k_cache, v_cache, meta, scale)

    def forward_qkv_rope(self, qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor, k_cache,
                         v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention from the fused projection output ``qkv [T, (H + 2 Hkv) D]`` before rotary: one launch
        rotates the q/k heads and writes the rotated K and the V into the pool (``ops/triton_fused.py``), then
        the paged kernels attend; returns ``[T, H * D]``. A quantized pool takes the rotary launch and its own
        quantizing write."""
        T = qkv.shape[0]
        Hkv, D = k_cache.shape[0], k_cache.shape[2]
        q = qkv[:, : num_heads * D].view(T, num_heads, D)
        if isinstance(k_cache, QuantizedKV) or not qkv.is_contiguous():
            qkv = qkv.contiguous()
            rope_qkv_triton(qkv, num_heads + Hkv, cos.contiguous(), sin.contiguous())
            q, k, v = (qkv[:, a * D:b * D].view(T, b - a, D)
                       for a, b in ((0, num_heads), (num_heads, num_heads + Hkv), (num_heads + Hkv, num_heads + 2 * Hkv)))
            return self.forward(q, k, v, k_cache, v_cache, meta, scale).reshape(T, num_heads * D)
        rope_qkv_triton(qkv, num_heads + Hkv, cos.contiguous(), sin.contiguous(),
                        kv=(k_cache, v_cache, meta.slot_mapping.to(qkv.device), num_heads))
        return self._attend(q, k_cache, v_cache, meta, scale).reshape(T, num_heads * D)

    def _attend(self, q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of ``q [T, H, D]`` over the pool, whose K/V this step already wrote."""
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        H, D = q.shape[1], q.shape[2]
        Hkv = k_cache.shape[0]
        group = H // Hkv
        nd = meta.num_decodes
        # launch grids from host-side values only: in a decode graph these are the bucket's size and the
        # max_model_len bound (pagedllm.worker.cuda_graphs), so a captured grid fits every step it replays
        max_decode_len = max(meta.seq_lens_list[:nd], default=0)
        if 0 < nd <= SPLITK_MAX_SEQS and max_decode_len >= self.splitk_min_len:
            splitk_decode(q, k_cache, v_cache, out, meta.block_tables.to(q.device), meta.seq_lens.to(q.device), nd,
                          max_decode_len, meta.block_size, scale)
        elif nd > 0:
            bt = meta.block_tables.to(q.device)
            sl = meta.seq_lens.to(q.device)
            kd, vd, ks, vs, fmt = pool_args(k_cache, v_cache)
            _paged_decode_kernel[(nd, Hkv)](
                q, kd, vd, out, bt, sl, ks, vs,
                q.stride(0), q.stride(1), kd.stride(0), kd.stride(1),
                vd.stride(0), vd.stride(1), out.stride(0), out.stride(1), bt.stride(0),
                ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
                float(scale), meta.block_size,
                GROUP=group, GROUP_PAD=pad_pow2(group, 2), D=D, D_PAD=pad_pow2(D, 16),
                BLOCK_N=self.block_n, FORMAT=fmt,
            )
        if nd < meta.num_seqs:  # prefill chunks: varlen causal attention over the paged K/V
            paged_prefill(q, k_cache, v_cache, out, meta.block_tables.to(q.device), meta.query_start_loc.to(q.device),
                          meta.seq_lens.to(q.device), nd, meta.num_seqs - nd, meta.max_query_len, meta.block_size,
                          scale)
        return out
