"""A model's step of several rows through its decoder layers as one C++ call (``ops/csrc/bf16_layers.cpp``), for
``quantization="gguf-bf16"`` (what ``auto`` picks for a GGUF model on a CPU with native bf16).

Such a step's layers run eight ops each on the matrices' packed bf16 copies; the Python between them (the layer's
checks, its helpers' dispatch, eight trips through ``torch.ops``) cost ~1.5-2 ms of a ~40 ms decode step of 36
rows (Zen 4, 2 threads). The call runs the same ops in the same order, so the results are the same bits; it applies
only where the per-op path would call exactly those ops: fp32 activations on the CPU, every layer's four matrices
with a packed copy that takes this step's rows, no biases, q/k norm, LoRA or tensor parallelism, and the CPU
attention backend with every sequence of the step on its paged kernel (no prefill chunk for SDPA or the AMX
kernel). ``PAGEDLLM_UNFUSED_LAYERS=1`` keeps the per-op path (A/B benchmarks).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pagedllm import ops
from pagedllm.models.bf16_gemm import BLOCKS_MAX_ROWS, COPY_MAX_ROWS
from pagedllm.models.decode_layer import LayerArgs
from pagedllm.models.quant import MATRICES, QuantizedWeight

FUSED = os.environ.get("PAGEDLLM_UNFUSED_LAYERS") != "1"


def _packed_copies(layer: nn.Module) -> list | None:
    """The layer's four matrices' packed bf16 copies (qkv, o, gate/up, down), or None where the layer has what only
    the per-op path computes, or a matrix without such a copy."""
    if layer.tp is not None or layer.qk_norm is not None or layer.qkv_bias is not None or layer.o_bias is not None:
        return None
    w = [getattr(layer, attr) for attr in MATRICES]
    if not all(isinstance(m, QuantizedWeight) and m.bf16 is not None and m.bf16.amx is not None for m in w):
        return None
    return [m.bf16 for m in w]


class FusedBF16Layers(LayerArgs):
    """A model's layers as the fused call takes them: their norms and packed copies, gathered once (at the first
    step that asks); ``matrices`` is None where a layer needs the per-op path."""

    def __init__(self, layers: nn.ModuleList) -> None:
        per_layer = [_packed_copies(layer) for layer in layers]
        # the gate/up pass with silu in its epilogue takes whole 16-column blocks of gate and of up
        if any(c is None for c in per_layer) or per_layer[0][2].shape[0] % 32:
            self.matrices = None
            return
        super().__init__(layers)
        self.matrices = [[c[i].amx for c in per_layer] for i in range(len(MATRICES))]
        # the GGUF blocks for steps of up to BLOCKS_MAX_ROWS rows, where every matrix keeps them (bf16_linear's rule)
        keep = all(c.blocks is not None for layer in per_layer for c in layer)
        self.blocks = [c.blocks for layer in per_layer for c in layer] if keep else []
        self.rows = [c.shape[0] for c in per_layer[0]]
        self.min_rows = max(c.min_rows for c in per_layer[0])

    def applies(self, h: torch.Tensor, backend, kv_cache, meta) -> bool:
        """Whether this step's call computes what the layers' per-op forwards would (see the module docstring)."""
        if self.matrices is None or not FUSED or h.dtype != torch.float32 or not h.is_cpu or h.dim() != 2:
            return False
        if not self.min_rows <= h.shape[0] <= COPY_MAX_ROWS:
            return False
        if getattr(backend, "name", None) != "cpu" or not backend.kernel_only(kv_cache.layer(0)[0], meta):
            return False
        return bool(ops.load("bf16_layers") and ops.load("amx_gemm") and ops.load("fused_ops")
                    and (not self.blocks or ops.load("amx_blocks"))
                    and ops.load("paged_attention"))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache, meta, backend,
                 scale: float) -> torch.Tensor:
        """Every layer's forward for the step's rows in one call: updates ``h`` and the pool, returns the last
        layer's MLP output in bf16 (the final norm's delta)."""
        kd, vd, ks, vs = self.pool(kv_cache)
        return torch.ops.pagedllm.bf16_layers.default(
            h, None, self.input_norms, self.post_norms, self.eps, *self.matrices, self.rows, self.blocks,
            BLOCKS_MAX_ROWS, cos, sin,
            self.num_heads, kd, vd, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.block_size, float(scale), backend.q_tile, ks, vs)
