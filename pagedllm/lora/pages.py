"""An adapter's weights as one flat tensor: the bytes its KV pages hold (unified paging, issue 32).

Layer by layer, group by group (``adapter.GROUPS``, the model's fused projections): the group's A matrices
``[targets, r, in]`` then each target's ``B^T [r, out]`` (already times the scaling), ``r`` the adapter's own
rank and a target it does not train all zeros. It is the slots' layout at rank ``r``, so filling a compute
slot from pages is one read and a few strided copies. In the model's dtype where it is 16-bit (``page_dtype``,
as vLLM keeps adapters in the model's dtype: a bf16 model's adapters take half the pages of float32 ones; the
slots upcast them exactly when the model computes in float32), else float32.
"""

from __future__ import annotations

import torch

from pagedllm.lora.adapter import GROUPS, LoRAAdapter, LoRAShapes

def page_dtype(model_dtype: torch.dtype | str) -> torch.dtype:
    """The dtype adapters are paged in for a model stored in ``model_dtype`` (a dtype or its name)."""
    dt = getattr(torch, model_dtype) if isinstance(model_dtype, str) else model_dtype
    return dt if dt in (torch.bfloat16, torch.float16) else torch.float32


def packed_numel(shapes: LoRAShapes, rank: int) -> int:
    """Elements of an adapter of rank ``rank`` packed: ``rank x (in + out)`` of every target of every layer."""
    return shapes.num_layers * rank * sum(i + o for o, i in shapes.shapes.values())


def packed_bytes(shapes: LoRAShapes, rank: int, dtype: torch.dtype = torch.float32) -> int:
    return packed_numel(shapes, rank) * dtype.itemsize


def pack(adapter: LoRAAdapter, shapes: LoRAShapes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``adapter``'s weights in the page layout (module docstring), cast to ``dtype``."""
    r = adapter.rank
    parts = []
    for layer in range(shapes.num_layers):
        for targets in GROUPS.values():
            in_dim = shapes.shapes[targets[0]][1]
            a = torch.zeros(len(targets), r, in_dim, dtype=dtype)
            bs = []
            for t, target in enumerate(targets):
                b = torch.zeros(r, shapes.shapes[target][0], dtype=dtype)
                ab = adapter.weights.get((layer, target))
                if ab is not None:
                    a[t, : ab[0].shape[0]] = ab[0]
                    b[: ab[1].shape[1]] = ab[1].t()
                bs.append(b)
            parts += [a.view(-1)] + [b.view(-1) for b in bs]
    flat = torch.cat(parts)
    assert flat.numel() == packed_numel(shapes, r)
    return flat


GroupViews = tuple[torch.Tensor, list[torch.Tensor]]  # (A [targets, r, in], [B^T [r, out] per target])


def unpack(flat: torch.Tensor, shapes: LoRAShapes, rank: int) -> list[dict[str, GroupViews]]:
    """Views into ``flat`` per layer and group: ``(A [targets, r, in], [B^T [r, out] per target])``."""
    out, pos = [], 0

    def take(*shape: int) -> torch.Tensor:
        nonlocal pos
        n = 1
        for d in shape:
            n *= d
        pos += n
        return flat[pos - n: pos].view(*shape)

    for _ in range(shapes.num_layers):
        groups = {}
        for g, targets in GROUPS.items():
            a = take(len(targets), rank, shapes.shapes[targets[0]][1])
            groups[g] = (a, [take(rank, shapes.shapes[t][0]) for t in targets])
        out.append(groups)
    return out
