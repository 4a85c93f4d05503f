"""pagedllm: an LLM inference and serving engine built around PagedAttention."""

import os

# OpenMP threads that spin at barriers stall for whole scheduler slices when another busy process
# shares the cores (measured here: a decode step 7x slower with 2 spinning threads); sleeping
# waiters cost little. Only effective when pagedllm is imported before torch; the user's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but waking a sleeping thread costs 25-45 us, paid by each of the ~150 parallel regions of a batch-1 step,
# so a waiter spins first for about as long as the gaps between a step's regions (libgomp: 1000 iterations).
# Batch-1 exact decode (fp32, 2 threads), alternating processes: 2-core Zen 5 EPYC, quiet: spin 100 80-83 tok/s,
# 300 107, 500 127, 1000 145-148, 10000 141-152 (bench throughput: 63.5 / 77.7 -> 125.1 / 135.0, W1 +0.7-4%);
# with a busy process on the other core: 66-69, 61, 53, 45, 13-26. Earlier, on a 2-core AVX2 EPYC: quiet
# 67.5-71.2 / 76.5-78.7 / 83-85 for passive / 100 / 1000; contended 43.5 / 41.5 / 30.5. Spinning pays on
# dedicated cores (what a server has); where other work shares them, use fewer threads or GOMP_SPINCOUNT=100.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
# torch backs its large CPU tensors with 2 MB transparent huge pages: the KV pool's blocks are read in
# scattered 4 KB pieces, each a TLB miss with 4 KB pages (decode attention over 64 x 512 tokens: 12.6-13.8
# -> 15.3 GB/s; W1 +1.5-2.5% in alternating runs on the 2-core EPYC). Same import-order caveat.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# glibc gives each thread that allocates its own heap arena and keeps freed memory there; a few arenas
# are enough for our threads. Read at process start: it bounds the engine-core and worker processes.
os.environ.setdefault("MALLOC_ARENA_MAX", "2")

from pagedllm.config.args import EngineArgs  # noqa: E402
from pagedllm.config.version import __version__  # noqa: E402
from pagedllm.protocol import RequestOutput, SamplingParams  # noqa: E402


def __getattr__(name: str):
    """``LLM`` loads torch models; import it lazily so ``import pagedllm`` stays cheap."""
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "__version__"]
