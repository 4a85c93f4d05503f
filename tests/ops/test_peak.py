"""The cores' instruction peak (``ops/csrc/peak.cpp``), the ceiling ``bench roofline`` puts over every GEMM path: each
unit counts the FLOPs of the instruction this CPU has (AVX-512 or AVX2 FMA, VDPBF16PS, VPDPBUSD or AVX2's
VPMADDUBSW pairs, AMX tiles) and 0 where it lacks it, on every torch thread; bad arguments are refused."""

from __future__ import annotations

import pytest
import torch

from pagedllm import ops
from pagedllm.bench.roofline_measure import INSTRUCTIONS, instruction_peaks
from pagedllm.cpu_env import cpu_flags

pytestmark = pytest.mark.skipif(not ops.load("peak"), reason="no C++ compiler")

ITERS = 1000


def expected_flops_per_round(unit: str, flags: set[str]) -> int:
    """FLOPs of one round (12 instructions) of ``unit`` on one thread, from the CPU's flags (the build targets them)."""
    if unit == "fp32_fma":
        return 12 * (32 if "avx512f" in flags else 16 if {"avx2", "fma"} <= flags else 0)
    if unit == "bf16_dot":
        return 12 * 64 if "avx512_bf16" in flags else 0
    if unit == "int8_dot":
        return 12 * (128 if "avx512_vnni" in flags else 64 if "avx2" in flags else 0)
    from pagedllm.models.bf16_gemm import amx_bf16_available

    return 12 * 2 * 16 * 16 * 32 if amx_bf16_available() else 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("unit", sorted(INSTRUCTIONS))
def test_each_unit_counts_its_instructions_flops_on_every_thread(unit, threads):
    flags = set(cpu_flags().split())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = torch.full((1,), -1.0, dtype=torch.float64)
        torch.ops.pagedllm.instruction_peak.default(flops, unit, ITERS)
    finally:
        torch.set_num_threads(before)
    assert flops.item() == threads * ITERS * expected_flops_per_round(unit, flags)


def test_bad_arguments_are_refused():
    flops = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="unit must be"):
        torch.ops.pagedllm.instruction_peak.default(flops, "fp64_fma", 10)
    with pytest.raises(RuntimeError, match="iters must be positive"):
        torch.ops.pagedllm.instruction_peak.default(flops, "fp32_fma", 0)
    with pytest.raises(RuntimeError, match="one float64"):
        torch.ops.pagedllm.instruction_peak.default(torch.zeros(1), "fp32_fma", 10)


def test_instruction_peaks_report_the_units_this_cpu_has():
    flags = set(cpu_flags().split())
    peaks = instruction_peaks(budget_s=0.0)
    here = {INSTRUCTIONS[u][1] for u in INSTRUCTIONS if expected_flops_per_round(u, flags)}
    assert {p.name.removesuffix(", instruction peak") for p in peaks} == here
    assert all(p.gflops > 0 and p.family in ("fp32", "bf16", "int8") for p in peaks)
    assert [p.gflops for p in peaks] == sorted((p.gflops for p in peaks), reverse=True)
