"""What this CPU can do at best, measured through torch: streaming bandwidth, peak GEMM throughput per path, and the
cores' arithmetic peak per instruction (``ops/csrc/peak.cpp``: what no GEMM path can pass).

These are the two numbers a step cannot beat: batch-1 decode streams every weight once per token (bound by the
bandwidth), batched prefill and W1 multiply many rows per weight (bound by the GEMM throughput). Each figure is the
best of several timed repetitions: on a shared machine the best run is the one least disturbed by neighbours.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.ops.gguf_blocks import BLOCK_BYTES, QUANT_NAMES


@dataclass(frozen=True)
class GemmPath:
    """One way to run ``x [M, K] @ W.T``: its name, the dtype family it counts toward, and its measured speed."""

    name: str
    family: str  # "fp32", "bf16", "int8", or "fp32 on <qtype> blocks"
    gflops: float


def best_seconds(fn: Callable[[], object], min_reps: int = 3, budget_s: float = 0.5) -> float:
    """The fastest of at least ``min_reps`` timed calls (more while ``budget_s`` lasts), after one warm-up call."""
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < min_reps or spent < budget_s:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def bandwidth(nbytes: int, budget_s: float = 0.5) -> dict[str, float]:
    """Bytes per second: ``read`` (a sum over an fp32 buffer: what a decode step does to its weights) and ``copy``
    (read + write counted). ``nbytes`` should be well above the last-level cache."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read = best_seconds(lambda: src.sum(), budget_s=budget_s)
    copy = best_seconds(lambda: dst.copy_(src), budget_s=budget_s)
    return {"read": nbytes / read, "copy": 2 * nbytes / copy}


def random_blocks(n: int, k: int, qtype: int, gen: torch.Generator) -> torch.Tensor:
    """A valid ``[n, k]`` matrix in GGUF blocks (uint8 rows): small fp16 scales (and Q4_1 minimums), random quants."""
    nb = n * (k // 32)
    scale = (torch.rand(nb, 1, generator=gen) * 0.01 + 0.001).half().view(torch.uint8)
    if qtype == 8:  # Q8_0: fp16 scale, 32 int8
        quants = torch.randint(0, 256, (nb, 32), dtype=torch.uint8, generator=gen)
        blocks = torch.cat([scale, quants], 1)
    else:  # Q4_1: fp16 scale, fp16 min, 16 bytes of nibbles
        low = (-torch.rand(nb, 1, generator=gen) * 0.05).half().view(torch.uint8)
        blocks = torch.cat([scale, low, torch.randint(0, 256, (nb, 16), dtype=torch.uint8, generator=gen)], 1)
    assert blocks.shape[1] == BLOCK_BYTES[qtype]
    return blocks.reshape(n, -1).contiguous()


def _candidates(m: int, k: int, n: int, qtypes: tuple[int, ...]) -> list[tuple[str, str, Callable[[], object]]]:
    """Every GEMM path that runs here, as (name, family, call)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05
    xb, wb = x.bfloat16(), w.bfloat16()
    out: list[tuple[str, str, Callable[[], object]]] = [
        ("fp32 F.linear (oneDNN/MKL)", "fp32", lambda: F.linear(x, w)),
        ("bf16 F.linear (oneDNN)", "bf16", lambda: F.linear(xb, wb)),
    ]
    if torch.backends.mkldnn.is_available():
        out.append(("bf16 mkldnn._linear_pointwise", "bf16",
                    lambda: torch.ops.mkldnn._linear_pointwise(xb, wb, None, "none", [], "")))
    xi = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    wi = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen)
    out.append(("int8 torch._int_mm (oneDNN)", "int8", lambda: torch._int_mm(xi, wi)))
    if ops.load("gemm"):
        out.append(("fp32 pagedllm gemm.cpp", "fp32", lambda: torch.ops.pagedllm.linear.default(x, w, None)))
        for qt in qtypes:
            blocks = random_blocks(n, k, qt, gen)
            out.append((f"fp32 on {QUANT_NAMES[qt]} blocks, pagedllm gemm.cpp (exact)", f"fp32 on {QUANT_NAMES[qt]}",
                        lambda b=blocks, q=qt: torch.ops.pagedllm.quant_linear.default(x, b, q, None)))
    if ops.load("quant_a8"):
        for qt in qtypes:
            packed = torch.ops.pagedllm.pack_a8.default(random_blocks(n, k, qt, gen), qt)
            out.append((f"int8 on {QUANT_NAMES[qt]} blocks, pagedllm quant_a8.cpp (gguf-a8)", "int8",
                        lambda p=packed, q=qt: torch.ops.pagedllm.linear_a8_packed.default(x, p, q, n, None)))
    return out


def gemm_peaks(m: int, k: int, n: int, qtypes: tuple[int, ...] = (3, 8),
               budget_s: float = 0.3) -> tuple[list[GemmPath], dict[str, str]]:
    """GFLOP/s of every path at one shape (``2 m k n`` operations per call), fastest first; and the paths this
    CPU refuses (oneDNN's bf16 primitive needs AVX512-BF16 or AMX, for one), with the reason."""
    flops = 2.0 * m * k * n
    paths, refused = [], {}
    for name, family, fn in _candidates(m, k, n, qtypes):
        try:
            paths.append(GemmPath(name, family, flops / best_seconds(fn, budget_s=budget_s) / 1e9))
        except RuntimeError as e:
            refused[name] = str(e).splitlines()[0][:160]
    return sorted(paths, key=lambda p: -p.gflops), refused


def best_of(paths: list[GemmPath], family: str) -> GemmPath | None:
    """The fastest measured path of ``family``; None when none ran."""
    return next((p for p in paths if p.family == family), None)


# instruction_peak's units -> the GEMM family each bounds, and how the report names it
INSTRUCTIONS = {"fp32_fma": ("fp32", "fp32 FMA"), "bf16_dot": ("bf16", "bf16 VDPBF16PS"),
                "int8_dot": ("int8", "int8 VPDPBUSD (AVX2: VPMADDUBSW pairs)"), "amx_bf16": ("bf16", "bf16 AMX tiles")}


def instruction_peaks(budget_s: float = 0.2) -> list[GemmPath]:
    """GFLOP/s of each instruction the cores have, every torch thread running it on registers only, fastest first;
    none where the peak kernel can't be built. Each call runs ~20 ms (its round count is sized by a first call)."""
    if not ops.load("peak"):
        return []
    flops, out = torch.zeros(1, dtype=torch.float64), []
    for unit, (family, name) in INSTRUCTIONS.items():
        t0 = time.perf_counter()
        torch.ops.pagedllm.instruction_peak.default(flops, unit, 10_000)
        if flops.item() == 0:  # not on this CPU
            continue
        iters = max(10_000, int(10_000 * 0.02 / max(time.perf_counter() - t0, 1e-6)))
        seconds = best_seconds(lambda u=unit, n=iters: torch.ops.pagedllm.instruction_peak.default(flops, u, n),
                               budget_s=budget_s)
        out.append(GemmPath(f"{name}, instruction peak", family, flops.item() / seconds / 1e9))
    return sorted(out, key=lambda p: -p.gflops)
