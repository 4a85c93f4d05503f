"""The pool's blocks for the KV tiers when the workers run in other processes (``mp``, tensor parallelism).

Choice: the core asks each rank to save or load its shard, and the tiers (L2 in the core's RAM, L3 files)
hold whole blocks, every rank's kv heads concatenated in rank order. Why not a tier slice per rank: the KV
manager already owns which hash is in which tier, with one policy, one set of counters and one checksummed
file per block; per-rank tiers would need that bookkeeping kept identical in N processes (a rank whose L2
evicted a different block, or whose file was corrupt, would leave a prefix half-present), and a restart would
have to find N files that agree. Here a block is in a tier or not, for all ranks at once. The price is the
bytes crossing the step pipe; the copies are batched (one gather per schedule for every evicted block, one
scatter per promoted run), happen between steps when the workers are idle, and the serialising and disk
writes run on the tier threads, not on the step.
"""

from __future__ import annotations

import torch

from pagedllm.worker.tier_copy import BlockCopy


class RankBlocks:
    """``kv.pool_blocks.PoolBlocks`` over an executor's ``num_ranks`` ranks (its ``copy_blocks`` takes one
    message per rank and returns each rank's answer)."""

    device = torch.device("cpu")  # the workers answer with CPU tensors

    def __init__(self, executor, num_ranks: int) -> None:
        self._executor = executor
        self._ranks = num_ranks
        layouts = executor.copy_blocks([BlockCopy("layout")] * self._ranks)
        if any(lay != layouts[0] for lay in layouts):
            raise ValueError(f"tensor_parallel_size: the ranks' KV pools differ: {layouts}")
        lay = layouts[0]
        self.num_layers, self.head_dim, self.block_size = lay["num_layers"], lay["head_dim"], lay["block_size"]
        self.rank_heads = lay["num_kv_heads"]
        self.num_kv_heads = self.rank_heads * self._ranks
        self.num_blocks = executor.spec.num_blocks  # a CUDA graphs' scratch block is not the manager's
        self.dtype = lay["dtype"]

    def gather_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        parts = self._executor.copy_blocks([BlockCopy("gather", list(block_ids))] * self._ranks)
        if self._ranks == 1:
            return parts[0]
        return {k: torch.cat([p[k] for p in parts], dim=2) for k in parts[0]}

    def import_blocks(self, block_ids: list[int], data: dict[str, torch.Tensor]) -> None:
        kv = data.get("kv")
        if kv is None or kv.dim() != 6 or kv.shape[2] != self.num_kv_heads:
            raise ValueError(f"kv: expected {self.num_kv_heads} kv heads in dim 2 of [L, 2, Hkv, n, block_size, D]")
        h = self.rank_heads
        msgs = [BlockCopy("scatter", list(block_ids), data if self._ranks == 1 else
                          {k: t.narrow(2, r * h, h).clone() for k, t in data.items()}) for r in range(self._ranks)]
        self._executor.copy_blocks(msgs)
