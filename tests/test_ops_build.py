"""Kernel builds are keyed by content, so a second checkout or a reinstall reuses them; setup builds every
kernel the package loads (a kernel left out compiled inside the first generation: ~2 min) and installs it ahead
of time, which a start uses only where it was built for this machine, building it (JIT) otherwise."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.cpu_env import cpu_flags
from pagedllm.ops import build as native

PKG = Path(native.__file__).parents[1]  # the package: pagedllm/


def test_build_dir_follows_content_not_path(tmp_path):
    name, src = next(iter(native.kernel_sources().items()))
    copy = tmp_path / "elsewhere" / src.name
    shutil.copytree(src.parent, copy.parent)  # the source with its headers
    assert native.build_dir(name, copy) == native.build_dir(name, src)
    copy.write_text(src.read_text() + "\n// changed\n")
    assert native.build_dir(name, copy) != native.build_dir(name, src)
    shutil.copy(src, copy)
    header = next(copy.parent.glob("*.h"))
    header.write_text(header.read_text() + "\n// changed\n")  # a header is part of every kernel's key
    assert native.build_dir(name, copy) != native.build_dir(name, src)


def test_the_isa_level_is_part_of_the_build(monkeypatch):
    """PAGEDLLM_MARCH builds another ISA level into its own folder (its flags are in the key); what it was built on
    is recorded as a native build's is, and only a portable build runs on any CPU."""
    for var in ("PAGEDLLM_MARCH", "PAGEDLLM_NO_MARCH_NATIVE"):
        monkeypatch.delenv(var, raising=False)
    name, src = next(iter(native.kernel_sources().items()))
    here = native.build_dir(name, src)
    assert native.builds_native() and "-march=native" in native._flags()
    monkeypatch.setenv("PAGEDLLM_MARCH", "x86-64-v3")
    assert native._flags() == ["-O3", "-fopenmp", "-march=x86-64-v3"] and not native.builds_native()
    assert native.build_dir(name, src) != here
    assert native._built_for(src)["cpu_flags"] == sorted(cpu_flags().split())
    monkeypatch.setenv("PAGEDLLM_NO_MARCH_NATIVE", "1")
    assert native._flags() == ["-O3", "-fopenmp"] and native._built_for(src)["cpu_flags"] == []


def test_build_all_covers_every_kernel_the_package_loads():
    loaded = set()
    for py in PKG.rglob("*.py"):
        for call in re.findall(r"ops\.(?:load|require)\(([^)]*)\)", py.read_text()):
            loaded |= set(re.findall(r'"(\w+)"', call))
    assert {"paged_attention", "gemm", "fused_ops", "quant_a8"} <= loaded
    sources = native.kernel_sources()
    assert {f"pagedllm_{k}" for k in loaded} == set(sources), "every kernel callers load is one build_all builds"
    assert "build_all()" in (PKG.parent / "scripts" / "setup.sh").read_text()


def test_build_all_reports_each_kernel(tmp_path):
    status = native.build_all(tmp_path)
    assert set(status) == set(native.kernel_sources())
    if shutil.which("g++") or shutil.which("c++"):
        assert all(v == "ok" for v in status.values()), status
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        assert set(manifest) == set(status) and all((tmp_path / e["file"]).is_file() for e in manifest.values())


def test_an_ahead_of_time_library_is_used_only_where_it_was_built_for(tmp_path, monkeypatch):
    """Its sources, flags, torch and Python must be this machine's, and its CPU's ISA flags a subset of this
    CPU's; anything else (or no file) is a JIT build."""
    name, src = next(iter(native.kernel_sources().items()))
    monkeypatch.setenv("PAGEDLLM_AOT_DIR", str(tmp_path))
    assert native.aot_library(name, src) is None  # no manifest
    (tmp_path / "lib.so").write_bytes(b"")
    fits = {"file": "lib.so", **native._built_for(src)}
    for change, ok in [({}, True), ({"cpu_flags": fits["cpu_flags"][:3]}, True),
                       ({"cpu_flags": [*fits["cpu_flags"], "avx512_madeup"]}, False), ({"torch": "2.11.0"}, False),
                       ({"python": "cpython-310"}, False), ({"source": "0" * 64}, False),
                       ({"flags": ["-O3"]}, False), ({"file": "gone.so"}, False)]:
        (tmp_path / "manifest.json").write_text(json.dumps({name: {**fits, **change}}))
        assert (native.aot_library(name, src) == tmp_path / "lib.so") is ok, change


def test_without_a_compiler_a_kernel_runs_if_it_was_built_ahead_of_time(tmp_path, monkeypatch):
    from pagedllm import ops

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("PAGEDLLM_AOT_DIR", str(tmp_path))
    assert not ops.buildable("gemm")
    (tmp_path / "lib.so").write_bytes(b"")
    entry = {"file": "lib.so", **native._built_for(ops.source("gemm"))}
    (tmp_path / "manifest.json").write_text(json.dumps({"pagedllm_gemm": entry}))
    assert ops.buildable("gemm") and not ops.buildable("fused_ops")


_LOAD = """
import json, torch
from pagedllm import ops
from pagedllm.ops import build as native
assert all(ops.load(k) for k in ops.KERNELS)
x = torch.randn(2, 64)
torch.testing.assert_close(torch.ops.pagedllm.silu_mul(x), torch.nn.functional.silu(x[:, :32]) * x[:, 32:])
print(json.dumps({k: str(v) for k, v in native._built.items()}))
"""


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler")
def test_a_fresh_start_loads_the_installed_libraries_without_building(tmp_path):
    """After build_all, a start with an empty kernel cache loads every library from the install (its ops run)
    and compiles nothing; with the manifest saying another CPU built them, it builds them instead."""
    aot = tmp_path / "aot"
    assert set(native.build_all(aot).values()) == {"ok"}

    def start(cache: Path) -> dict:
        env = {**os.environ, "PAGEDLLM_AOT_DIR": str(aot), "PAGEDLLM_KERNEL_CACHE": str(cache),
               "PYTHONPATH": str(PKG.parent)}
        proc = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {k: Path(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}

    loaded = start(tmp_path / "empty-cache")
    assert set(loaded) == set(native.kernel_sources()) and all(p.parent == aot for p in loaded.values())
    assert not (tmp_path / "empty-cache").exists()
    manifest = json.loads((aot / "manifest.json").read_text())
    manifest["pagedllm_fused_ops"]["cpu_flags"].append("avx512_madeup")
    (aot / "manifest.json").write_text(json.dumps(manifest))
    cache = Path(native.build_dir("x", next(iter(native.kernel_sources().values())))).parent  # the warm JIT cache
    loaded = start(cache)
    assert loaded["pagedllm_fused_ops"].parent.parent == cache and loaded["pagedllm_gemm"].parent == aot
