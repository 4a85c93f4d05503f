"""glibc malloc settings for a process that frees and re-allocates the same large tensors every step.

An engine step allocates its activations afresh (a prefill chunk of 2048 tokens: a 1691 x 3072 bf16 MLP
activation is 10 MB) and frees them when the step ends. glibc serves blocks over its mmap threshold with fresh
``mmap`` pages and returns the heap's free top to the kernel once it passes the trim threshold; its dynamic
thresholds (raised to the largest freed block, trim at twice that) still leave a step's tens of MB of free top
over the line, so every step's activations were faulted in page by page again. Measured on the AMX Xeon,
8 prompts x 256 tokens prefilled in one step, bf16, 2 threads: 419-590 ms with glibc's defaults, 299-359 ms with
the settings below, 326 ms with tcmalloc preloaded (vLLM's CPU platform preloads its bundled tcmalloc for the same
reason). The cost: the process keeps its peak heap instead of giving it back between steps.
"""

from __future__ import annotations

import ctypes
import os

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit: larger blocks are always mmapped
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
# the user's own settings (read by glibc at start) win
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
# set to 0 to keep glibc's defaults
SWITCH = "PAGEDLLM_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Keep freed blocks up to 32 MB in the heap and the heap's free top up to 1 GB; True when applied.

    Not applied off glibc, where the user set glibc's malloc variables, or with ``PAGEDLLM_KEEP_FREED_MEMORY=0``.
    A preloaded tcmalloc or jemalloc answers ``mallopt`` without acting on it; they keep freed memory anyway.
    """
    if os.environ.get(SWITCH, "1") == "0" or any(k in os.environ for k in USER_SETTINGS):
        return False
    if not _glibc():
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mmap_set = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    return mmap_set and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing): after a one-off move
    of many blocks under the mmap threshold (``models/weight_arena.py``), which the settings above otherwise keep."""
    if _glibc():
        ctypes.CDLL(None).malloc_trim(0)


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False
