"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Paged attention: writes the step's K/V into the pool, then attends through block tables.

    A backend may also offer ``forward_qkv(qkv [T, (H + 2 Hkv) D], num_heads, k_cache, v_cache, meta, scale)
    -> [T, H * D]``, the same from the fused projection's output in one call (models use it when present),
    or ``forward_qkv_rope(qkv, num_heads, cos, sin, k_cache, v_cache, meta, scale)``, which takes the output
    before rotary and rotates the q/k heads as it writes the pool (models without per-head q/k norms use it
    first).
    """

    name: str
    # True when a decode step reads every per-step value from the metadata's tensors (its lists only as the
    # batch's shape and upper bounds), so a captured decode step replays correctly (pagedllm.worker.cuda_graphs)
    graph_safe: bool

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build per-step structures (masks, index maps) once, before the layers run."""

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D] new keys of this step
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [Hkv, num_slots, D] this layer's pool
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        ...
