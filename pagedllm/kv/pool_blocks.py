"""What the KV tiers need of the pool: its layout, and block copies out of it and into it.

``KVCache`` is one (the worker in the core's process); ``executor/tier_copies.RankBlocks`` is the other,
for workers in other processes (``mp``, tensor parallelism): it asks every rank to copy its own shard.
The KV manager stays the one owner of which hash lives in which tier; a ``PoolBlocks`` only moves bytes.
"""

from __future__ import annotations

from typing import Protocol

import torch


class PoolBlocks(Protocol):
    num_layers: int
    num_kv_heads: int  # every rank's heads together
    head_dim: int
    num_blocks: int
    block_size: int
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        """Where ``gather_blocks`` leaves its tensors (the tiers copy them to host memory off the step)."""

    def gather_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """``kv`` ``[L, 2, Hkv, n, block_size, D]`` (and quantized pools' ``scales``) of ``block_ids``."""

    def import_blocks(self, block_ids: list[int], data: dict[str, torch.Tensor]) -> None:
        """Write ``gather_blocks``-shaped ``data`` into ``block_ids``."""
