"""The batched LoRA delta of a mixed step: every token adds its own adapter's ``B A x`` (none for the base model).

On the CPU, fp32 activations go to the gathered C++ kernel (``ops/csrc/lora_bgmv.cpp``, Punica's BGMV): each token
reads only its own slot, one call per fused projection. Where it can't be built (or for other dtypes), two torch
paths, never a loop over tokens:

- masked (BGMV-like, decode steps: a few tokens per adapter): one "shrink" GEMM of the tokens against the A
  matrices of the step's first ``k`` slots (all targets of a fused projection at once), a one-hot mask that
  keeps each token's own slot, then one "expand" GEMM per target. ``k`` times the LoRA FLOPs, few ops.
- segmented (SGMV, prefill-heavy steps: many tokens per adapter): the adapter tokens gathered in slot order,
  one shrink and one expand per target for each adapter's run of rows, scattered back with one index add.
  Each token pays only its own adapter, at a few more ops per adapter.

Base-model tokens get nothing (an all-zero mask row, or no segment), so their output is exactly the base
model's. On CUDA the gathered Triton kernels (``lora/triton_bgmv.py``) do it per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm import ops
from pagedllm.lora.slots import GroupWeights, LoRASlots
from pagedllm.models.layers import linear

# the segmented path pays ~10 ops per adapter and group; it wins once each adapter brings this many tokens
# (A/B on the 2-core EPYC: at 16 it lost on 1-adapter decode steps, at 64 it won 8-adapter prefills)
SEGMENT_MIN_TOKENS = 64


@dataclass
class LoRAStep:
    """One step's adapter use: ``slot_of_token [T]`` (-1: base), the one-hot ``mask [T, k, 1, 1]`` over the
    ``k`` leading slots the step uses, and the slots' weights; for a segmented step ``order`` (the adapter
    tokens sorted by slot) and ``runs`` ``(slot, start, end)`` into it."""

    slots: LoRASlots
    slot_of_token: torch.Tensor
    mask: torch.Tensor | None
    k: int
    order: torch.Tensor | None = None
    runs: list[tuple[int, int, int]] | None = None
    gathered: bool = False  # the C++ kernel (``slot_of_token`` stays on the host)

    @classmethod
    def build(cls, slots: LoRASlots, slot_of_token: torch.Tensor, dtype: torch.dtype,
              min_segment: int | None = None, gathered: bool | None = None) -> "LoRAStep | None":
        """None when no token uses an adapter (the step runs the base model's path untouched). ``slot_of_token``
        is on the host (read here without a device sync); the step's tensors go to the slots' device. Segmented
        when the adapter tokens average ``min_segment`` (default ``SEGMENT_MIN_TOKENS``) per adapter (never on
        CUDA: its kernels gather). ``gathered`` (default: fp32 CPU steps) picks the C++ kernel where it is built;
        False keeps the torch paths (tests compare them)."""
        if slot_of_token.numel() == 0 or int(slot_of_token.max()) < 0:
            return None
        k = int(slot_of_token.max()) + 1
        min_segment = SEGMENT_MIN_TOKENS if min_segment is None else min_segment
        dev = slots.layers[0]["o"].a.device
        if gathered is None:
            gathered = dev.type == "cpu" and dtype == torch.float32
        if gathered and ops.load("lora_bgmv"):
            return cls(slots, slot_of_token.contiguous(), None, k, gathered=True)
        counts = torch.bincount(slot_of_token + 1, minlength=k + 1)[1:]
        used = int((counts > 0).sum())
        if dev.type == "cpu" and int(counts.sum()) >= min_segment * used:
            order = torch.argsort(slot_of_token, stable=True)[int((slot_of_token < 0).sum()):]
            ends = torch.cumsum(counts, 0).tolist()
            runs = [(s, e - n, e) for s, (n, e) in enumerate(zip(counts.tolist(), ends)) if n]
            return cls(slots, slot_of_token, None, k, order, runs)
        mask = torch.nn.functional.one_hot(slot_of_token + 1, k + 1)[:, 1:].to(dtype)
        return cls(slots, slot_of_token.to(dev), mask[:, :, None, None].to(dev), k)

    def add_(self, layer: int, group: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """``y[:, target columns] += B_slot A_slot x`` per token for every target of ``group`` (in place)."""
        w = self.slots.layers[layer][group]
        if y.is_cuda and x.is_cuda:
            from pagedllm.lora.triton_bgmv import bgmv_add_

            bgmv_add_(y, x, w, self.slot_of_token)
            return
        if self.gathered:
            los = [lo for lo, _ in w.bounds]
            torch.ops.pagedllm.lora_bgmv.default(y, x.contiguous(), w.a, w.b, los, self.slot_of_token)
            return
        if self.runs is not None:
            add_segmented_(y, x, w, self.order, self.runs)
            return
        add_masked_(y, x, w, self.mask, self.k)


def add_masked_(y: torch.Tensor, x: torch.Tensor, w: GroupWeights, mask: torch.Tensor, k: int) -> None:
    """The masked path: shrink against ``k`` slots, keep each token's slot, expand per target."""
    T = x.shape[0]
    n, R = len(w.b), w.a.shape[2]
    s = linear(x, w.a[:k].view(k * n * R, -1)).view(T, k, n, R).mul_(mask)  # [T, k, targets, R]
    for t, (b, (lo, hi)) in enumerate(zip(w.b, w.bounds)):
        y[:, lo:hi].addmm_(s[:, :, t].reshape(T, k * R), b[:k].view(k * R, -1))


def add_segmented_(y: torch.Tensor, x: torch.Tensor, w: GroupWeights, order: torch.Tensor,
                   runs: list[tuple[int, int, int]]) -> None:
    """The segmented path: each adapter's rows (a run of ``order``) against that adapter's A and B alone."""
    n, R = len(w.b), w.a.shape[2]
    xs = x.index_select(0, order)
    d = torch.empty(len(order), y.shape[1], dtype=y.dtype, device=y.device)
    for slot, start, end in runs:
        s = linear(xs[start:end], w.a[slot].view(n * R, -1))  # [rows, targets * R]
        for t, (b, (lo, hi)) in enumerate(zip(w.b, w.bounds)):
            torch.mm(s[:, t * R:(t + 1) * R], b[slot], out=d[start:end, lo:hi])
    y.index_add_(0, order, d)
