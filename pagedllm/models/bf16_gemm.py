"""bf16 GEMMs on weights prepacked once for oneDNN, for CPUs with native bf16 (AVX512-BF16, AMX).

``F.linear`` on bf16 tensors reorders the weight into oneDNN's blocked layout on every call: at decode sizes that
reorder costs more than the product (the embedded model's tied LM head took 8 ms a call at one row on an AMX Xeon,
1.3 ms prepacked). vLLM's CPU build and torch.compile's CPU freezing pass prepack the same way
(``mkldnn._reorder_linear_weight`` once, ``mkldnn._linear_pointwise`` per call). Where oneDNN has no bf16
primitive (AVX2-only CPUs) the weight stays a plain bf16 matrix and ``F.linear`` runs it, slowly but with the
same meaning, so the path is testable everywhere.

Activations may be fp32 (the mixed ``quantization="gguf-bf16"`` path): they are rounded to bf16 at the GEMM's
input, the product accumulates in fp32 inside oneDNN, and its bf16 output comes back widened, bias added in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN runs bf16 GEMMs natively here (it refuses its prepacked bf16 primitive otherwise)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=torch.bfloat16), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


@dataclass
class PackedBF16:
    """A ``[N, K]`` matrix in bf16, in oneDNN's layout when ``prepacked`` (then only oneDNN can read it).

    ``min_rows``: a :class:`~pagedllm.models.quant.QuantizedWeight` that carries this copy uses it for GEMMs of at
    least this many rows and its own blocks below (decode steps stream fewer bytes from the blocks).
    """

    data: torch.Tensor
    shape: tuple[int, int]
    prepacked: bool
    min_rows: int = 1

    @classmethod
    def of(cls, w: torch.Tensor, min_rows: int = 1) -> "PackedBF16":
        """Round ``w`` to bf16 and prepack it where oneDNN can."""
        wb = w.detach().to(torch.bfloat16).contiguous()
        if onednn_bf16_available():
            return cls(torch.ops.mkldnn._reorder_linear_weight(wb, None), tuple(wb.shape), True, min_rows)
        return cls(wb, tuple(wb.shape), False, min_rows)


def bf16_linear(x: torch.Tensor, w: PackedBF16, b: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [T, K] @ w.T (+ b)`` as a bf16 GEMM, returned in ``out_dtype`` (default ``x``'s; bias added in it)."""
    out_dtype = out_dtype or x.dtype
    xb = x.to(torch.bfloat16)
    if w.prepacked:
        y = torch.ops.mkldnn._linear_pointwise(xb, w.data, None, "none", [], "")
    else:
        y = F.linear(xb, w.data)
    y = y.to(out_dtype)
    return y if b is None else y.add_(b.to(out_dtype))
