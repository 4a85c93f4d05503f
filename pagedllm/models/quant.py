"""Weight matrices kept in their GGUF block format (``quantization="gguf"``).

The embedded SmolLM2 GGUF stores its layer matrices as Q4_1 (5 bits per weight) and its embedding
as Q8_0 (8.5 bits): 96 MB instead of 540 MB of fp32. Decoding is a stream over the weights, so
reading the blocks and widening them in the kernel (``ops/csrc/gemm.cpp``) instead of reading
fp32 makes the few-row GEMMs of decode steps faster. The kernel dequantizes to exactly the fp32
values the loader's ``gguf.quants.dequantize`` produces and runs the fp32 path's register tiles on
them, so outputs are bit-identical to the fp32 model from two rows up. One row (batch-1 decode) goes to
``ops/csrc/gemv.cpp``, which factors the block scales out of the dot products: the same values and fp32 arithmetic
summed in another order, ~1.1-1.7x less CPU time (``PAGEDLLM_BITWISE_GEMV=1``: gemm.cpp's bit-exact path).

``quantization="gguf-a8"`` trades that exactness for speed the way llama.cpp (and vLLM's GGUF kernels)
do: activations are rounded to int8 per 32-value block and the dot products run on integer SIMD
(``ops/csrc/quant_a8.cpp``), 4x the multiply-adds per instruction of fp32 FMAs. Outputs then differ from
the fp32 model by the activation rounding (~0.5% per output; perplexity within ~1%).

``quantization="gguf-bf16"`` (what ``auto`` picks for a GGUF model on a CPU with native bf16: AVX512-BF16 or AMX)
chooses the format per step shape. Each matrix keeps its blocks and also a bf16 copy prepacked for oneDNN
(``models/bf16_gemm.py``): GEMMs of fewer than ``BF16_MIN_ROWS`` rows (the fused batch-1 layer; on AMX Xeons small
decode steps too) read the blocks exactly as ``"gguf"`` does, larger ones (prefill, decode batches) run as bf16
GEMMs on the AMX/BF16 units, ~4-10x the fp32 kernel's rate there. At one row the blocks won on an AMX Xeon, weights
out of cache: the layers' GEMVs 10 ms a step against 18 ms for their bf16 copies, the Q8_0 LM head 2.5 ms against
3.0 ms. Activations stay fp32; only the large GEMMs' inputs are rounded to bf16 (HF bf16 rounds every activation).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from pagedllm import ops
from pagedllm.config.device import cpu_has_native_bf16
from pagedllm.models.bf16_gemm import PackedBF16, bf16_linear
from pagedllm.ops.gguf_blocks import BLOCK_BYTES, PACKED_BYTES, Q4_1, QUANT_NAMES

# auto: "gguf" when the checkpoint has block matrices, activations are fp32 and the kernel builds (the
# weights are the same values either way); else "none"
QUANTIZATIONS = ("auto", "none", "gguf", "gguf-a8", "gguf-bf16")
# gguf-bf16: GEMMs of at least this many rows take the bf16 copy, fewer read the blocks (exact fp32), per CPU class:
# - AVX512-BF16 without tiles (Zen 4 / 5, VDPBF16PS): the copy from 2 rows. W1's prompts, decode steps, medians, Zen 4:
#   2 rows 10.7-12.5 ms a step against 11.4-15.3 (3 alternations), 5 rows 12.2-12.6 against 16.6-20.8, 7 rows
#   12.8-13.4 against 19.9-24.0: the blocks' fp32 FMAs unpacking Q4_1 bound them, the copy's VDPBF16PS streams.
# - AMX Xeon: from 2 rows too, where up to BLOCKS_MAX_ROWS rows the tiles read the blocks themselves (bf16_gemm.py):
#   the 30 layers' GEMMs (2 cores, session 44) 8.4 ms at 2-4 rows against 9.2 / 10.8 / 14.0 for the exact blocks at
#   2 / 4 / 7 rows and 10.2 for the copy. (Session 9 had set 8 there: the block kernel then led the copy below 8.)
# - Where bf16 is emulated (gguf-bf16 is not `auto` there): 8.
# One row (the fused batch-1 layers) stays on the exact blocks.
def default_bf16_min_rows() -> int:
    """``BF16_MIN_ROWS`` for this CPU class (why: the comment above)."""
    return 2 if cpu_has_native_bf16() else 8


BF16_MIN_ROWS = int(os.environ.get("PAGEDLLM_BF16_MIN_ROWS", default_bf16_min_rows()))
# the weight matrices of a decoder layer (dense tensors or GGUF blocks)
MATRICES = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
# batch-1 GEMVs through ops/csrc/gemv.cpp (block scales factored out: 1.1-1.5x less CPU time, fp32 rounding apart
# from gemm.cpp's result); PAGEDLLM_BITWISE_GEMV=1 keeps them on gemm.cpp, bit-identical to the dense fp32 kernel
FACTORED_GEMV = os.environ.get("PAGEDLLM_BITWISE_GEMV") != "1"


@dataclass
class QuantizedWeight:
    """A ``[N, K]`` matrix as rows of GGUF blocks: ``data`` is uint8 ``[N, K / 32 * block bytes]``.

    ``packed``: ``data`` is instead the int8-activation kernel's own layout (``pack_a8``: uint8
    ``[ceil(N / 8), ...]``, the same bytes rearranged), so gguf-a8 GEMMs don't repack W on every call.
    """

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    int8_activations: bool = False  # gguf-a8: integer dot products on int8-rounded activations
    packed: bool = False  # data in pack_a8's layout (int8_activations only)
    bf16: PackedBF16 | None = None  # gguf-bf16: the same matrix in bf16 for GEMMs of bf16.min_rows rows or more

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"ggml type {self.qtype} has no kernel; supported: {', '.join(QUANT_NAMES.values())}")
        n, k = self.shape
        if self.packed:
            rows = ((n + 7) // 8, k // 32 * PACKED_BYTES[self.qtype])
        else:
            rows = (n, k // 32 * BLOCK_BYTES[self.qtype])
        if self.packed and not self.int8_activations:
            raise ValueError("packed matrices are for int8 activations (gguf-a8) only")
        if k % 32 or tuple(self.data.shape) != rows or self.data.dtype != torch.uint8:
            raise ValueError(f"{QUANT_NAMES[self.qtype]} data {tuple(self.data.shape)} does not hold a {n}x{k} matrix")

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack matrices along their rows (fused q/k/v, gate/up); they must share the block format."""
        if len({p.qtype for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("only matrices of one block format and width can be fused")
        if any(p.packed for p in parts):
            raise ValueError("fuse matrices before packing them")
        data = torch.cat([p.data for p in parts])
        return replace(parts[0], data=data, shape=(data.shape[0], parts[0].shape[1]), bf16=None)

    def take_rows(self, rows: torch.Tensor) -> "QuantizedWeight":
        """The matrix of the given output ``rows`` (int64 indices), still in blocks: a row is whole blocks,
        so this is how column-parallel layers and vocab slices shard (tensor parallelism)."""
        self._refuse_packed("take_rows")
        data = self.data.index_select(0, rows)
        return replace(self, data=data, shape=(data.shape[0], self.shape[1]), bf16=None)

    def take_cols(self, start: int, end: int) -> "QuantizedWeight":
        """Input columns ``start:end`` (row-parallel layers), still in blocks: both ends must fall on a
        32-column block boundary (ValueError otherwise; dequantize and slice instead)."""
        self._refuse_packed("take_cols")
        if start % 32 or end % 32 or not 0 <= start < end <= self.shape[1]:
            raise ValueError(f"columns {start}:{end} of a {self.shape[1]}-column matrix do not fall on its "
                             "32-column block boundaries")
        per_block = BLOCK_BYTES[self.qtype]
        data = self.data[:, start // 32 * per_block : end // 32 * per_block].contiguous()
        return replace(self, data=data, shape=(self.shape[0], end - start), bf16=None)

    def _refuse_packed(self, op: str) -> None:
        if self.packed:
            raise ValueError(f"{op} needs the block rows; a packed (gguf-a8) matrix lost them: shard before packing")

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 matrix, or only the given ``rows`` of it (embedding lookups)."""
        if self.packed:
            raise ValueError("a packed (gguf-a8) matrix has no block rows to dequantize; keep the unpacked one")
        data = self.data if rows is None else self.data.index_select(0, rows)
        require_kernel()
        return torch.ops.pagedllm.dequantize.default(data, self.qtype, self.shape[1])

    def pack_a8(self) -> "QuantizedWeight":
        """This matrix in the gguf-a8 kernel's layout, for ``int8_activations`` GEMMs: packing once at load
        instead of on every call nearly halves a decode step's GEMM time (the repack cost about as much as the
        dot products). A new weight; drop this one unless its rows are still needed (embedding lookups)."""
        if self.packed:
            return self
        if not kernel_available(int8_activations=True):
            raise RuntimeError("gguf-a8 needs its C++ kernel (g++ with OpenMP, an AVX2 CPU)")
        packed = torch.ops.pagedllm.pack_a8.default(self.data, self.qtype)
        return replace(self, data=packed, int8_activations=True, packed=True, bf16=None)

    def with_bf16(self, min_rows: int = BF16_MIN_ROWS) -> "QuantizedWeight":
        """This matrix with a prepacked bf16 copy of its values for GEMMs of ``min_rows`` rows or more
        (``quantization="gguf-bf16"``); the blocks stay for smaller ones and for embedding lookups."""
        if self.int8_activations:
            raise ValueError("gguf-bf16 keeps the exact blocks for small GEMMs; gguf-a8's packed matrices are not")
        # the blocks go with the copy where the AMX kernel reads them: Q4_1 (Q8_0's measured even with its copy)
        blocks = self.data if self.qtype == Q4_1 else None
        return replace(self, bf16=PackedBF16.of(self.dequantize(), min_rows, blocks))


def save_blocks(blocks: dict[str, QuantizedWeight], path: str) -> None:
    """Write block matrices as uint8 safetensors, their formats and shapes in the metadata."""
    from safetensors.torch import save_file

    if any(w.packed for w in blocks.values()):
        raise ValueError("packed (gguf-a8) matrices are a runtime layout; save the GGUF blocks")
    meta = {name: f"{w.qtype}:{w.shape[0]}:{w.shape[1]}" for name, w in blocks.items()}
    save_file({name: w.data for name, w in blocks.items()}, path, metadata=meta)


def load_blocks(path: str) -> dict[str, QuantizedWeight]:
    """Read what :func:`save_blocks` wrote."""
    from safetensors import safe_open

    out: dict[str, QuantizedWeight] = {}
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        for name in f.keys():
            qtype, n, k = (int(v) for v in meta[name].split(":"))
            out[name] = QuantizedWeight(f.get_tensor(name), qtype, (n, k))
    return out


def kernel_available(int8_activations: bool = False) -> bool:
    """Whether the block kernel (or, with ``int8_activations``, the int8 one) builds on this machine."""
    return ops.load("quant_a8" if int8_activations else "gemm")


def resolve_auto(quantization: str, has_blocks: bool, act_dtype: torch.dtype) -> str:
    """``quantization`` with ``auto`` made concrete: ``gguf`` where the model has block matrices, activations are
    fp32 and the block kernel builds here; else ``none``."""
    if quantization != "auto":
        return quantization
    return "gguf" if has_blocks and act_dtype == torch.float32 and kernel_available() else "none"


def require_kernel() -> None:
    """RuntimeError with the way out when the block kernel can't be built."""
    if not ops.load("gemm"):
        raise RuntimeError("quantization='gguf' needs the C++ kernels (g++ with OpenMP and an AVX2 CPU); "
                           "use quantization='none'")


def quantized_linear(x: torch.Tensor, w: QuantizedWeight, b: torch.Tensor | None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [T, K] @ w.T (+ b)`` in fp32, dequantizing the blocks inside the kernel at every batch size. gguf-a8 also
    takes bf16 activations (rounded to int8 either way) and returns them in their dtype. A matrix with a bf16 copy
    (gguf-bf16) runs GEMMs of at least its ``min_rows`` rows on that copy, ``x`` fp32 or already rounded to bf16,
    the result in ``out_dtype`` (default ``x``'s)."""
    if w.bf16 is not None and x.shape[0] >= w.bf16.min_rows:
        return bf16_linear(x, w.bf16, b, out_dtype)
    if w.int8_activations:
        xf, bf = x.float().contiguous(), None if b is None else b.float()
        if w.packed:
            y = torch.ops.pagedllm.linear_a8_packed.default(xf, w.data, w.qtype, w.shape[0], bf)
        else:
            y = torch.ops.pagedllm.linear_a8.default(xf, w.data, w.qtype, bf)
        return y.to(x.dtype)
    x = x.float().contiguous()
    require_kernel()
    if x.shape[0] == 1 and FACTORED_GEMV and ops.load("gemv"):
        return torch.ops.pagedllm.quant_gemv.default(x, w.data, w.qtype, b)
    return torch.ops.pagedllm.quant_linear.default(x, w.data, w.qtype, b)
