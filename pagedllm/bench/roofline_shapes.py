"""``pagedllm bench roofline --gemm-shapes``: the exact path's GEMM (``quant_linear`` on the GGUF's blocks) at every
matrix shape of the model and the row counts a step runs, beside oneDNN on the same matrix dequantized and beside
the kernel's in-cache peak, per thread count.

Why: W1's and the LoRA bench's steps are ~65-85% these GEMMs, at 16-63 rows (decode steps) and hundreds (prefill
chunks); one figure at one shape (``gemm_peaks``) hides which shapes fall short. The matrices are the embedded
model's own blocks (layer 0's, fused as the engine fuses them, and the tied LM head), read from its blocks file.
``PAGEDLLM_GEMM_V1=1`` (gemm.cpp's panels before issue 32) is timed alternating with the current kernel in the
same process, while that switch exists.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedllm.bench.roofline_measure import best_seconds
from pagedllm.ops.gguf_blocks import QUANT_NAMES

if TYPE_CHECKING:
    from pagedllm.models.quant import QuantizedWeight

ROWS = (1, 4, 16, 32, 64, 128, 256, 512, 1024)
ROWS_QUICK = (1, 16, 64)
PEAK_SHAPE = (288, 256, 512)  # M, K, N: x and a panel in L2, 32 panels, a pack per 288 rows: the tiles alone


def engine_matrices(model: str | None = None) -> list[tuple[str, QuantizedWeight]]:
    """The matrices a step multiplies, as the engine holds them (q/k/v and gate/up fused): layer 0's and the LM
    head, in the GGUF's block formats. Empty for a model without a blocks file."""
    from pagedllm.models.loader import BLOCKS_FILE, resolve_model_dir
    from pagedllm.models.quant import QuantizedWeight, load_blocks

    path = os.path.join(resolve_model_dir(model), BLOCKS_FILE)
    if not os.path.isfile(path):
        return []
    blocks = load_blocks(path)
    layer = "model.layers.0."
    groups = {"qkv": [f"self_attn.{p}_proj" for p in "qkv"], "o": ["self_attn.o_proj"],
              "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
    out = [(name, QuantizedWeight.cat([blocks[f"{layer}{p}.weight"] for p in parts]))
           for name, parts in groups.items() if all(f"{layer}{p}.weight" in blocks for p in parts)]
    head = "lm_head.weight" if "lm_head.weight" in blocks else "model.embed_tokens.weight"
    if head in blocks:
        out.append(("lm_head", blocks[head]))
    return out


def kernel_peak(budget_s: float) -> float:
    """GFLOP/s of gemm.cpp's panel tiles with everything in cache (``PEAK_SHAPE``, dense fp32): the FMA rate the
    kernel reaches when nothing but its multiply-adds costs."""
    m, k, n = PEAK_SHAPE
    x, w = torch.randn(m, k), torch.randn(n, k)
    return 2.0 * m * k * n / best_seconds(lambda: torch.ops.pagedllm.linear.default(x, w, None), budget_s=budget_s) / 1e9


def _with_v1(fn: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        os.environ["PAGEDLLM_GEMM_V1"] = "1"
        try:
            return fn()
        finally:
            os.environ.pop("PAGEDLLM_GEMM_V1", None)

    return call


def shape_table(rows: tuple[int, ...], threads: tuple[int, ...], budget_s: float = 0.2,
                model: str | None = None) -> list[dict]:
    """One dict per (threads, matrix, rows): GFLOP/s of ours, ours before issue 32 (v1) and oneDNN, and the
    kernel's in-cache peak at that thread count. Paths alternate within each cell (same load for all)."""
    from pagedllm.models.quant import quantized_linear

    mats = engine_matrices(model)
    before = torch.get_num_threads()
    out = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            peak = kernel_peak(budget_s)
            for name, w in mats:
                dense = w.dequantize()
                for m in rows:
                    x = torch.randn(m, w.shape[1])
                    ours = lambda x=x, w=w: quantized_linear(x, w, None)  # one row: gemv.cpp, as in the engine
                    paths = {"ours": ours, "v1": _with_v1(ours), "onednn": lambda x=x, d=dense: F.linear(x, d)}
                    best = {p: float("inf") for p in paths}
                    for _ in range(2):  # two alternating rounds, each the best of its repetitions
                        for p, fn in paths.items():
                            best[p] = min(best[p], best_seconds(fn, min_reps=2, budget_s=budget_s / 2))
                    flops = 2.0 * m * w.shape[0] * w.shape[1]
                    out.append({"threads": t, "matrix": name, "format": QUANT_NAMES[w.qtype], "N": w.shape[0],
                                "K": w.shape[1], "rows": m, "peak_gflops": peak,
                                **{f"{p}_gflops": flops / s / 1e9 for p, s in best.items()}})
    finally:
        torch.set_num_threads(before)
    return out
