"""KV pool sizing on a GPU, as vLLM's ``gpu_memory_utilization`` does: with the weights loaded, run one forward
at the step's largest token budget, read the allocator's peak, and give the KV pool what is left of
``utilization x total`` after that peak and the memory torch does not manage (the CUDA context, other
processes). A fixed fraction of the card (the CPU's rule) wastes most of a big GPU or overflows a small one.

The device's memory functions come in a :class:`MemoryProbe`, so the arithmetic and the worker's use of it are
tested on the CPU with stand-ins (tests/worker/test_memory_profile.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("pagedllm.worker")


@dataclass(frozen=True)
class MemoryProbe:
    """What the sizing reads from a device: ``mem_get_info() -> (free, total)`` bytes, the allocator's peak
    since ``reset_peak()``, and what the allocator holds from the device (``reserved``)."""

    mem_get_info: Callable[[], tuple[int, int]]
    reset_peak: Callable[[], None]
    max_allocated: Callable[[], int]
    reserved: Callable[[], int]
    empty_cache: Callable[[], None]


def cuda_probe(device: torch.device) -> MemoryProbe:
    return MemoryProbe(
        mem_get_info=lambda: torch.cuda.mem_get_info(device),
        reset_peak=lambda: torch.cuda.reset_peak_memory_stats(device),
        max_allocated=lambda: torch.cuda.max_memory_allocated(device),
        reserved=lambda: torch.cuda.memory_reserved(device),
        empty_cache=torch.cuda.empty_cache,
    )


def probe_for(device: torch.device) -> MemoryProbe | None:
    """The probe of a device sized by profiling (CUDA), None where the KV pool keeps a fixed share (the CPU)."""
    return cuda_probe(device) if device.type == "cuda" else None


@dataclass(frozen=True)
class MemoryBudget:
    total: int  # the device's memory
    peak: int  # the allocator's peak during the profiled forward (weights included)
    non_torch: int  # used on the device but not by this process's allocator (context, other processes)
    kv_bytes: int  # what the KV pool may take

    def describe(self, utilization: float) -> str:
        gib = 2**30
        return (f"{utilization:.0%} of {self.total / gib:.2f} GiB, less the profiled peak {self.peak / gib:.2f} GiB "
                f"(weights + a forward) and {self.non_torch / gib:.2f} GiB outside torch: "
                f"{self.kv_bytes / gib:.2f} GiB for the KV pool")


def profile_kv_budget(probe: MemoryProbe, utilization: float, run_forward: Callable[[], None],
                      scratch_bytes: int = 0) -> MemoryBudget:
    """The KV pool's bytes: ``utilization x total - peak - non-torch``, the peak measured over ``run_forward``
    (the weights already loaded) less ``scratch_bytes``, the scratch pool the forward ran on (the real pool takes
    its place); ValueError when nothing is left, naming what to change."""
    probe.empty_cache()
    probe.reset_peak()
    run_forward()
    peak = probe.max_allocated() - scratch_bytes
    probe.empty_cache()
    free, total = probe.mem_get_info()
    non_torch = max(0, total - free - probe.reserved())
    budget = MemoryBudget(total, peak, non_torch, int(utilization * total) - peak - non_torch)
    if budget.kv_bytes <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} leaves no memory for the KV cache ("
                         f"{budget.describe(utilization)}); raise gpu_memory_utilization, lower "
                         "max_num_batched_tokens, or set kv_cache_memory")
    return budget


def profile_batch(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  block_size: int) -> tuple[list[list[int]], int]:
    """The worst step the engine schedules: ``min(max_num_batched_tokens, max_num_seqs * max_model_len)`` tokens
    in ``min(max_num_seqs, tokens)`` prompts (each needing logits), as token-id lists, and the blocks they need."""
    tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    n = max(1, min(max_num_seqs, tokens))
    lens = [tokens // n + (i < tokens % n) for i in range(n)]
    return [[0] * k for k in lens], sum(-(-k // block_size) for k in lens)
