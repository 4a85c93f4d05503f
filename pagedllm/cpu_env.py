"""What a process's CPU libraries read once, at start (libgomp, torch's allocator, glibc): set before torch loads.

``pagedllm/__init__`` calls :func:`set_defaults` first thing, so these hold wherever pagedllm is imported before
torch; a value the user set wins. Imports nothing of pagedllm or torch (it runs before both).
"""

from __future__ import annotations

import os

# OpenMP threads that spin at barriers stall for whole scheduler slices when another busy process shares the cores
# (measured here: a decode step 7x slower with 2 spinning threads); sleeping waiters cost little.
WAIT_POLICY = "PASSIVE"
# ...but waking a sleeping thread costs 25-45 us, paid by each parallel region a waiter sleeps through, so a waiter
# spins first (GOMP_SPINCOUNT libgomp iterations) for longer than the usual gaps between regions.
# - AMX Xeon (session 11, before a step's layers ran in one C++ call): between two oneDNN GEMMs the Python and the
#   small ops outlasted 1000 spins, so the second thread slept and was woken for every GEMM. W1 342 -> 430 out
#   tok/s for spin 1000 -> 10000 (3000 385, 30000 420, 100000 436); batch-1 `auto` 84-90 -> 97-109.
# - Zen 5 EPYC, exact batch-1: spin 100 80-83 tok/s, 300 107, 500 127, 1000 145-148, 10000 141-152.
# - Zen 4 EPYC (session 28; a decode step's layers in one call): 1000 and 10000 even in process (W1 413.0 / 412.6
#   out tok/s over 3 alternating pairs; batch-1 quiet 150.4 / 148.1, contended 89.9 / 91.6), but `pagedllm serve`
#   at 16 req/s served 3.1% more at 1000 (368.9 / 357.9 out tok/s over 7 alternating pairs; at 2 req/s even): its
#   HTTP process and the clients share the two cores, and a thread spinning out 10000 iterations holds the core
#   their wake-ups need.
# So 10000 on CPUs with AMX tiles (the one class measured to need it), 1000 elsewhere. Contended (a busy process on
# the other core) long spins lose: AMX 38 tok/s at 10000, 53 at 1000, 55 at 100; Zen 5 13-26 / 45 / 66-69. The
# thread governor (ops/cpu_threads.py) then measures one thread faster and takes it; `bench threads` compares.
SPIN_AMX, SPIN = "10000", "1000"
# torch backs its large CPU tensors with 2 MB transparent huge pages: the KV pool's blocks are read in scattered 4 KB
# pieces, each a TLB miss with 4 KB pages (decode attention over 64 x 512 tokens: 12.6-13.8 -> 15.3 GB/s; W1
# +1.5-2.5% in alternating runs on the 2-core EPYC).
THP_MEM_ALLOC = "1"
# glibc gives each thread that allocates its own heap arena and keeps freed memory there; a few arenas are enough
# for our threads. Read at process start: it bounds the engine-core and worker processes.
MALLOC_ARENAS = "2"


def cpu_flags() -> str:
    """The ISA flags of this CPU (``-march=native`` compiles for them), '' where /proc/cpuinfo is absent."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def spin_count(flags: str) -> str:
    """``GOMP_SPINCOUNT`` for a CPU with these ISA flags (why: the comments at ``SPIN_AMX``)."""
    return SPIN_AMX if "amx_tile" in flags.split() else SPIN


def set_defaults() -> None:
    """The settings above, where the environment does not already hold one."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    if "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = spin_count(cpu_flags())
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", THP_MEM_ALLOC)
    os.environ.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENAS)
