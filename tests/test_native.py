"""Kernel builds are keyed by content, so a second checkout or a reinstall reuses them, and setup builds
every kernel the package loads (a kernel left out compiled inside the first generation: ~2 min)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from pagedllm import native

PKG = Path(native.__file__).parent


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


def test_build_all_covers_every_kernel_the_package_loads():
    loaded = set()
    for py in PKG.rglob("*.py"):
        for call in re.findall(r"ops\.(?:load|require)\(([^)]*)\)", py.read_text()):
            loaded |= set(re.findall(r'"(\w+)"', call))
    assert {"paged_attention", "gemm", "fused_ops", "quant_a8"} <= loaded
    sources = native.kernel_sources()
    assert {f"pagedllm_{k}" for k in loaded} == set(sources), "every kernel callers load is one build_all builds"
    assert "build_all()" in (PKG.parent / "scripts" / "setup.sh").read_text()


def test_build_all_reports_each_kernel():
    status = native.build_all()
    assert set(status) == set(native.kernel_sources())
    if shutil.which("g++") or shutil.which("c++"):
        assert all(v == "ok" for v in status.values()), status
