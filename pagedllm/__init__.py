"""pagedllm: an LLM inference and serving engine built around PagedAttention."""

import os

# OpenMP threads that spin at barriers stall for whole scheduler slices when another busy process
# shares the cores (measured here: a decode step 7x slower with 2 spinning threads); sleeping
# waiters cost little. Only effective when pagedllm is imported before torch; the user's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but waking a sleeping thread costs 25-45 us, paid by each of the ~150 parallel regions of a batch-1 step.
# A short spin first (libgomp: 100 iterations) keeps most of the gain of spinning without its cost under
# contention. Batch-1 exact decode, 2-core EPYC, alternating runs: passive 67.5-71.2 tok/s, spin 100 76.5-78.7,
# spin 1000 83-85; with a busy process on one core: 43.5, 41.5, 30.5. W1 throughput unchanged.
os.environ.setdefault("GOMP_SPINCOUNT", "100")
# torch backs its large CPU tensors with 2 MB transparent huge pages: the KV pool's blocks are read in
# scattered 4 KB pieces, each a TLB miss with 4 KB pages (decode attention over 64 x 512 tokens: 12.6-13.8
# -> 15.3 GB/s; W1 +1.5-2.5% in alternating runs on the 2-core EPYC). Same import-order caveat.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# glibc gives each thread that allocates its own heap arena and keeps freed memory there; a few arenas
# are enough for our threads. Read at process start: it bounds the engine-core and worker processes.
os.environ.setdefault("MALLOC_ARENA_MAX", "2")

__version__ = "0.1.0"

from pagedllm.engine import EngineArgs, RequestOutput, SamplingParams  # noqa: E402


def __getattr__(name: str):
    """``LLM`` loads torch models; import it lazily so ``import pagedllm`` stays cheap."""
    if name == "LLM":
        from pagedllm.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput"]
