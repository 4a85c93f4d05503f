"""bf16 GEMMs on weights prepacked once for oneDNN, for CPUs with native bf16 (AVX512-BF16, AMX).

``F.linear`` on bf16 tensors reorders the weight into oneDNN's blocked layout on every call: at decode sizes that
reorder costs more than the product (the embedded model's tied LM head took 8 ms a call at one row on an AMX Xeon,
1.3 ms prepacked). vLLM's CPU build and torch.compile's CPU freezing pass prepack the same way
(``mkldnn._reorder_linear_weight`` once, ``mkldnn._linear_pointwise`` per call). Where oneDNN has no bf16
primitive (AVX2-only CPUs) the weight stays a plain bf16 matrix and ``F.linear`` runs it, slowly but with the
same meaning, so the path is testable everywhere.

On AMX Xeons the matrix also gets a copy in the tiles' own layout (``ops/csrc/amx_gemm.cpp``) for GEMMs of up to
``COPY_MAX_ROWS`` rows: decode steps and light-load prefills. ``PAGEDLLM_AMX_GEMM=0`` turns it off. The same
products in fp32, rounded to bf16: only the summation order can differ from oneDNN's. On AVX512-BF16 CPUs without
tiles (Zen 4 / 5) the same copy runs through VDPBF16PS (the embedded model's 30 layers, median of 5, 2 cores of a
Zen 4: 11.1 vs 15.9 ms at 8 rows, 24.7 vs 29.2 at 32, 42.8 vs 48.6 at 64, 79.1 vs 83.5 at 128, 554 vs 562 at
1,024; even at 1,152 and 2,048, and no JIT compile per row count). Measured on AMX (the embedded
model's layer GEMMs, 30 layers out of cache, 2 cores):
- decode: oneDNN streamed the weights at ~13 GB/s of the ~25 the memory gives (16.5 vs 13.6 ms at 1 row, 20.7 vs
  15.8 at 32, 23.9 vs 20.6 at 64);
- prefill: oneDNN JIT-compiles a primitive per distinct row count (~15-20 ms for the four shapes), so a prompt of
  a length it had not met cost 54 ms at 270 rows against 40 once met; the tiles took 39-43 either way. Same run,
  both compiled: 86 vs 73 ms at 512 rows, 133 vs 107 at 768, 154 vs 142 at 1,024; oneDNN leads from ~1,100 rows
  (149 vs 164 ms at 1,152, 199 vs 373 at 2,048).
Larger GEMMs go to oneDNN with their rows padded to a bucket (:func:`padded_rows`), so a process compiles ~32
primitives an octave, not one per row count.

On AMX Xeons a matrix that came from GGUF Q4_1 blocks also keeps those blocks (``blocks``) for GEMMs of up to
``BLOCKS_MAX_ROWS`` rows (small decode steps): ``ops/csrc/amx_blocks.cpp`` rounds them to bf16 in the kernel, the
copy's bits from 3.2x fewer bytes (the embedded model's 30 layers, 2 cores: 6.5-8.3 against 9.8-10.9 ms at 1-16
rows, even at 32; measurements there).

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
from pagedllm.config.device import cpu_has_amx_bf16, cpu_has_native_bf16

# GEMMs of at most this many rows run on the packed copy where there is one (see the module docstring)
COPY_MAX_ROWS = 1024
# GEMMs of at most this many rows run from the GGUF blocks where a matrix keeps them (see the module docstring)
BLOCKS_MAX_ROWS = 16
# oneDNN GEMMs of fewer rows run unpadded (padded_rows)
EXACT_ROWS = 128


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


def _copy_kernel_usable() -> bool:
    """The packed copy's kernel is built for this CPU (``-march=native``) and not turned off (PAGEDLLM_AMX_GEMM=0)."""
    return os.environ.get("PAGEDLLM_AMX_GEMM") != "0" and ops.native.builds_native() and ops.load("amx_gemm")


@functools.cache
def amx_bf16_available() -> bool:
    """Whether matrices get the AMX copy: an AMX bf16 CPU, kernels built for it (``-march=native``), not turned off.
    (Where the tiles turn out unusable after all, the op computes the same product through VDPBF16PS.)"""
    return cpu_has_amx_bf16() and _copy_kernel_usable()


@functools.cache
def dpbf16_available() -> bool:
    """Whether matrices get the same packed copy on an AVX512-BF16 CPU without AMX (Zen 4 / 5), where the op runs it
    through VDPBF16PS (``ops/csrc/amx_gemm.cpp``)."""
    return cpu_has_native_bf16() and not cpu_has_amx_bf16() and _copy_kernel_usable()


@functools.cache
def amx_blocks_available() -> bool:
    """Whether matrices from GGUF blocks keep them for small GEMMs on the tiles (``ops/csrc/amx_blocks.cpp``): where
    the packed copy runs on AMX (the kernel's products are the tiles')."""
    return amx_bf16_available() and os.environ.get("PAGEDLLM_AMX_BLOCKS") != "0" and ops.load("amx_blocks")


def packed_copy_available() -> bool:
    """Whether matrices get the packed copy here: for the AMX tiles or for VDPBF16PS."""
    return amx_bf16_available() or dpbf16_available()


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
    amx: torch.Tensor | None = None  # the AMX tiles' layout, for GEMMs of up to COPY_MAX_ROWS rows
    blocks: torch.Tensor | None = None  # the Q4_1 blocks w came from, for GEMMs of up to BLOCKS_MAX_ROWS rows

    @classmethod
    def of(cls, w: torch.Tensor, min_rows: int = 1, blocks: torch.Tensor | None = None) -> "PackedBF16":
        """Round ``w`` to bf16 and prepack it where oneDNN can. ``blocks``: the GGUF Q4_1 blocks that dequantize to
        ``w``, kept where the AMX kernel reads them (:func:`amx_blocks_available`)."""
        wb = w.detach().to(torch.bfloat16).contiguous()
        amx = torch.ops.pagedllm.amx_pack_bf16(wb) if packed_copy_available() else None
        if amx is None or not amx_blocks_available():
            blocks = None
        data = torch.ops.mkldnn._reorder_linear_weight(wb, None) if onednn_bf16_available() else wb
        return cls(data, tuple(wb.shape), onednn_bf16_available(), min_rows, amx, blocks)


def padded_rows(m: int) -> int:
    """``m`` rounded up to a row bucket: itself below ``EXACT_ROWS``, a multiple of 16 below 1,024 rows, then of 1/32
    of its power of two (under ~3% more rows), so oneDNN meets ~32 row counts an octave instead of every step's own.

    Small counts are not padded: oneDNN's time grows with the rows (a Zen 4 core pair, the embedded model's four
    layer GEMMs, warm: 399 us at 17 rows, 655 at 32), so padding 17 decode rows to 32 cost 1.6x on every step, while
    compiling a count once costs ~2-5 ms there (4 shapes), at most ``EXACT_ROWS`` times a process."""
    if m < EXACT_ROWS:
        return m
    return -(-m // (step := max(16, 1 << max(0, m.bit_length() - 6)))) * step


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """oneDNN's prepacked GEMM on ``x`` rounded to bf16, its rows padded to :func:`padded_rows`.

    oneDNN builds (JIT-compiles) a primitive per distinct row count, ~3-5 ms per weight shape (AMX Xeon), and a
    serving step's row count (decode rows plus a prefill chunk) is new almost every step. The rounding and the
    padding are one copy; padded rows are zeros and their outputs are sliced away. A kept row's value is the one
    oneDNN computes for the padded count, which may differ from the unpadded count's in summation order (one bf16
    ulp in ~1 of 6,000 outputs at 33 -> 48 rows): oneDNN's kernel choice already depends on the row count.
    """
    m = x.shape[0]
    mp = padded_rows(m)
    if mp == m:
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")
    xp = x.new_empty((mp, x.shape[1]), dtype=torch.bfloat16)
    xp[:m].copy_(x)
    xp[m:].zero_()
    return torch.ops.mkldnn._linear_pointwise(xp, packed, None, "none", [], "")[:m]


def bf16_linear(x: torch.Tensor, w: PackedBF16, b: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [T, K] @ w.T (+ b)`` as a bf16 GEMM, returned in ``out_dtype`` (default ``x``'s; bias added in it)."""
    out_dtype = out_dtype or x.dtype
    if w.blocks is not None and x.shape[0] <= BLOCKS_MAX_ROWS:
        y = torch.ops.pagedllm.amx_blocks_linear_bf16(_as_bf16(x), w.blocks, w.shape[0])
    elif w.amx is not None and x.shape[0] <= COPY_MAX_ROWS:
        y = torch.ops.pagedllm.amx_linear_bf16(_as_bf16(x), w.amx, w.shape[0])
    elif w.prepacked:
        y = _onednn_linear(x, w.data)
    else:
        y = F.linear(_as_bf16(x), w.data)
    if y.dtype != out_dtype:  # a no-op Tensor.to still costs ~5 us of Python and dispatch
        y = y.to(out_dtype)
    return y if b is None else y.add_(b.to(out_dtype))


def bf16_linear_silu(x: torch.Tensor, w: PackedBF16) -> torch.Tensor | None:
    """``silu(gate) * up`` in bf16 of ``x @ w.T`` (gate: ``w``'s first half of rows) in one pass on the packed copy: the
    bits of the bf16 ``silu_mul`` over :func:`bf16_linear`'s bf16 output, without writing that output and reading it
    back. None where the copy does not take ``x``'s rows (or gate/up are not whole 16-column blocks)."""
    if w.amx is None or not w.min_rows <= x.shape[0] <= COPY_MAX_ROWS or w.shape[0] % 32:
        return None
    if w.blocks is not None and x.shape[0] <= BLOCKS_MAX_ROWS:
        return torch.ops.pagedllm.amx_blocks_linear_silu_bf16(_as_bf16(x), w.blocks, w.shape[0])
    return torch.ops.pagedllm.amx_linear_silu_bf16(_as_bf16(x), w.amx, w.shape[0])


def _as_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` in bf16, without a call where it already is (a decode step's GEMM inputs are: ~5 us each saved)."""
    return x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
