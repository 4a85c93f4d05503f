"""Builds, caches and loads pagedllm's C++ CPU kernels (``torch.utils.cpp_extension.load``).

Each kernel is one ``.cpp`` file under ``pagedllm/ops/csrc/`` (with the headers beside it), a library of torch
custom ops (``torch.ops.pagedllm.<op>``; see :mod:`pagedllm.ops`), loaded into the process with
``torch.ops.load_library``. It is compiled on first use with
``-O3 -march=native -fopenmp`` (set ``PAGEDLLM_NO_MARCH_NATIVE=1`` for a portable build). Builds are
keyed by the source's and its headers' content, flags, torch version and the environment that links it (interpreter,
prefix, the CPU's ISA flags), not its path: torch's JIT rebuilds whenever the source path in its build
file changes, so every checkout or reinstall of the package (or a switch between two of them) cost ~2
minutes of compiling, some of it inside the first generation, and two environments sharing one folder
rebuilt each other's kernels. The sources are copied to ``~/.cache/pagedllm/kernels/<name>_<hash>/``
(``PAGEDLLM_KERNEL_CACHE`` moves it) and built there. A failed build is remembered, so callers can fall
back without retrying the compiler every call.

A build may be killed at any moment. torch's own ``lock`` file then stays and every later start waits on
it forever; so each build first takes an ``flock`` on ``.pagedllm.lock`` beside it, which the kernel drops
when its holder dies. Holding that lock, any torch ``lock`` left in the folder belongs to a dead build
and is removed; a start that has to wait for a live build says so in the log.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("pagedllm.native")

_built: dict[str, Path] = {}
_failed: dict[str, Exception] = {}
_lock = threading.Lock()


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]
    if os.environ.get("PAGEDLLM_NO_MARCH_NATIVE") != "1":
        flags.append("-march=native")
    return flags


def _cpu_flags() -> str:
    """The ISA flags of this CPU (``-march=native`` compiles for them), '' where /proc/cpuinfo is absent."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def _environment() -> str:
    """What a build links against beyond its source: interpreter, environment, torch, CPU."""
    import torch

    return "\n".join([sys.executable, sys.prefix, sys.version, torch.__version__, _cpu_flags()])


def _headers(source: Path) -> list[Path]:
    """The headers a kernel may include: every ``.h`` beside it."""
    return sorted(source.parent.glob("*.h"))


def build_dir(name: str, source: Path) -> Path:
    """Where ``source`` is built: one folder per (content, flags, environment), shared by every checkout."""
    content = b"".join(p.read_bytes() for p in [source, *_headers(source)])
    key = hashlib.sha256(content + " ".join(_flags()).encode() + _environment().encode()).hexdigest()[:12]
    root = Path(os.environ.get("PAGEDLLM_KERNEL_CACHE") or Path.home() / ".cache" / "pagedllm" / "kernels")
    return root / f"{name}_{key}"


@contextmanager
def _build_lock(where: Path) -> Iterator[None]:
    """Exclusive use of a build folder across processes, released by the kernel if the holder dies;
    clears the torch ``lock`` a killed build left behind."""
    with open(where / ".pagedllm.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process to finish building the C++ kernel in %s", where)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = where / "lock"
            if stale.exists():
                log.warning("removing the lock of an interrupted kernel build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_library(name: str, source: Path) -> Path:
    """Build ``source`` (the first time, ~1 min) and load it into the process (its ops register themselves);
    the library's path. RuntimeError if it can't be built or loaded."""
    lib = _built.get(name)
    if lib is not None:
        return lib
    with _lock:
        if name in _built:
            return _built[name]
        if name in _failed:
            raise RuntimeError(f"the C++ kernel {name!r} is unavailable: {_failed[name]}") from _failed[name]
        try:
            from torch.utils.cpp_extension import load

            where = build_dir(name, source)
            where.mkdir(parents=True, exist_ok=True)
            with _build_lock(where):
                for src in [source, *_headers(source)]:
                    stable = where / src.name
                    if not stable.exists():  # write-then-rename: a killed copy never leaves half a file
                        tmp = where / f".{src.name}.{os.getpid()}"
                        tmp.write_bytes(src.read_bytes())
                        tmp.replace(stable)
                load(name=where.name, sources=[str(where / source.name)], build_directory=str(where),
                     extra_cflags=_flags(), extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
                _built[name] = where / f"{where.name}.so"
        except Exception as e:  # compiler missing, headers missing, build error
            _failed[name] = e
            raise RuntimeError(f"building the C++ kernel {name!r} (g++ with OpenMP and the Python headers) "
                               f"failed: {e}") from e
    return _built[name]


def try_load_library(name: str, source: Path) -> Path | None:
    """Like :func:`load_library` but None when the kernel can't be built (callers fall back to ATen)."""
    try:
        return load_library(name, source)
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
            load_library(name, src)
            out[name] = "ok"
        except RuntimeError as e:
            out[name] = str(e)
    return out
