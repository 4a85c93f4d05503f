"""Where the engine runs and in which dtypes: device, activation dtype and KV dtype, resolved from the
settings in one place (the worker, the KV cache and the benches all ask here)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.config.args import EngineArgs

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

# names accepted by EngineArgs.kv_cache_dtype (besides "auto") -> storage dtype
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    **DTYPES,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def _cpu_flags() -> str:
    """The CPU's feature flags from /proc/cpuinfo ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 GEMMs run natively (faster than fp32); without them they are
    emulated and several times slower than fp32."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx_bf16() -> bool:
    """AMX tiles with bf16 (Sapphire Rapids and later Xeons)."""
    return "amx_bf16" in _cpu_flags()


def resolve_device(name: str) -> torch.device:
    """``auto``: cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    return dev


def cuda_has_bf16(device: torch.device) -> bool:
    """bf16 arithmetic on this CUDA device: compute capability 8.0 (Ampere) or later."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """``auto``: bf16 where it is fast (a CUDA device from Ampere on, or a CPU with AVX512-BF16/AMX), fp16 on an
    older CUDA device, else fp32."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if cuda_has_bf16(device) else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_kv_cache_dtype(name: str | torch.dtype) -> torch.dtype:
    """Storage dtype for a ``kv_cache_dtype`` name (or a dtype, returned as is); ValueError otherwise."""
    if isinstance(name, torch.dtype):
        if name not in KV_CACHE_DTYPES.values():
            raise ValueError(f"kv_cache_dtype {name} is not supported; choose {', '.join(KV_CACHE_DTYPES)}")
        return name
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


@dataclass(frozen=True)
class DeviceConfig:
    """The resolved device, activation dtype and KV storage dtype of one engine."""

    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    quantization: str = "none"  # the weight format (models/quant.py); the block kernels run on the CPU only

    @classmethod
    def from_args(cls, args: EngineArgs, gguf_blocks: Callable[[], bool] = lambda: False) -> DeviceConfig:
        """ValueError naming what to use instead when the device cannot run the dtype or the KV dtype.

        ``gguf_blocks``: whether the model has GGUF block matrices and their kernels build here (asked only where
        the answer matters: it may build a kernel). Then on a CPU with native
        bf16, dtype and quantization ``auto`` resolve to the mixed ``gguf-bf16`` format (fp32 activations, decode
        from the blocks, larger GEMMs in bf16 on the AMX/BF16 units) with a bf16 KV pool, instead of dense bf16:
        it keeps batch-1 decode on the blocks' fewer bytes and the fused fp32 layer (``models/quant.py``). gguf-a8
        with dtype ``auto`` there runs fp32 activations with a bf16 pool too (its int8 GEMMs round the activations
        either way; on an AMX Xeon: batch-1 130 tok/s instead of 70, W1 268 instead of 215)."""
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        kv_auto = dtype
        quantization = args.quantization if device.type == "cpu" else "none"
        if args.dtype == "auto" and device.type == "cpu":
            native = cpu_has_native_bf16()
            if quantization == "gguf-bf16" or (quantization == "auto" and native and gguf_blocks()):
                dtype, kv_auto, quantization = torch.float32, torch.bfloat16, "gguf-bf16"
            elif quantization == "gguf-a8" and native:
                dtype, kv_auto = torch.float32, torch.bfloat16
        kv_dtype = kv_auto if args.kv_cache_dtype == "auto" else resolve_kv_cache_dtype(args.kv_cache_dtype)
        resolved = cls(device, dtype, kv_dtype, quantization)
        if device.type == "cuda" and torch.bfloat16 in (dtype, kv_dtype) and not cuda_has_bf16(device):
            raise ValueError(f"{device} ({torch.cuda.get_device_name(device)}) has no bfloat16 arithmetic (it needs "
                             f"compute capability 8.0); use dtype float16 or float32{resolved._kv_hint()}")
        if device.type == "cuda" and 1 < args.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {args.tensor_parallel_size} needs {args.tensor_parallel_size} GPUs "
                             f"(NCCL runs one rank per GPU), this machine has {torch.cuda.device_count()}; use a "
                             "smaller tensor_parallel_size, or device 'cpu' (ranks over gloo)")
        if args.attention_backend != "auto":
            resolved.check_backend(args.attention_backend)
        return resolved

    def _kv_hint(self) -> str:
        return " (and kv_cache_dtype auto, float16 or int8)" if self.kv_dtype == torch.bfloat16 else ""

    def check_backend(self, backend: str) -> None:
        """ValueError naming what to use instead when attention ``backend`` cannot run on this device with this
        KV storage dtype: the C++ kernels run on the CPU, take float32 / bfloat16 activations and read float32 /
        bfloat16 / int8 / fp8 pools, Triton needs CUDA (or its interpreter, in tests), flex reads float pools only."""
        kv = str(self.kv_dtype).removeprefix("torch.")
        if backend == "cpu" and self.device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs C++ CPU kernels, not on {self.device}; use 'triton' or "
                             "'flex' (or auto)")
        if backend == "triton" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend 'triton' needs a CUDA device; on the CPU use 'cpu' (or auto)")
        if backend == "cpu" and torch.float16 in (self.dtype, self.kv_dtype):
            fp16 = self.dtype == torch.float16
            raise ValueError(f"{'dtype float16' if fp16 else f'kv_cache_dtype {kv}'}: the CPU kernels take float32 or "
                             "bfloat16 activations and read float32, bfloat16, int8 or fp8 pools; use dtype bfloat16 "
                             f"or float32{'' if fp16 else ', or kv_cache_dtype bfloat16'}, or attention_backend "
                             "'reference'")
        if backend == "flex" and self.kv_dtype in QUANTIZED_KV_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv}: the flex backend reads float pools only (flex attention cannot "
                             "dequantize V as it loads it); use attention_backend 'cpu' or 'triton' (or auto), or "
                             "'reference'")
