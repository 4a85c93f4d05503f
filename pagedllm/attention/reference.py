"""Reference backend: gather each sequence's K/V through its block table, then SDPA.

Slow (a dense copy per sequence and a Python loop) but obviously right: the oracle
the fast backends are tested against. A quantized pool's gathered rows are dequantized (code * scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata, write_kv
from pagedllm.kv.kv_quant import read_rows


def sequence_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Physical slots of logical positions ``0 .. seq_len - 1`` through one block table row."""
    n_blocks = (seq_len + block_size - 1) // block_size
    in_block = torch.arange(block_size, device=block_table.device)
    return (block_table[:n_blocks].long()[:, None] * block_size + in_block).flatten()[:seq_len]


def gather_sequence_kv(cache, block_table: torch.Tensor, seq_len: int, block_size: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[Hkv, seq_len, D]`` copy of one sequence's cached K or V in ``dtype`` (dequantized)."""
    return read_rows(cache, sequence_slots(block_table, seq_len, block_size), dtype)


def causal_mask(q_len: int, s_len: int, device: torch.device) -> torch.Tensor:
    """``[q_len, s_len]``: query j sits at position ``s_len - q_len + j`` and sees keys 0..that position."""
    q_pos = torch.arange(s_len - q_len, s_len, device=device)[:, None]
    return torch.arange(s_len, device=device)[None, :] <= q_pos


class ReferenceBackend:
    name = "reference"
    graph_safe = False  # gathers each sequence's context by its host-side length

    def prepare(self, meta: AttentionMetadata) -> None:
        return None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[0]
        starts = meta.query_start_loc.tolist()
        for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            qi = q[starts[i] : starts[i] + q_len].transpose(0, 1)  # [H, q_len, D]
            ki = gather_sequence_kv(k_cache, meta.block_tables[i], s_len, meta.block_size, q.dtype)
            vi = gather_sequence_kv(v_cache, meta.block_tables[i], s_len, meta.block_size, q.dtype)
            ki = ki.repeat_interleave(group, dim=0)
            vi = vi.repeat_interleave(group, dim=0)
            mask = causal_mask(q_len, s_len, q.device)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[starts[i] : starts[i] + q_len] = oi.transpose(0, 1)
        return out
