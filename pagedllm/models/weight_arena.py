"""A CPU model's weight matrices copied side by side into one buffer, which the kernel backs with 2 MB pages.

torch asks for transparent huge pages only for allocations of 2 MB or more (``THP_MEM_ALLOC_ENABLE``, which
``pagedllm/cpu_env.py`` sets), and most of a small model's matrices are smaller than that: SmolLM2-135M's GGUF
blocks are 0.2-1.1 MB a matrix, its packed bf16 copies 0.7-3.5 MB. A batch-1 token reads all 96 MB of blocks,
~24,000 pages of 4 KB against an L2 TLB of a few thousand entries; in one buffer they sit on 2 MB pages. Measured
on a Zen 4 (2 cores; `pagedllm bench batch1 --rounds 4`, twice each way, alternating): exact 6.91 / 7.41 ms a
token against 7.83 / 9.43 as loaded, gguf-a8 5.37 / 5.26 against 5.67 / 5.71 (llama.cpp 8.7-9.3 in all four
runs). W1 (bf16 copies at 16-1,024 rows, bound by arithmetic) even: `bench compare` 0.994 over 3 rounds.
oneDNN's prepacked copies (prefill GEMMs of more than 1,024 rows) are opaque tensors and stay where they are.
``PAGEDLLM_WEIGHT_ARENA=0`` keeps them as loaded (A/B benchmarks).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from pagedllm.config.host_memory import trim_heap
from pagedllm.models.bf16_gemm import PackedBF16
from pagedllm.models.quant import QuantizedWeight

ENABLED = os.environ.get("PAGEDLLM_WEIGHT_ARENA") != "0"
# each tensor starts on a cache line, as torch's own allocations do (the kernels' aligned loads rely on no more)
ALIGN = 64


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU ``tensors``, each a view of the same dtype and shape into one new buffer."""
    for t in tensors:
        if not (t.is_contiguous() and t.device.type == "cpu"):
            raise ValueError(f"weight_arena.gather takes contiguous CPU tensors, got {t.device} strides {t.stride()}")
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8)
    out, offset = [], 0
    for t, size in zip(tensors, sizes):
        view = buffer[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += size
    return out


def streamed_tensors(w: object) -> list[torch.Tensor]:
    """The tensors of a matrix that the CPU kernels read: GGUF blocks (or gguf-a8's packing) and packed bf16 copies."""
    if isinstance(w, QuantizedWeight):
        return [w.data, *streamed_tensors(w.bf16)]
    if isinstance(w, PackedBF16) and w.amx is not None:
        return [w.amx]
    return []


def _rebuilt(w: object, moved: dict[int, torch.Tensor]) -> object:
    """``w`` over the moved copies of its tensors (``moved``: id of a tensor -> its copy)."""
    if isinstance(w, QuantizedWeight):
        return dataclasses.replace(w, data=moved[id(w.data)], bf16=w.bf16 and _rebuilt(w.bf16, moved))
    # a bf16 copy that was not packed for our kernel (its plain tensor; oneDNN's own packing) did not move
    if w.amx is None:
        return w
    # its blocks are its QuantizedWeight's data, moved with it
    return dataclasses.replace(w, amx=moved[id(w.amx)], blocks=w.blocks if w.blocks is None else moved[id(w.blocks)])


def gather_matrices(slots: list[tuple[nn.Module, str]]) -> int:
    """Move the block matrices and packed copies held at ``module.attr`` for each slot into one buffer. A tensor held
    twice (a tied LM head's blocks, which the embedding reads too) moves once and stays shared. Returns the bytes
    moved."""
    if not ENABLED:
        return 0
    nbytes = _move(slots)
    # the old copies went with _move's frame. They were mostly under glibc's mmap threshold, so their pages stayed in
    # the heap: an engine on SmolLM2 in gguf-bf16 held 1,384 MB of RSS untrimmed, 1,128 trimmed, 1,170 as loaded (its
    # peak, both copies at once, 1,981 against 1,692)
    if nbytes:
        trim_heap()
    return nbytes


def _move(slots: list[tuple[nn.Module, str]]) -> int:
    """:func:`gather_matrices`' copy and swap; the old copies are unreferenced once it returns."""
    held = [(module, attr, getattr(module, attr)) for module, attr in slots]
    tensors = {id(t): t for _, _, w in held for t in streamed_tensors(w)}
    if not tensors or any(t.device.type != "cpu" for t in tensors.values()):
        return 0
    moved = dict(zip(tensors, gather(list(tensors.values()))))
    rebuilt: dict[int, object] = {}  # a matrix held at two slots (a tied head) stays one object
    for module, attr, w in held:
        if streamed_tensors(w):
            setattr(module, attr, rebuilt.setdefault(id(w), _rebuilt(w, moved)))
    return sum(t.numel() * t.element_size() for t in tensors.values())

