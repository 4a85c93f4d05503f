"""CPU backend: a C++ paged-attention kernel reading K/V in place through the block tables.

The kernel (``csrc/paged_attention.cpp``) is built on first use with
``torch.utils.cpp_extension.load`` (``-O3 -march=native -fopenmp``) and cached under
``~/.cache/torch_extensions``. Work is split over (sequence, query tile, kv head) with OpenMP;
the ``group`` query heads of a kv head are computed together so each K/V row is read once;
softmax is online with fp32 accumulation; caches may be fp32 or bf16.

Decodes always go through the kernel. Prefill chunks go through it too unless the chunk is
long enough that torch's CPU flash SDPA over a gathered context is faster
(``sdpa_prefill_min_len``; measured in ``pagedllm/bench/attention.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm import native
from pagedllm.attention.metadata import AttentionMetadata

_SRC = Path(__file__).with_name("csrc") / "paged_attention.cpp"


def load_extension():
    """Build (first time, ~1 min) or load the cached C++ kernel; RuntimeError if it cannot be built."""
    try:
        return native.load_extension("pagedllm_paged_attention", _SRC)
    except RuntimeError as e:
        raise RuntimeError(f"the 'cpu' attention backend is unavailable: {e}. Install a C++ compiler or choose "
                           "the 'reference' or 'flex' backend.") from e


def _gather_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    n_blocks = (seq_len + block_size - 1) // block_size
    return (block_table[:n_blocks].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]


class CpuBackend:
    name = "cpu"

    def __init__(self, q_tile: int = 16, sdpa_prefill_min_len: int | None = None) -> None:
        self.q_tile = q_tile
        # prefill chunks with at least this many queries use gather + flash SDPA (None: never)
        self.sdpa_prefill_min_len = sdpa_prefill_min_len
        load_extension()

    def prepare(self, meta: AttentionMetadata) -> None:
        return None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ext = load_extension()
        ext.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype)
        n = meta.num_seqs
        split = n
        if self.sdpa_prefill_min_len is not None:
            # sequences from `split` on are prefill chunks long enough for SDPA
            split = meta.num_decodes
            while split < n and meta.query_lens_list[split] < self.sdpa_prefill_min_len:
                split += 1
        if split > 0:
            ext.paged_attention_out(
                out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.block_size, float(scale), 0, split, self.q_tile,
            )
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
        return load_extension().attend_qkv(qkv, num_heads, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                                           meta.seq_lens, meta.query_start_loc, meta.block_size, float(scale),
                                           self.q_tile)

    def _sdpa_chunks(self, q, k_cache, v_cache, out, meta, scale, first) -> None:
        group = q.shape[1] // k_cache.shape[0]
        starts = meta.query_start_loc.tolist()
        for i in range(first, meta.num_seqs):
            q_len, s_len = meta.query_lens_list[i], meta.seq_lens_list[i]
            if q_len < (self.sdpa_prefill_min_len or 0):
                meta_i_end = i + 1
                self._kernel_one(q, k_cache, v_cache, out, meta, scale, i, meta_i_end)
                continue
            slots = _gather_slots(meta.block_tables[i], s_len, meta.block_size)
            ki = k_cache.index_select(1, slots).to(q.dtype)
            vi = v_cache.index_select(1, slots).to(q.dtype)
            qi = q[starts[i] : starts[i] + q_len].transpose(0, 1)
            if q_len == s_len:
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=group > 1)
            else:
                mask = torch.arange(s_len)[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=group > 1)
            out[starts[i] : starts[i] + q_len] = oi.transpose(0, 1)

    def _kernel_one(self, q, k_cache, v_cache, out, meta, scale, b, e) -> None:
        load_extension().paged_attention_out(
            out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.block_size, float(scale), b, e, self.q_tile,
        )
