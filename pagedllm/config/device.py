"""Where the engine runs and in which dtypes: device, activation dtype and KV dtype, resolved from the
settings in one place (the worker, the KV cache and the benches all ask here)."""

from __future__ import annotations

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


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 GEMMs run natively (faster than fp32); without them they are
    emulated and several times slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


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


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """``auto``: bf16 where it is fast (a CUDA device, or a CPU with AVX512-BF16/AMX), else fp32."""
    if name == "auto":
        if torch.device(device).type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
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

    @classmethod
    def from_args(cls, args: EngineArgs) -> DeviceConfig:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        kv_dtype = dtype if args.kv_cache_dtype == "auto" else resolve_kv_cache_dtype(args.kv_cache_dtype)
        return cls(device, dtype, kv_dtype)
