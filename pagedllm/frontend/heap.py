"""Give freed heap memory back to the system.

glibc keeps what a thread freed in that thread's arena; a burst of logprob dicts built on a reader
thread stayed resident for good (issue 24: +10 GB after 4 requests). Trimming when a process goes
idle returns it; ``MALLOC_ARENA_MAX`` (set in ``pagedllm/cpu_env.py``) bounds the arenas of the
processes the engine starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_name = ctypes.util.find_library("c")
_libc = ctypes.CDLL(_name) if _name else None
_trim = getattr(_libc, "malloc_trim", None)


def trim_heap() -> bool:
    """``malloc_trim(0)`` where glibc has it; True if memory went back to the system."""
    return bool(_trim(0)) if _trim is not None else False
