"""Builds and caches pagedllm's C++ CPU kernels (``torch.utils.cpp_extension.load``).

Each kernel is one ``.cpp`` file compiled on first use with ``-O3 -march=native -fopenmp`` (set
``PAGEDLLM_NO_MARCH_NATIVE=1`` for a portable build) and cached under ``~/.cache/torch_extensions``.
A failed build is remembered, so callers can fall back without retrying the compiler every call.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import ModuleType

_built: dict[str, ModuleType] = {}
_failed: dict[str, Exception] = {}
_lock = threading.Lock()


def load_extension(name: str, source: Path) -> ModuleType:
    """The compiled module for ``source`` (built the first time, ~1 min); RuntimeError if it can't be built."""
    mod = _built.get(name)
    if mod is not None:
        return mod
    with _lock:
        if name in _built:
            return _built[name]
        if name in _failed:
            raise RuntimeError(f"the C++ kernel {name!r} is unavailable: {_failed[name]}") from _failed[name]
        try:
            from torch.utils.cpp_extension import load

            flags = ["-O3", "-fopenmp"]
            if os.environ.get("PAGEDLLM_NO_MARCH_NATIVE") != "1":
                flags.append("-march=native")
            _built[name] = load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                verbose=False)
        except Exception as e:  # compiler missing, headers missing, build error
            _failed[name] = e
            raise RuntimeError(f"building the C++ kernel {name!r} (g++ with OpenMP and the Python headers) "
                               f"failed: {e}") from e
    return _built[name]


def try_load_extension(name: str, source: Path) -> ModuleType | None:
    """Like :func:`load_extension` but None when the kernel can't be built (callers fall back to ATen)."""
    try:
        return load_extension(name, source)
    except RuntimeError:
        return None
