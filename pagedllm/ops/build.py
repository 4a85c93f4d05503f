"""Builds, caches and loads pagedllm's C++ CPU kernels (``torch.utils.cpp_extension.load``).

Each kernel is one ``.cpp`` file under ``pagedllm/ops/csrc/`` (with the headers beside it), a library of torch
custom ops (``torch.ops.pagedllm.<op>``; see :mod:`pagedllm.ops`), loaded into the process with
``torch.ops.load_library``. It is compiled on first use with ``-O3 -march=native -fopenmp`` (set
``PAGEDLLM_NO_MARCH_NATIVE=1`` for a portable build, ``PAGEDLLM_MARCH`` for another ISA level). Builds are keyed
by the source's and its headers' content, flags, torch version and the environment that links it (interpreter,
prefix, the CPU's ISA flags), not its path: torch's JIT rebuilds whenever the source path in its build
file changes, so every checkout or reinstall of the package (or a switch between two of them) cost ~2
minutes of compiling, some of it inside the first generation, and two environments sharing one folder
rebuilt each other's kernels. The sources are copied to ``~/.cache/pagedllm/kernels/<name>_<hash>/``
(``PAGEDLLM_KERNEL_CACHE`` moves it) and built there. A failed build is remembered, so callers can fall
back without retrying the compiler every call.

Ahead of time: :func:`build_all` (what ``scripts/setup.sh`` runs after installing, and what a
``pip install --no-build-isolation`` build runs, see ``setup.py``) builds every kernel and puts the libraries
into the package, ``pagedllm/ops/_aot/`` (``PAGEDLLM_AOT_DIR`` moves it), with a manifest of what each was built
for: its sources' content, flags, torch, Python and the ISA flags of the CPU that compiled it. A start loads
the ahead-of-time library when all of those match this machine (its CPU may have more ISA flags, not fewer),
so a machine without a compiler (an image built elsewhere) runs the kernels; otherwise it builds them (JIT,
cached as above), or falls back to ATen where it can't.

A build may be killed at any moment. torch's own ``lock`` file then stays and every later start waits on
it forever; so each build first takes an ``flock`` on ``.pagedllm.lock`` beside it, which the kernel drops
when its holder dies. Holding that lock, any torch ``lock`` left in the folder belongs to a dead build
and is removed; a start that has to wait for a live build says so in the log.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pagedllm.cpu_env import cpu_flags

log = logging.getLogger("pagedllm.ops.build")

_built: dict[str, Path] = {}
_failed: dict[str, Exception] = {}
_lock = threading.Lock()


def _march() -> str | None:
    """The ``-march`` the kernels are compiled for: ``PAGEDLLM_MARCH`` where set (``x86-64-v3``: the AVX2 + FMA
    paths a Zen 3 runs, on a newer CPU; ``tests/ops/test_isa_levels.py`` compares them with the native build's,
    which the rest of the suite assumes), else ``native``; none with ``PAGEDLLM_NO_MARCH_NATIVE=1`` (portable)."""
    if os.environ.get("PAGEDLLM_NO_MARCH_NATIVE") == "1":
        return None
    return os.environ.get("PAGEDLLM_MARCH") or "native"


def _flags() -> list[str]:
    march = _march()
    return ["-O3", "-fopenmp"] + ([f"-march={march}"] if march else [])


def builds_native() -> bool:
    """Whether kernels are compiled for this CPU's own ISA (``-march=native``), so its AVX-512 / AMX paths exist."""
    return _march() == "native"


@functools.cache
def _environment() -> str:
    """What a build links against beyond its source: interpreter, environment, torch, CPU."""
    import torch

    return "\n".join([sys.executable, sys.prefix, sys.version, torch.__version__, cpu_flags()])


def _headers(source: Path) -> list[Path]:
    """The headers a kernel may include: every ``.h`` beside it."""
    return sorted(source.parent.glob("*.h"))


def _content(source: Path) -> bytes:
    return b"".join(p.read_bytes() for p in [source, *_headers(source)])


def build_dir(name: str, source: Path) -> Path:
    """Where ``source`` is built: one folder per (content, flags, environment), shared by every checkout."""
    key = hashlib.sha256(_content(source) + " ".join(_flags()).encode() + _environment().encode()).hexdigest()[:12]
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


def aot_dir() -> Path:
    """Where the ahead-of-time libraries and their manifest are."""
    return Path(os.environ.get("PAGEDLLM_AOT_DIR") or Path(__file__).parent / "_aot")


def _built_for(source: Path) -> dict:
    """What a library built from ``source`` here and now is built for (an ahead-of-time manifest entry)."""
    import torch

    return {"source": hashlib.sha256(_content(source)).hexdigest(), "flags": _flags(), "torch": torch.__version__,
            "python": sys.implementation.cache_tag, "cpu_flags": sorted(cpu_flags().split()) if _march() else []}


def aot_library(name: str, source: Path) -> Path | None:
    """The ahead-of-time library of ``source`` if it was built for this machine (see the module docstring)."""
    folder = aot_dir()
    try:
        entry = json.loads((folder / "manifest.json").read_text())[name]
    except (OSError, ValueError, KeyError):
        return None
    here = _built_for(source)
    differ = [k for k in ("source", "flags", "torch", "python") if entry.get(k) != here[k]]
    if not set(entry.get("cpu_flags", [])) <= set(cpu_flags().split()):
        differ.append("CPU ISA flags")
    lib = folder / entry.get("file", "")
    if differ or not lib.is_file():
        log.info("the ahead-of-time %s does not fit here (%s): building it", name, ", ".join(differ) or "no file")
        return None
    return lib


def load_library(name: str, source: Path) -> Path:
    """Load ``source``'s library into the process (its ops register themselves): the ahead-of-time build when it
    fits this machine, else the JIT build (the first time ~1 min); the library's path. RuntimeError if it can't
    be built or loaded."""
    lib = _built.get(name)
    if lib is not None:
        return lib
    with _lock:
        if name in _built:
            return _built[name]
        if name in _failed:
            raise RuntimeError(f"the C++ kernel {name!r} is unavailable: {_failed[name]}") from _failed[name]
        aot = aot_library(name, source)
        if aot is not None:
            import torch

            torch.ops.load_library(str(aot))
            _built[name] = aot
            return aot
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


def build_all(dest: Path | None = None) -> dict[str, str]:
    """Build every kernel now (so that no first request waits on the compiler) and install the libraries ahead of
    time into ``dest`` (default :func:`aot_dir`) with their manifest; name -> "ok" or the error. Idempotent: a
    library that fits this machine already is kept."""
    dest = dest or aot_dir()
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path = dest / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = {}
    out = {}
    for name, src in kernel_sources().items():
        try:
            lib = load_library(name, src)
        except RuntimeError as e:
            out[name] = str(e)
            continue
        if lib.parent.resolve() != dest.resolve():
            tmp = dest / f".{name}.so.{os.getpid()}"
            shutil.copy2(lib, tmp)
            tmp.replace(dest / f"{name}.so")
            manifest[name] = {"file": f"{name}.so", **_built_for(src)}
        out[name] = "ok"
    tmp = dest / f".manifest.json.{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    tmp.replace(manifest_path)
    return out
