"""Engine settings, shared by the Python API, the CLI and the server."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from pagedllm.config.args_help import ENGINE_FLAG_HELP, SIZE_FIELDS, parse_size

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
    device: str = "auto"  # auto: cuda when available, else cpu; the model, KV cache and sampler live there
    enforce_eager: bool = False  # vLLM's name: no CUDA graphs (decode steps are replayed from graphs on CUDA)
    distributed_executor_backend: str = "uni"  # uni: this process; mp: a child process; external_launcher: torchrun
    tensor_parallel_size: int = 1  # > 1: that many worker processes, each with a shard (gloo on CPU, NCCL on CUDA)
    check_integrity: bool = False  # run the pool integrity check after every step
    speculative_config: str | None = None  # vLLM's dict as JSON: {"method": "ngram", "num_speculative_tokens": 4}
    data_parallel_size: int = 1  # > 1: engine replicas on Ray behind one front end (pagedllm.scaleout)
    ray_address: str | None = None  # an existing Ray cluster for the replicas; None: a local instance
    disaggregate: str | None = None  # "prefill=P,decode=D": prefill and decode on separate replicas
    seed: int = 0
    # issue 30: async scheduling
    async_scheduling: bool | None = None  # vLLM's name: schedule step N+1 before step N's tokens are back; None: on CUDA

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (``--max-num-seqs``), typed from the defaults; byte sizes take units."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            helptext = ENGINE_FLAG_HELP.get(f.name)  # tests/test_cli_flags.py requires one for every flag
            if f.type in ("bool", bool, "bool | None"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=helptext)
            elif f.name in SIZE_FIELDS:
                parser.add_argument(flag, type=parse_size, default=f.default, help=helptext)
            elif f.name in ("model",):
                parser.add_argument(flag, default=f.default, help=helptext)
            else:
                kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
                parser.add_argument(flag, type=kind, default=f.default, help=helptext)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})
