"""The worker's side of the KV tiers' block copies when it runs in its own process (``mp``, tensor
parallelism): the core sends a ``BlockCopy`` between steps on the step pipe, the worker copies its own
pool's blocks (its rank's kv heads) out or in and answers. Which hash is in which tier is the core's
business (its KV manager); a worker only moves bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pagedllm.kv.kv_cache import KVCache


@dataclass
class BlockCopy:
    """``layout``: the pool's shape; ``gather``: ``block_ids``' K/V as CPU tensors; ``scatter``: write
    ``data`` (this rank's heads of ``gather``'s layout) into ``block_ids``."""

    op: Literal["layout", "gather", "scatter"]
    block_ids: list[int] | None = None
    data: dict[str, torch.Tensor] | None = None

    def apply(self, kv: KVCache) -> dict | None:
        if self.op == "layout":
            return {"num_layers": kv.num_layers, "num_kv_heads": kv.num_kv_heads, "head_dim": kv.head_dim,
                    "num_blocks": kv.num_blocks, "block_size": kv.block_size, "dtype": kv.dtype}
        if self.op == "gather":
            return kv.export_blocks(list(self.block_ids or []))
        if self.op == "scatter" and self.data is not None:
            kv.import_blocks(list(self.block_ids or []), self.data)
            return None
        raise ValueError(f"op: not a block copy: {self.op!r}")
