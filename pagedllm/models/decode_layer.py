"""A decoder layer's batch-1 decode step as one C++ call (``ops/csrc/decode_layer.cpp``), where it applies.

At batch 1 a layer is nine small ops; the Python between them (the wrappers' checks, nine trips through
``torch.ops``) cost about a quarter of the layer's kernel time. The fused call runs the same ops in the same order
(bit-identical results), so it applies only where the per-op path would call exactly those ops: one fp32 token on
the CPU, GGUF block matrices (``quantization="gguf"`` with the batch-1 GEMV, or ``"gguf-a8"`` packed), the CPU
attention backend without its SDPA prefill, no q/k norm or biases, no LoRA and no tensor parallelism.
``PAGEDLLM_UNFUSED_DECODE=1`` keeps the per-op path (A/B benchmarks).

On more than one thread the call runs the layer in one OpenMP parallel region (the GEMVs split by rows over the
team, the phases handed over through atomic counters, not barriers) instead of a region per GEMV and in attention:
the same bits on any thread count. ``PAGEDLLM_DECODE_REGION_PER_OP=1`` keeps a region per op (A/B benchmarks).
"""

from __future__ import annotations

import os
import torch
from torch import nn

from pagedllm import ops
from pagedllm.attention.cpu import kernel_args
from pagedllm.models import quant
from pagedllm.models.quant import MATRICES, QuantizedWeight

FUSED = os.environ.get("PAGEDLLM_UNFUSED_DECODE") != "1"
ONE_REGION = os.environ.get("PAGEDLLM_DECODE_REGION_PER_OP") != "1"


def fused_layer_applies(layer: nn.Module, h: torch.Tensor, backend) -> bool:
    """Whether :func:`decode_layer` computes what the layer's per-op forward would (see the module docstring)."""
    if not (FUSED and h.shape[0] == 1 and h.dtype == torch.float32 and h.is_cpu):
        return False
    if layer.tp is not None or layer.qk_norm is not None or layer.qkv_bias is not None or layer.o_bias is not None:
        return False
    if getattr(backend, "name", None) != "cpu" or backend.sdpa_prefill_min_len is not None:
        return False
    w = [getattr(layer, attr) for attr in MATRICES]
    if not all(isinstance(m, QuantizedWeight) for m in w):
        return False
    if all(m.int8_activations and m.packed for m in w):  # gguf-a8
        gemv = "quant_a8"
    elif not any(m.int8_activations for m in w) and quant.FACTORED_GEMV:
        gemv = "gemv"
    else:
        return False
    return bool(ops.load("decode_layer") and ops.load("fused_ops") and ops.load("paged_attention") and ops.load(gemv))


def decode_layer(layer: nn.Module, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, k_cache, v_cache, meta, backend, scale: float) -> torch.Tensor:
    """``layer.forward`` for one token in one call: updates ``h`` and the pool, returns the MLP output."""
    kd, vd, scales = kernel_args(k_cache, v_cache)
    w = [getattr(layer, attr) for attr in MATRICES]
    return torch.ops.pagedllm.decode_layer.default(
        h, delta, layer.input_norm, layer.post_norm, layer.eps, w[0].data, w[1].data, w[2].data, w[3].data,
        [m.qtype for m in w], [m.shape[0] for m in w], w[0].int8_activations, cos, sin, layer.num_heads, kd, vd,
        meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.block_size, float(scale),
        backend.q_tile, **scales, one_region=ONE_REGION)
