"""An adapter's weights as one flat float32 tensor: the bytes its KV pages hold (unified paging, issue 32).

Layer by layer, group by group (``adapter.GROUPS``, the model's fused projections): the group's A matrices
``[targets, r, in]`` then each target's ``B^T [r, out]`` (already times the scaling), ``r`` the adapter's own
rank and a target it does not train all zeros. It is the slots' layout at rank ``r``, so filling a compute
slot from pages is one read and a few strided copies. float32 whatever the model's dtype: the core packs
without knowing it (a bf16 model's adapters take twice the pages they would need).
"""

from __future__ import annotations

import torch

from pagedllm.lora.adapter import GROUPS, LoRAAdapter, LoRAShapes

DTYPE = torch.float32


def packed_numel(shapes: LoRAShapes, rank: int) -> int:
    """Elements of an adapter of rank ``rank`` packed: ``rank x (in + out)`` of every target of every layer."""
    return shapes.num_layers * rank * sum(i + o for o, i in shapes.shapes.values())


def packed_bytes(shapes: LoRAShapes, rank: int) -> int:
    return packed_numel(shapes, rank) * DTYPE.itemsize


def pack(adapter: LoRAAdapter, shapes: LoRAShapes) -> torch.Tensor:
    """``adapter``'s weights in the page layout (module docstring)."""
    r = adapter.rank
    parts = []
    for layer in range(shapes.num_layers):
        for targets in GROUPS.values():
            in_dim = shapes.shapes[targets[0]][1]
            a = torch.zeros(len(targets), r, in_dim, dtype=DTYPE)
            bs = []
            for t, target in enumerate(targets):
                b = torch.zeros(r, shapes.shapes[target][0], dtype=DTYPE)
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
