"""Builds and caches pagedllm's C++ CPU kernels (``torch.utils.cpp_extension.load``).

Each kernel is one self-contained ``.cpp`` file under a ``csrc/`` folder, compiled on first use with
``-O3 -march=native -fopenmp`` (set ``PAGEDLLM_NO_MARCH_NATIVE=1`` for a portable build). Builds are
keyed by the source's content, flags and torch version, not its path: torch's JIT rebuilds whenever
the source path in its build file changes, so every checkout or reinstall of the package (or a switch
between two of them) cost ~2 minutes of compiling, some of it inside the first generation. The source
is copied to ``~/.cache/pagedllm/kernels/<name>_<hash>/`` (``PAGEDLLM_KERNEL_CACHE`` moves it) and built
there. A failed build is remembered, so callers can fall back without retrying the compiler every call.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from types import ModuleType

_built: dict[str, ModuleType] = {}
_failed: dict[str, Exception] = {}
_lock = threading.Lock()


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]
    if os.environ.get("PAGEDLLM_NO_MARCH_NATIVE") != "1":
        flags.append("-march=native")
    return flags


def build_dir(name: str, source: Path) -> Path:
    """Where ``source`` is built: one folder per (content, flags, torch version), shared by every checkout."""
    import torch

    key = hashlib.sha256(source.read_bytes() + " ".join(_flags() + [torch.__version__]).encode()).hexdigest()[:12]
    root = Path(os.environ.get("PAGEDLLM_KERNEL_CACHE") or Path.home() / ".cache" / "pagedllm" / "kernels")
    return root / f"{name}_{key}"


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

            where = build_dir(name, source)
            where.mkdir(parents=True, exist_ok=True)
            stable = where / source.name
            if not stable.exists():  # write-then-rename: a concurrent build never sees half a file
                tmp = where / f".{source.name}.{os.getpid()}"
                tmp.write_bytes(source.read_bytes())
                tmp.replace(stable)
            _built[name] = load(name=where.name, sources=[str(stable)], build_directory=str(where),
                                extra_cflags=_flags(), extra_ldflags=["-fopenmp"], verbose=False)
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


def kernel_sources() -> dict[str, Path]:
    """Every kernel of the package, by module name (``pagedllm_<file stem>``, the names callers load)."""
    return {f"pagedllm_{p.stem}": p for p in sorted(Path(__file__).parent.rglob("csrc/*.cpp"))}


def build_all() -> dict[str, str]:
    """Build every kernel now (setup does, so that no first request waits on the compiler); name -> error
    or "ok"."""
    out = {}
    for name, src in kernel_sources().items():
        try:
            load_extension(name, src)
            out[name] = "ok"
        except RuntimeError as e:
            out[name] = str(e)
    return out
