"""CPU backend: a C++ paged-attention kernel reading K/V in place through the block tables.

The kernel (``pagedllm/ops/csrc/paged_attention.cpp``, ops ``torch.ops.pagedllm.write_kv / attend_qkv /
paged_attention_out``) is built at set-up or on first use (:mod:`pagedllm.ops.build`). Work is split over
(sequence, query tile, kv head) with OpenMP, and decodes over long contexts also over parts of the context
(split-K, combined in the kernel; the parts depend on the sequence alone, so its output does not change with the
batch or the thread count); the ``group`` query heads of a kv head are computed together so each K/V row is read
once; softmax is online with fp32 accumulation; caches may be fp32 or bf16, or int8 / fp8
(:class:`~pagedllm.kv.kv_quant.QuantizedKV`: the kernel quantizes the rows it writes and dequantizes the
rows it reads, chunk by chunk in L1; the pool is never dequantized into a copy).

Decodes always go through the kernel. Prefill chunks go through it too unless the chunk is
long enough that torch's CPU flash SDPA over a gathered context is faster
(``sdpa_prefill_min_len``; measured in ``pagedllm/bench/attention.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import causal_mask, gather_sequence_kv
from pagedllm.kv.kv_quant import QuantizedKV


def load_kernel() -> None:
    """Build (first time, ~1 min) or load the cached C++ kernel's ops; RuntimeError if it cannot be built."""
    try:
        ops.require("paged_attention")
    except RuntimeError as e:
        raise RuntimeError(f"the 'cpu' attention backend is unavailable: {e}. Install a C++ compiler or choose "
                           "the 'reference' or 'flex' backend.") from e


def kernel_args(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The kernel's (k_cache, v_cache, scale keyword arguments) for a float or quantized pool."""
    if isinstance(k_cache, QuantizedKV):
        return k_cache.data, v_cache.data, {"k_scale": k_cache.scale, "v_scale": v_cache.scale}
    return k_cache, v_cache, {}


class CpuBackend:
    name = "cpu"
    graph_safe = True  # decode reads only the metadata's tensors

    def __init__(self, q_tile: int = 16, sdpa_prefill_min_len: int | None = None) -> None:
        self.q_tile = q_tile
        # prefill chunks with at least this many queries use gather + flash SDPA (None: never)
        self.sdpa_prefill_min_len = sdpa_prefill_min_len
        load_kernel()

    def prepare(self, meta: AttentionMetadata) -> None:
        return None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kd, vd, scales = kernel_args(k_cache, v_cache)
        torch.ops.pagedllm.write_kv.default(k, v, kd, vd, meta.slot_mapping, block_size=meta.block_size, **scales)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        n = meta.num_seqs
        split = n
        if self.sdpa_prefill_min_len is not None:
            # sequences from `split` on are prefill chunks long enough for SDPA
            split = meta.num_decodes
            while split < n and meta.query_lens_list[split] < self.sdpa_prefill_min_len:
                split += 1
        if split > 0:
            self._kernel(q, k_cache, v_cache, out, meta, scale, 0, split)
        if split < n:
            self._sdpa_chunks(q, k_cache, v_cache, out, meta, scale, split)
        return out

    def forward_qkv(self, qkv: torch.Tensor, num_heads: int, k_cache, v_cache, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
        """Attention straight from the fused projection output ``qkv [T, (H + 2 Hkv) D]`` (rope applied):
        one C++ call (write K/V, attend) returning ``[T, H * D]``; at batch 1 the views and separate calls
        of :meth:`forward` cost as much as the attention. Long prefill chunks for SDPA take that path."""
        if self.sdpa_prefill_min_len is not None or qkv.dim() != 2 or qkv.stride(1) != 1:
            T, D = qkv.shape[0], k_cache.shape[2]
            Hkv = k_cache.shape[0]
            q = qkv[:, : num_heads * D].view(T, num_heads, D)
            k = qkv[:, num_heads * D : (num_heads + Hkv) * D].view(T, Hkv, D)
            v = qkv[:, (num_heads + Hkv) * D :].view(T, Hkv, D)
            return self.forward(q, k, v, k_cache, v_cache, meta, scale).reshape(T, num_heads * D)
        kd, vd, scales = kernel_args(k_cache, v_cache)
        return torch.ops.pagedllm.attend_qkv.default(qkv, num_heads, kd, vd, meta.slot_mapping, meta.block_tables,
                                             meta.seq_lens, meta.query_start_loc, meta.block_size, float(scale),
                                             self.q_tile, **scales)

    def _sdpa_chunks(self, q, k_cache, v_cache, out, meta, scale, first) -> None:
        group = q.shape[1] // k_cache.shape[0]
        starts = meta.query_start_loc.tolist()
        for i in range(first, meta.num_seqs):
            q_len, s_len = meta.query_lens_list[i], meta.seq_lens_list[i]
            if q_len < (self.sdpa_prefill_min_len or 0):
                self._kernel(q, k_cache, v_cache, out, meta, scale, i, i + 1)
                continue
            ki = gather_sequence_kv(k_cache, meta.block_tables[i], s_len, meta.block_size, q.dtype)
            vi = gather_sequence_kv(v_cache, meta.block_tables[i], s_len, meta.block_size, q.dtype)
            qi = q[starts[i] : starts[i] + q_len].transpose(0, 1)
            if q_len == s_len:
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=group > 1)
            else:
                mask = causal_mask(q_len, s_len, q.device)
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=group > 1)
            out[starts[i] : starts[i] + q_len] = oi.transpose(0, 1)

    def _kernel(self, q, k_cache, v_cache, out, meta, scale, b, e) -> None:
        """The C++ kernel over sequences ``[b, e)`` of the batch."""
        kd, vd, scales = kernel_args(k_cache, v_cache)
        torch.ops.pagedllm.paged_attention_out.default(
            out, q, kd, vd, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.block_size, float(scale), b, e, self.q_tile, **scales,
        )
