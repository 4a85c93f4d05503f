"""Per-step attention inputs shared by every backend.

The KV pool of one layer is two tensors ``k_cache, v_cache`` of shape
``[num_kv_heads, num_blocks * block_size, head_dim]``: a physical slot
``block * block_size + offset`` is a row index, so a block of one head is a
contiguous ``[block_size, head_dim]`` tile and the whole pool is one long
"sequence" that FlexAttention can read in place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.kv.kv_quant import QuantizedKV, write_kv_quantized


@dataclass
class AttentionMetadata:
    """A flat batch of query tokens from many sequences (decodes first, then prefill chunks)."""

    positions: torch.Tensor  # [T] int64, logical position of each query token
    slot_mapping: torch.Tensor  # [T] int64, physical slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    block_size: int
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    query_lens_list: list[int]
    seq_lens_list: list[int]
    extra: dict[str, Any] = field(default_factory=dict)  # what a backend's prepare() builds once per step

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_list, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> "AttentionMetadata":
        """Build every tensor for a batch from per-sequence lists, with batched tensor ops.

        ``seq_lens[i]`` counts the cached tokens plus the ``query_lens[i]`` new ones; the new
        tokens are the last ``query_lens[i]`` positions of the sequence.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        q = torch.tensor(query_lens, dtype=torch.int64)
        s = torch.tensor(seq_lens, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q)
        starts = torch.cumsum(q, 0) - q
        offset_in_query = torch.arange(int(q.sum())) - starts[seq_of_token]
        positions = (s - q)[seq_of_token] + offset_in_query
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.zeros((len(block_tables), max(width, 1)), dtype=torch.int32)
        for i, t in enumerate(block_tables):  # one row copy per sequence, not per token
            tables[i, : len(t)] = torch.as_tensor(t, dtype=torch.int32)
        return cls.from_tensors(positions, seq_of_token, q, s, tables, block_size)

    @classmethod
    def from_tensors(
        cls,
        positions: torch.Tensor,
        seq_of_token: torch.Tensor,
        query_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
    ) -> "AttentionMetadata":
        """The metadata from tensors a persistent batch already holds (int64 ``positions``,
        ``seq_of_token``, ``query_lens``, ``seq_lens``; int32 ``block_tables [B, width]``)."""
        blocks = block_tables.long()[seq_of_token, positions // block_size]
        slot_mapping = blocks * block_size + positions % block_size
        query_lens_list = query_lens.tolist()
        num_decodes = 0
        for n in query_lens_list:
            if n != 1:
                break
            num_decodes += 1
        qsl = query_lens.new_zeros(len(query_lens_list) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(query_lens, 0)
        return cls(
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=qsl,
            seq_lens=seq_lens.to(torch.int32),
            block_tables=block_tables,
            block_size=block_size,
            num_decodes=num_decodes,
            query_lens_list=query_lens_list,
            seq_lens_list=seq_lens.tolist(),
        )

    def to(self, device: torch.device) -> "AttentionMetadata":
        """The same metadata with its tensors on ``device`` (lists stay on the host)."""
        moved = {f: getattr(self, f).to(device, non_blocking=True)
                 for f in ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")}
        return dataclasses.replace(self, **moved)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V ``[T, Hkv, D]`` into the pool rows named by ``slot_mapping`` (quantizing them when the
    pool is a :class:`~pagedllm.kv.kv_quant.QuantizedKV`)."""
    if isinstance(k_cache, QuantizedKV):
        write_kv_quantized(k, v, k_cache, v_cache, slot_mapping)
        return
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
