"""Engine settings, shared by the Python API, the CLI and the server."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from pagedllm.models.layers import cpu_has_native_bf16

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        if torch.cuda.is_available() or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: same as dtype; or float32|bfloat16|float16|int8|fp8_e4m3|fp8_e5m2
    quantization: str = "auto"  # "gguf": keep a GGUF's Q4_1/Q8_0 matrices in their blocks (models/quant.py)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: kv_cache_fraction of total memory
    kv_cache_fraction: float = 0.1
    num_blocks: int | None = None  # exact pool size (overrides the memory settings)
    swap_space: int = 0  # bytes of host tier for preemption by swap
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    batching: str = "continuous"
    attention_backend: str = "auto"
    check_integrity: bool = False  # run the pool integrity check after every step
    seed: int = 0

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (``--max-num-seqs``), typed from the defaults."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            elif f.name in ("model",):
                parser.add_argument(flag, default=f.default, help="GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)")
            else:
                kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
                parser.add_argument(flag, type=kind, default=f.default)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})
