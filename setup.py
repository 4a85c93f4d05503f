"""The package's build (configured in pyproject.toml), plus the C++ kernels built into it ahead of time when
torch is importable where the package is built: ``pip install --no-build-isolation .`` (or ``-e .``). An
isolated build (pip's default) has no torch, and must not get one (a CUDA torch is gigabytes, and the torch
that runs the kernels is the one installed beside them): it skips the kernels, which are then built on first
use, or by ``scripts/setup.sh``. See ``pagedllm/ops/build.py`` for how a start picks the ahead-of-time library."""

import importlib.util
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HAS_TORCH = importlib.util.find_spec("torch") is not None


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if not HAS_TORCH:
            print("pagedllm: no torch in this build environment; the C++ kernels are built on first use")
            return
        editable = getattr(self, "editable_mode", False)  # an editable install runs from the source tree
        package = Path(__file__).parent / "pagedllm" if editable else Path(self.build_lib) / "pagedllm"
        spec = importlib.util.spec_from_file_location("pagedllm_native_build", package / "ops" / "build.py")
        native = importlib.util.module_from_spec(spec)  # alone: importing pagedllm needs its dependencies
        spec.loader.exec_module(native)
        for kernel, status in native.build_all(package / "ops" / "_aot").items():
            print(f"pagedllm: kernel {kernel}: {status}")


class KernelDistribution(Distribution):
    """With the kernels inside, the wheel is for this platform and Python, not any."""

    def has_ext_modules(self) -> bool:
        return HAS_TORCH


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=KernelDistribution)
