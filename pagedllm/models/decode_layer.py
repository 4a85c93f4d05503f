"""A model's step through its decoder layers as one C++ call (``ops/csrc/decode_layer.cpp``, named for the batch-1
decode step it was first written for), where it applies: decode steps, and prefill chunks on the paged kernel.

At batch 1 a layer is nine small ops; the Python between them (the wrappers' checks, nine trips through
``torch.ops``) cost about a quarter of the layer's kernel time, and with a call a layer the layer loop, the checks
and each call's 27 arguments still cost ~1 ms of a ~10 ms token (Zen 4, 2 threads). A decode step of several rows
pays the same Python a layer. The fused call runs the same ops in the same order (bit-identical results), so it
applies only where the per-op path would call exactly those ops: fp32 rows on the CPU, GGUF block matrices
(``quantization="gguf"``: the batch-1 GEMV for one row, gemm.cpp for more; or ``"gguf-a8"`` packed) or dense fp32
matrices (gemm.cpp's ``linear``; a checkpoint without GGUF blocks) in every layer, none on a bf16 copy at this
step's rows (gguf-bf16 from its ``min_rows``: ``bf16_layers.py``), every sequence of the step on the CPU backend's
paged kernel (no prefill chunk for SDPA or the AMX kernel), no q/k norm or biases, no LoRA and no tensor
parallelism. ``PAGEDLLM_UNFUSED_DECODE=1`` keeps the per-op path (A/B benchmarks).

For one row of GGUF blocks on more than one thread the call runs the layers in one OpenMP parallel region (the
GEMVs split by rows over the team, attention by kv head, the norms and the MLP activation computed by each thread
for itself, the phases handed over through atomic counters, not barriers) instead of a region per GEMV and in
attention: the same bits on any thread count. ``PAGEDLLM_DECODE_REGION_PER_OP=1`` keeps a region
per op (A/B benchmarks). Several rows, and dense matrices, run op by op, each op with its own parallel regions.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from pagedllm import ops
from pagedllm.attention.cpu import kernel_args
from pagedllm.models import quant
from pagedllm.models.layers import gemm_cpp_weight
from pagedllm.models.quant import MATRICES, QuantizedWeight

FUSED = os.environ.get("PAGEDLLM_UNFUSED_DECODE") != "1"
ONE_REGION = os.environ.get("PAGEDLLM_DECODE_REGION_PER_OP") != "1"


def _dense_fp32(w) -> bool:
    """Whether the per-op path runs this matrix through gemm.cpp's fp32 ``linear`` (``layers.linear``'s test)."""
    return type(w) in (torch.Tensor, nn.Parameter) and w.dtype == torch.float32 and w.is_cpu and gemm_cpp_weight(w)


def _layer_gemv(layer: nn.Module) -> str | None:
    """The GEMM library the fused call would run the layer's matrices on (``"gemv"``: GGUF blocks, ``"quant_a8"``:
    gguf-a8's packing, ``"gemm"``: dense fp32), or None where the layer has what only the per-op path computes."""
    if layer.tp is not None or layer.qk_norm is not None or layer.qkv_bias is not None or layer.o_bias is not None:
        return None
    w = [getattr(layer, attr) for attr in MATRICES]
    if all(_dense_fp32(m) for m in w):
        return "gemm"
    if not all(isinstance(m, QuantizedWeight) for m in w):
        return None
    if all(m.int8_activations and m.packed for m in w):
        return "quant_a8"
    return None if any(m.int8_activations for m in w) else "gemv"


def _step_applies(gemv: str, max_rows: int, h: torch.Tensor, backend, kv_cache, meta) -> bool:
    """Whether this step (fp32 CPU rows below ``max_rows``, every sequence on the CPU backend's paged kernel) runs
    layers of that GEMM kind fused."""
    rows = h.shape[0]
    if not (FUSED and 1 <= rows < max_rows and h.dtype == torch.float32 and h.is_cpu):
        return False
    if gemv == "gemv" and rows == 1 and not quant.FACTORED_GEMV:  # the bit-exact GEMVs: the per-op path
        return False
    if getattr(backend, "name", None) != "cpu" or not backend.kernel_only(kv_cache.layer(0)[0], meta):
        return False
    if not (ops.load("decode_layer") and ops.load("fused_ops") and ops.load("paged_attention") and ops.load(gemv)):
        return False
    return gemv != "gemv" or ops.load("gemm")  # (quant_linear: several rows of blocks)


class LayerArgs:
    """What both fused calls (this one and ``bf16_layers.FusedBF16Layers``) take of a model's layers besides their
    matrices: eps, heads, the norms, and the pool's per-layer tensors (K, V, and an int8 / fp8 pool's scales),
    gathered once per pool: a KVCache's layers are fixed at its creation."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.eps, self.num_heads = layers[0].eps, layers[0].num_heads
        self.input_norms = [layer.input_norm for layer in layers]
        self.post_norms = [layer.post_norm for layer in layers]
        self._pool_of, self._pool_lists = None, ([], [], [], [])

    def pool(self, kv_cache) -> tuple[list, list, list, list]:
        if self._pool_of is not kv_cache:
            kd, vd, ks, vs = [], [], [], []
            for i in range(len(self.input_norms)):
                k, v, scales = kernel_args(*kv_cache.layer(i))
                kd.append(k)
                vd.append(v)
                if scales:
                    ks.append(scales["k_scale"])
                    vs.append(scales["v_scale"])
            self._pool_of, self._pool_lists = kv_cache, (kd, vd, ks, vs)
        return self._pool_lists


class FusedDecode(LayerArgs):
    """A model's layers as the fused call takes them: their norms, matrices and formats, gathered once (at the
    first step) with the GEMM kind they share (None where a layer needs the per-op path), and the rows from
    which a matrix's GEMM runs on its bf16 copy instead (``max_rows``)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        kinds = {_layer_gemv(layer) for layer in layers}
        self.gemv = kinds.pop() if len(kinds) == 1 else None
        if self.gemv is None:
            return
        super().__init__(layers)
        first = layers[0]
        self.matrices = [[getattr(layer, attr).data for layer in layers] for attr in MATRICES]
        # ggml's type numbers; F32 (0) for a dense fp32 matrix
        self.qtypes = [getattr(getattr(layer, attr), "qtype", 0) for layer in layers for attr in MATRICES]
        self.rows = [getattr(first, attr).shape[0] for attr in MATRICES]
        self.max_rows = min((m.bf16.min_rows for layer in layers for attr in MATRICES
                             if getattr(m := getattr(layer, attr), "bf16", None) is not None), default=sys.maxsize)
        self.int8_activations = self.gemv == "quant_a8"

    def applies(self, h: torch.Tensor, backend, kv_cache, meta) -> bool:
        """Whether this step's call computes what the layers' per-op forwards would (see the module docstring)."""
        return self.gemv is not None and _step_applies(self.gemv, self.max_rows, h, backend, kv_cache, meta)

    def __call__(self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, kv_cache,
                 meta, backend, scale: float) -> torch.Tensor:
        """Every layer's forward for the step's rows in one call: updates ``h`` and the pool, returns the last
        layer's MLP output (the final norm's delta)."""
        kd, vd, ks, vs = self.pool(kv_cache)
        return torch.ops.pagedllm.decode_layer.default(
            h, delta, self.input_norms, self.post_norms, self.eps, *self.matrices, self.qtypes, self.rows,
            self.int8_activations, cos, sin, self.num_heads, kd, vd, meta.slot_mapping, meta.block_tables,
            meta.seq_lens, meta.query_start_loc, meta.block_size, float(scale), backend.q_tile, ks, vs,
            one_region=ONE_REGION)
