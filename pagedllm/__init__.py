"""pagedllm: an LLM inference and serving engine built around PagedAttention."""

import os

# OpenMP threads that spin at barriers stall for whole scheduler slices when another busy process
# shares the cores (measured here: a decode step 7x slower with 2 spinning threads); sleeping
# waiters cost little. Only effective when pagedllm is imported before torch; the user's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but waking a sleeping thread costs 25-45 us, paid by each of the ~150 parallel regions of a batch-1 step
# and by each oneDNN GEMM of a batched step, so a waiter spins first for longer than the gaps between regions:
# 10000 libgomp iterations (~0.1-0.5 ms), which covers the Python and the small single-threaded ops between two
# GEMMs too. Alternating processes, 2 threads, quiet:
# - AMX Xeon (session 11): W1 342 -> 430 out tok/s for spin 1000 -> 10000 (3000 385, 30000 420, 100000 436);
#   batch-1 `auto` 84-90 -> 97-109; the 30 layers' bf16 GEMMs at 40 rows 34.8 -> 21.3 ms (spin 100: 40.8).
# - Zen 5 EPYC, exact batch-1: spin 100 80-83 tok/s, 300 107, 500 127, 1000 145-148, 10000 141-152.
# Contended (a busy process on the other core) two spinning threads lose: AMX 38 tok/s at 10000, 53 at 1000, 55 at
# 100; Zen 5 13-26 / 45 / 66-69. The thread governor (pagedllm/ops/cpu_threads.py) then measures one thread
# faster and takes it (AMX: 60 tok/s on one thread); `bench threads` compares the policies.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# torch backs its large CPU tensors with 2 MB transparent huge pages: the KV pool's blocks are read in
# scattered 4 KB pieces, each a TLB miss with 4 KB pages (decode attention over 64 x 512 tokens: 12.6-13.8
# -> 15.3 GB/s; W1 +1.5-2.5% in alternating runs on the 2-core EPYC). Same import-order caveat.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# glibc gives each thread that allocates its own heap arena and keeps freed memory there; a few arenas
# are enough for our threads. Read at process start: it bounds the engine-core and worker processes.
os.environ.setdefault("MALLOC_ARENA_MAX", "2")

from pagedllm.config.host_memory import keep_freed_memory  # noqa: E402

# each step's activations stay in the heap instead of being faulted in afresh (see host_memory)
keep_freed_memory()

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
