"""Engine settings, shared by the Python API, the CLI and the server."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from pagedllm.config.args_help import ENGINE_FLAG_HELP, GIB_FIELDS, SIZE_FIELDS, parse_gib_size, parse_size


# vLLM's CPU step size by entry point (its EngineArgs defaults by UsageContext): the offline LLM class batches 4096
# tokens a step, the server 2048 (shorter steps, so decodes wait less behind arriving prompts). W1 through the LLM
# class, Zen 4, 2 cores, alternating fresh processes: 4096 tokens 1.02x 2048 (pairs 1.00-1.06), 8192 no better than 2048
# (bench/README, session 24).
CPU_OFFLINE_BATCHED_TOKENS = 4096


def _on_gpu(device: str) -> bool:
    """Whether the engine's device setting lands on a GPU (``auto``: when CUDA is there)."""
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def check_block_size(block_size: object) -> None:
    """ValueError unless ``block_size`` is a power of two in 1..256 (what the pool and every kernel take)."""
    if not isinstance(block_size, int) or not 1 <= block_size <= 256 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in 1..256, got {block_size!r}")


@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: same as dtype; or float32|bfloat16|float16|int8|fp8_e4m3|fp8_e5m2
    quantization: str = "auto"  # "gguf": keep a GGUF's Q4_1/Q8_0 matrices in their blocks (models/quant.py)
    block_size: int | None = None  # None: 16 on CUDA, 128 on the CPU (vLLM's defaults; issue 36)
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: kv_cache_fraction of total memory
    kv_cache_fraction: float = 0.1
    num_blocks: int | None = None  # exact pool size (overrides the memory settings)
    swap_space: int = 0  # bytes of host tier for preemption by swap
    max_num_seqs: int | None = None  # None: 256 on CUDA, 64 on the CPU (issue 30: GPU defaults that serve)
    max_num_batched_tokens: int | None = None  # None: 8192 on CUDA, 2048 on the CPU (vLLM CPU serve's); LLM: offline()
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
    # issue 33: vLLM compatibility
    kv_events_config: str | None = None  # vLLM's JSON: publish KV cache events over ZeroMQ (kv/kv_events.py)
    # issue 32: multi-LoRA serving (pagedllm.lora)
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()  # "name=path": PEFT adapters served from the start, by their model name
    max_loras: int = 4  # adapter slots on the device: a step serves at most this many adapters
    max_lora_rank: int = 16  # adapters of a higher rank are refused at load
    max_cpu_loras: int | None = None  # loaded adapters kept in host memory (LRU); None: max_loras
    # issue 29: GPU memory sizing (vLLM's name): the KV pool gets this fraction of the card's memory less the
    # weights and the profiled peak of a forward at max_num_batched_tokens (CUDA; the CPU keeps kv_cache_fraction)
    gpu_memory_utilization: float = 0.9
    # issue 31: KV tiers below the pool (L2 host RAM, L3 disk) and their eviction policy
    kv_offload_memory: int = 0  # bytes of host RAM for blocks the pool evicts (L2); 0: none
    kv_disk_path: str | None = None  # directory for the persistent disk tier (L3); None: none
    kv_disk_size: int = 50 * 2**30  # bytes the disk tier may use
    kv_eviction: str = "reuse"  # lru | reuse: what the pool and the tiers give up first
    # issue 30: async scheduling
    async_scheduling: bool | None = None  # vLLM's name: schedule step N+1 before step N's tokens are back; None: on CUDA
    # issue 36: CPU speed per CPU class
    cpu_thread_policy: str = "adaptive"  # adaptive: the CPU thread count whose steps measure faster; fixed

    def __post_init__(self) -> None:
        """Device-dependent defaults: a GPU serves 256 sequences and 8192-token steps without tuning; a CPU reads
        its attention's K/V faster from long contiguous blocks (bench/README, "AMX Xeon, session 12")."""
        on_gpu = _on_gpu(self.device)
        if self.block_size is None:
            self.block_size = 16 if on_gpu else 128
        if self.max_num_seqs is None:
            self.max_num_seqs = 256 if on_gpu else 64
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if on_gpu else 2048
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check_block_size(self.block_size)  # before anything divides by it (0 was a ZeroDivisionError)
        bad = [f"{name} must be {rule}, got {value!r}" for name, value, ok, rule in (
            ("num_blocks", self.num_blocks, self.num_blocks is None or self.num_blocks >= 1, ">= 1"),
            ("kv_cache_memory", self.kv_cache_memory, self.kv_cache_memory is None or self.kv_cache_memory > 0,
             "positive (bytes)"),
            ("kv_cache_fraction", self.kv_cache_fraction, 0.0 < self.kv_cache_fraction <= 1.0, "in (0, 1]"),
            ("swap_space", self.swap_space, self.swap_space >= 0, ">= 0 (bytes)"),
            ("max_model_len", self.max_model_len, self.max_model_len is None or self.max_model_len >= 1, ">= 1"),
            ("kv_disk_size", self.kv_disk_size, self.kv_disk_size > 0, "positive (bytes)"),
            ("seed", self.seed, isinstance(self.seed, int) and not isinstance(self.seed, bool), "an int"),
        ) if not ok]
        if bad:  # each was accepted or failed later with another field's name (num_blocks=0: "raise kv_cache_memory")
            raise ValueError("; ".join(bad))

    @classmethod
    def offline(cls, **kwargs) -> "EngineArgs":
        """Settings for the offline ``LLM`` class: as given, with vLLM's offline step size on the CPU
        (:data:`CPU_OFFLINE_BATCHED_TOKENS`) where ``max_num_batched_tokens`` is not."""
        args = cls(**kwargs)
        if kwargs.get("max_num_batched_tokens") is None and not _on_gpu(args.device):
            args.max_num_batched_tokens = CPU_OFFLINE_BATCHED_TOKENS
        return args

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (``--max-num-seqs``), typed from the defaults; byte sizes take units."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            helptext = ENGINE_FLAG_HELP.get(f.name)  # tests/test_cli_flags.py requires one for every flag
            if f.type in ("bool", bool, "bool | None"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=helptext)
            elif f.name in SIZE_FIELDS:
                kind = parse_gib_size if f.name in GIB_FIELDS else parse_size
                parser.add_argument(flag, type=kind, default=f.default, help=helptext)
            elif f.name == "lora_modules":
                parser.add_argument(flag, nargs="+", default=f.default, help=helptext)
            elif f.name in ("model",):
                parser.add_argument(flag, default=f.default, help=helptext)
            else:
                kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
                parser.add_argument(flag, type=kind, default=f.default, help=helptext)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})
