"""One tensor-parallel rank's part of every adapter, cut like the base weights it adds to (Megatron style).

- Column-parallel projections (qkv, gate_up) keep A whole (every rank sees the whole input) and B's output
  rows of the rank's base shard: q, k and v each by the rank's heads, gate and up each by its features.
- Row-parallel projections (o, down) keep A's input columns of the rank's heads / features and B whole: the
  rank's delta is a partial sum, added to the base's partial output before the layer's all-reduce sums them.

The rank never needs to divide: only A's inputs and B's outputs are cut. Every rank's shard has the same
size, so the core counts one rank's pages (``shapes``) and the page ids are the same everywhere; the core
packs the whole adapter and each worker cuts its shard from it (``take``) before writing its own pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.lora.adapter import GROUPS, LoRAShapes
from pagedllm.lora.pages import packed_numel, unpack


@dataclass(frozen=True)
class AdapterShard:
    """``full``: the model's shapes; ``shapes``: the rank's; ``outputs[t]`` / ``inputs[t]``: the ranges of
    target ``t``'s output rows / input columns the rank keeps."""

    full: LoRAShapes
    shapes: LoRAShapes
    outputs: dict[str, range]
    inputs: dict[str, range]

    @classmethod
    def of(cls, full: LoRAShapes, plan, head_dim: int) -> AdapterShard:
        """The shard of ``plan`` (a ``models.sharding.ShardPlan``: the rank's q heads, KV heads and features)."""
        q = range(plan.q_heads.start * head_dim, plan.q_heads.stop * head_dim)
        kv = range(plan.kv_heads.start * head_dim, plan.kv_heads.stop * head_dim)
        outputs = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": plan.inter, "up_proj": plan.inter}
        inputs = {"o_proj": q, "down_proj": plan.inter}
        outputs |= {t: range(full.shapes[t][0]) for t in inputs}
        inputs |= {t: range(full.shapes[t][1]) for t in outputs if t not in inputs}
        shapes = LoRAShapes(full.num_layers, {t: (len(outputs[t]), len(inputs[t])) for t in full.shapes})
        return cls(full, shapes, outputs, inputs)

    def take(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """The rank's shard of an adapter of rank ``rank`` packed whole (``lora.pages.pack``), packed the same way."""
        parts = []
        for groups in unpack(flat, self.full, rank):
            for g, targets in GROUPS.items():
                a, bs = groups[g]
                cols = self.inputs[targets[0]]  # a group's targets share their input
                parts.append(a[:, :, cols.start:cols.stop].reshape(-1))
                for t, b in zip(targets, bs):
                    rows = self.outputs[t]
                    parts.append(b[:, rows.start:rows.stop].reshape(-1))
        out = torch.cat(parts)
        assert out.numel() == packed_numel(self.shapes, rank)
        return out
