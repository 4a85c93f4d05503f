"""The kernel cache survives a build killed midway (kill -9 leaves torch's ``lock`` behind), and builds
are keyed by the environment as well as the source."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# A real build through torch's JIT that takes seconds, not a minute: pybind11's headers (no ATen) are there only
# to make the compile last long enough to be killed midway; the library is loaded and called through ctypes.
SOURCE = textwrap.dedent("""
    #include <pybind11/pybind11.h>
    extern "C" int answer() { return 42; }
""")
BUILD = "import ctypes, sys; from pathlib import Path; from pagedllm.ops.build import load_library; " \
        "print(ctypes.CDLL(str(load_library('pagedllm_test_tiny', Path(sys.argv[1])))).answer())"


def _start(src: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "PAGEDLLM_KERNEL_CACHE": str(cache), "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.Popen([sys.executable, "-c", BUILD, str(src)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, (what, proc.communicate())
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _stderr_line(proc: subprocess.Popen, text: str, timeout: float = 180) -> None:
    """Read ``proc``'s stderr until a line holding ``text``; fails (never hangs) after ``timeout``."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        if select.select([proc.stderr], [], [], 0.1)[0]:
            line = proc.stderr.readline()
            seen.append(line)
            if text in line:
                return
            assert line or proc.poll() is None, ("exited before saying", text, seen)
    raise AssertionError(f"no {text!r} in time; stderr so far: {seen}")


def test_a_build_killed_midway_is_followed_by_a_clean_start(tmp_path):
    """kill -9 during the compile leaves torch's lock; the next start clears it and builds, and a start
    meanwhile waits on the live build, saying so. Bounded: before the fix the next start hung forever."""
    src, cache = tmp_path / "tiny.cpp", tmp_path / "cache"
    src.write_text(SOURCE)
    first = _start(src, cache)
    _wait_for(first, lambda: list(cache.glob("*/lock")), "the build to start")  # torch's baton: compiling
    os.killpg(first.pid, signal.SIGKILL)  # the interpreter, ninja and the compiler
    first.wait()
    assert list(cache.glob("*/lock")), "the kill left no stale lock: the test would prove nothing"
    second = _start(src, cache)
    _stderr_line(second, "removing the lock of an interrupted kernel build")
    third = _start(src, cache)  # while the second builds
    _stderr_line(third, "waiting for another process to finish building")
    for proc in (second, third):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0 and out.strip() == "42", err
    assert not list(cache.glob("*/lock"))


def test_builds_are_keyed_by_the_environment(tmp_path, monkeypatch):
    from pagedllm.ops import build as native

    src = tmp_path / "k.cpp"
    src.write_text(SOURCE)
    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE", str(tmp_path))
    here = native.build_dir("k", src)
    assert here == native.build_dir("k", src) and here.parent == tmp_path
    native._environment.cache_clear()
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    try:
        assert native.build_dir("k", src) != here  # another environment builds its own copy
    finally:
        native._environment.cache_clear()
