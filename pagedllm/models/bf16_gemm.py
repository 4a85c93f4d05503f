"""bf16 GEMMs on weights prepacked once for oneDNN, for CPUs with native bf16 (AVX512-BF16, AMX).

``F.linear`` on bf16 tensors reorders the weight into oneDNN's blocked layout on every call: at decode sizes that
reorder costs more than the product (the embedded model's tied LM head took 8 ms a call at one row on an AMX Xeon,
1.3 ms prepacked). vLLM's CPU build and torch.compile's CPU freezing pass prepack the same way
(``mkldnn._reorder_linear_weight`` once, ``mkldnn._linear_pointwise`` per call). Where oneDNN has no bf16
primitive (AVX2-only CPUs) the weight stays a plain bf16 matrix and ``F.linear`` runs it, slowly but with the
same meaning, so the path is testable everywhere.

On AMX Xeons the matrix also gets a copy in the tiles' own layout (``ops/csrc/amx_gemm.cpp``) for GEMMs of up to
``AMX_MAX_ROWS`` rows, the decode steps: there oneDNN streamed the weights at ~13 GB/s of the ~25 the memory gives
(the embedded model's layer GEMMs, 30 layers out of cache, 2 cores: 15.4 -> 11.0 ms at 1 row, 15.6 -> 11.2 at 16,
18.6 -> 14.6 at 32; from 48 rows oneDNN led). ``PAGEDLLM_AMX_GEMM=0`` turns it off. The same products in fp32,
rounded to bf16: only the summation order can differ from oneDNN's.

Activations may be fp32 (the mixed ``quantization="gguf-bf16"`` path): they are rounded to bf16 at the GEMM's
input, the product accumulates in fp32 inside oneDNN, and its bf16 output comes back widened, bias added in fp32.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.config.device import cpu_has_amx_bf16

# GEMMs of at most this many rows run on the AMX copy where there is one (see the module docstring)
AMX_MAX_ROWS = 32


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


@functools.cache
def amx_bf16_available() -> bool:
    """Whether matrices get the AMX copy: an AMX bf16 CPU, kernels built for it (``-march=native``), not turned off.
    (Where the tiles turn out unusable after all, the op computes the same product through ATen.)"""
    if os.environ.get("PAGEDLLM_AMX_GEMM") == "0" or not ops.native.builds_native():
        return False
    return cpu_has_amx_bf16() and ops.load("amx_gemm")


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
    amx: torch.Tensor | None = None  # the AMX tiles' layout, for GEMMs of up to AMX_MAX_ROWS rows

    @classmethod
    def of(cls, w: torch.Tensor, min_rows: int = 1) -> "PackedBF16":
        """Round ``w`` to bf16 and prepack it where oneDNN can."""
        wb = w.detach().to(torch.bfloat16).contiguous()
        amx = torch.ops.pagedllm.amx_pack_bf16(wb) if amx_bf16_available() else None
        if onednn_bf16_available():
            return cls(torch.ops.mkldnn._reorder_linear_weight(wb, None), tuple(wb.shape), True, min_rows, amx)
        return cls(wb, tuple(wb.shape), False, min_rows, amx)


def bf16_linear(x: torch.Tensor, w: PackedBF16, b: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [T, K] @ w.T (+ b)`` as a bf16 GEMM, returned in ``out_dtype`` (default ``x``'s; bias added in it)."""
    out_dtype = out_dtype or x.dtype
    xb = x.to(torch.bfloat16)
    if w.amx is not None and xb.shape[0] <= AMX_MAX_ROWS:
        y = torch.ops.pagedllm.amx_linear_bf16(xb, w.amx, w.shape[0])
    elif w.prepacked:
        y = torch.ops.mkldnn._linear_pointwise(xb, w.data, None, "none", [], "")
    else:
        y = F.linear(xb, w.data)
    y = y.to(out_dtype)
    return y if b is None else y.add_(b.to(out_dtype))
