"""pagedllm's C++ CPU kernels as torch custom ops, ``torch.ops.pagedllm.<op>``.

Each ``csrc/<kernel>.cpp`` (sharing ``csrc/ops_common.h``) is one library of ops, a ``TORCH_LIBRARY_FRAGMENT`` of
the ``pagedllm`` namespace with the CPU implementations; ``fake.py`` gives every op its fake (shape-only)
implementation, so ``torch.compile`` and graph capture trace through them, and every schema declares what the
op mutates. A library is built by :mod:`pagedllm.ops.build` (ahead of time at set-up, else on first use) and
loaded by :func:`load`; callers check :func:`load` and fall back to ATen where a kernel can't be built.

| kernel | ops |
|---|---|
| ``paged_attention`` | ``write_kv``, ``paged_attention_out``, ``attend_qkv``, ``attend_qkv_part`` (a team thread's kv heads of it) |
| ``gemm`` | ``linear``, ``quant_linear``, ``dequantize`` |
| ``decode_layer`` | ``decode_layer`` (a model's batch-1 step through its decoder layers: the ops of the other libraries in one call) |
| ``bf16_layers`` | ``bf16_layers`` (a gguf-bf16 step of several rows through the decoder layers: the ops of the other libraries in one call) |
| ``gemv`` | ``quant_gemv`` (one row of x on GGUF blocks, block scales factored out), ``quant_gemv_part`` (a team thread's rows of it) |
| ``fused_ops`` | ``add_rms_norm``, ``rope``, ``silu_mul`` |
| ``quant_a8`` | ``linear_a8``, ``quantize_a8``, ``pack_a8``, ``linear_a8_packed``, ``linear_a8_packed_part`` |
| ``lora_bgmv`` | ``lora_bgmv`` |
| ``amx_gemm`` | ``amx_pack_bf16``, ``amx_linear_bf16``, ``amx_linear_silu_bf16`` (bf16 GEMMs on AMX tiles: decode steps and light-load prefills; gate/up with silu in its epilogue) |
| ``amx_blocks`` | ``amx_blocks_linear_bf16``, ``amx_blocks_linear_silu_bf16`` (small decode steps' bf16 GEMMs on AMX tiles from Q4_1 blocks rounded to bf16 in the kernel: the packed copy's bits from 3.2x fewer bytes) |
| ``amx_attention`` | ``prefill_attention_amx`` (causal prefill attention over a bf16 pool on AMX tiles or with VDPBF16PS, head_dim 64) |
| ``peak`` | ``instruction_peak`` (the cores' arithmetic peak per instruction: FMA, VDPBF16PS, VPDPBUSD, AMX tiles; for ``bench roofline``) |
| ``step_inputs`` | ``step_inputs`` (a step's input ids, positions, slot mapping, block tables, lengths and adapter ids gathered from the worker's persistent batch) |
| ``sampling`` | ``argmax_logsumexp`` (each logits row's greedy pick and log-normaliser, without a log_softmax buffer), ``exponential_race`` (each temperature-sampled row's draw over the hashed noise, in two passes over the row), ``filtered_race`` (the same after top-k / top-p / min-p, sorting only the tokens that can stay) |
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

from pagedllm.ops import build as native
from pagedllm.ops import fake

CSRC = Path(__file__).with_name("csrc")
KERNELS = tuple(sorted(p.stem for p in CSRC.glob("*.cpp")))


def source(kernel: str) -> Path:
    """The C++ source of ``kernel``; ValueError for an unknown name."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; pagedllm has {', '.join(KERNELS)}")
    return CSRC / f"{kernel}.cpp"


def require(kernel: str) -> None:
    """Build (first time) and load ``kernel``'s ops; RuntimeError saying why when that fails."""
    native.load_library(f"pagedllm_{kernel}", source(kernel))
    fake.register(kernel)


def buildable(kernel: str) -> bool:
    """Whether ``kernel`` can run here: a C++ compiler to build it, or an ahead-of-time library built for this
    machine (cheap: nothing is compiled or loaded)."""
    return bool(shutil.which("c++") or shutil.which("g++")) or native.aot_library(f"pagedllm_{kernel}",
                                                                                 source(kernel)) is not None


@functools.cache
def load(kernel: str) -> bool:
    """Whether ``kernel``'s ops are loaded (built first if needed); False where they can't be built."""
    if native.try_load_library(f"pagedllm_{kernel}", source(kernel)) is None:
        return False
    fake.register(kernel)
    return True
