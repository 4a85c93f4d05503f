"""The kernels compile for every CPU class the project runs on, not only for the machine running the tests
(``-march=native``): AVX2-only Zen 3 (every kernel), and AVX-512 without AMX (Cooper Lake: AVX512-BF16) and with
AMX (Sapphire Rapids) for the kernels with paths per ISA. A type declared inside an AVX-512 block but used outside
it once broke the attention kernel on AVX2 while every test passed on an AMX Xeon."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig

import pytest
from torch.utils.cpp_extension import include_paths

from pagedllm import ops

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

ISA_KERNELS = ("paged_attention", "amx_gemm", "amx_attention")
TARGETS = [("znver3", k) for k in ops.KERNELS] + [(m, k) for m in ("cooperlake", "sapphirerapids") for k in ISA_KERNELS]


@pytest.mark.parametrize("march,kernel", TARGETS, ids=[f"{m}-{k}" for m, k in TARGETS])
def test_kernel_compiles_for_each_cpu_class(march, kernel):
    inc = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    r = subprocess.run(["c++", "-fsyntax-only", "-std=c++17", "-fopenmp", f"-march={march}", *inc,
                        str(ops.source(kernel))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
