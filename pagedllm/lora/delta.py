"""The batched LoRA delta of a mixed step: every token adds its own adapter's ``B A x`` (none for the base model).

BGMV/SGMV-like without a loop over adapters or tokens: one "shrink" GEMM of the tokens against the A
matrices of the step's first ``k`` slots (all targets of a fused projection at once), a one-hot mask that
keeps each token's own slot, then one "expand" GEMM per target adding into the projection's output columns.
Base-model tokens get an all-zero mask row, so their output is exactly the base model's. On CUDA the
gathered Triton kernel (``lora/triton_bgmv.py``) does the same per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.lora.slots import GroupWeights, LoRASlots
from pagedllm.models.layers import linear


@dataclass
class LoRAStep:
    """One step's adapter use: ``slot_of_token [T]`` (-1: base), the one-hot ``mask [T, k, 1, 1]`` over the
    ``k`` leading slots the step uses, and the slots' weights."""

    slots: LoRASlots
    slot_of_token: torch.Tensor
    mask: torch.Tensor
    k: int

    @classmethod
    def build(cls, slots: LoRASlots, slot_of_token: torch.Tensor, dtype: torch.dtype) -> "LoRAStep | None":
        """None when no token uses an adapter (the step runs the base model's path untouched). ``slot_of_token``
        is on the host (read here without a device sync); the step's tensors go to the slots' device."""
        if slot_of_token.numel() == 0 or int(slot_of_token.max()) < 0:
            return None
        k = int(slot_of_token.max()) + 1
        mask = torch.nn.functional.one_hot(slot_of_token + 1, k + 1)[:, 1:].to(dtype)
        dev = slots.layers[0]["o"].a.device
        return cls(slots, slot_of_token.to(dev), mask[:, :, None, None].to(dev), k)

    def add_(self, layer: int, group: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """``y[:, target columns] += B_slot A_slot x`` per token for every target of ``group`` (in place)."""
        w = self.slots.layers[layer][group]
        if y.is_cuda and x.is_cuda:
            from pagedllm.lora.triton_bgmv import bgmv_add_

            bgmv_add_(y, x, w, self.slot_of_token)
            return
        add_masked_(y, x, w, self.mask, self.k)


def add_masked_(y: torch.Tensor, x: torch.Tensor, w: GroupWeights, mask: torch.Tensor, k: int) -> None:
    """The torch path: shrink against ``k`` slots, keep each token's slot, expand per target."""
    T = x.shape[0]
    n, R = len(w.b), w.a.shape[2]
    s = linear(x, w.a[:k].view(k * n * R, -1)).view(T, k, n, R).mul_(mask)  # [T, k, targets, R]
    for t, (b, (lo, hi)) in enumerate(zip(w.b, w.bounds)):
        y[:, lo:hi].addmm_(s[:, :, t].reshape(T, k * R), b[:k].view(k * R, -1))
