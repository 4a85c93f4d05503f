"""Resident adapters' weights stacked in ``max_loras`` slots, per decoder layer and per fused projection.

The model fuses q/k/v into one matmul and gate/up into another, so adapters are grouped the same way:
a group's A matrices of every slot form one ``[slots, targets, R, in]`` tensor (one "shrink" GEMM for all
of them), and each target's B is ``[slots, R, out]``. Ranks below ``R`` (``max_lora_rank``) are zero-padded;
a target an adapter does not train stays zero. Slot-major storage lets a step use only the first ``k``
slots as one contiguous slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.lora.adapter import GROUPS, LoRAAdapter, LoRAShapes
from pagedllm.lora.pages import pack, unpack


@dataclass
class GroupWeights:
    a: torch.Tensor  # [slots, targets, R, in]
    b: list[torch.Tensor]  # per target [slots, R, out_t]
    bounds: list[tuple[int, int]]  # per target: its columns [start, end) of the fused projection's output


class LoRASlots:
    """``slots`` adapters of rank <= ``max_rank`` in float32 (or ``dtype``) tensors on ``device``."""

    def __init__(self, shapes: LoRAShapes, slots: int, max_rank: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if slots < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {slots} and {max_rank}")
        self.shapes, self.num_slots, self.max_rank = shapes, slots, max_rank
        self.layers: list[dict[str, GroupWeights]] = []
        for _ in range(shapes.num_layers):
            groups = {}
            for g, targets in GROUPS.items():
                in_dim = shapes.shapes[targets[0]][1]
                outs = [shapes.shapes[t][0] for t in targets]
                starts = [sum(outs[:j]) for j in range(len(outs))]
                groups[g] = GroupWeights(
                    torch.zeros(slots, len(targets), max_rank, in_dim, dtype=dtype, device=device),
                    [torch.zeros(slots, max_rank, o, dtype=dtype, device=device) for o in outs],
                    [(s, s + o) for s, o in zip(starts, outs)])
            self.layers.append(groups)

    @property
    def num_bytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + sum(b.numel() * b.element_size() for b in w.b)
                   for groups in self.layers for w in groups.values())

    @staticmethod
    def bytes_for(shapes: LoRAShapes, slots: int, max_rank: int, dtype: torch.dtype = torch.float32) -> int:
        """What ``LoRASlots(shapes, slots, max_rank, dtype)`` occupies (taken from the KV cache budget)."""
        per_rank = sum(i + o for o, i in shapes.shapes.values())
        return shapes.num_layers * slots * max_rank * per_rank * torch.finfo(dtype).bits // 8

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (zeros where it trains nothing)."""
        self.write_packed(slot, pack(adapter, self.shapes), adapter.rank)

    def write_packed(self, slot: int, flat: torch.Tensor, rank: int) -> None:
        """Copy an adapter packed by ``lora.pages.pack`` (read back from its pages) into ``slot``."""
        if rank > self.max_rank:
            raise ValueError(f"adapter rank {rank} is above max_lora_rank {self.max_rank}")
        for groups, packed in zip(self.layers, unpack(flat, self.shapes, rank)):
            for g, (a, bs) in packed.items():
                w = groups[g]
                w.a[slot, :, :rank].copy_(a)
                w.a[slot, :, rank:].zero_()
                for b_slot, b in zip(w.b, bs):
                    b_slot[slot, :rank].copy_(b)
                    b_slot[slot, rank:].zero_()
