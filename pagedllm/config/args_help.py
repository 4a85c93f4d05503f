"""Help text for every engine flag, and sizes with units (``4GiB``) for the byte-valued ones."""

from __future__ import annotations

import argparse
import re

ENGINE_FLAG_HELP = {
    "model": "GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    "dtype": "weights and activations dtype: auto (CUDA: bf16, fp16 before Ampere; CPU: bf16 where it is native, "
             "else fp32), float32, bfloat16, float16",
    "kv_cache_dtype": "KV cache dtype (auto: same as --dtype)",
    "quantization": "auto, none, gguf (keep a GGUF's Q4_1/Q8_0 blocks, exact), gguf-a8 (int8 activations, faster) or "
                    "gguf-bf16 (decode from the blocks, larger GEMMs in bf16 on AMX/AVX512-BF16: auto's pick there)",
    "block_size": "tokens per KV block (default: 16 on CUDA, 128 on the CPU)",
    "kv_cache_memory": "bytes for the KV pool, units allowed (4GiB, 512MB); default: --kv-cache-fraction of free memory",
    "kv_cache_fraction": "fraction of free memory for the KV pool when --kv-cache-memory is not given",
    "num_blocks": "exact number of KV blocks (overrides the memory settings)",
    "swap_space": "host memory for preemption by swap: a plain number is GiB, as in vLLM (4 = 4GiB); other units "
                  "allowed (512MB); 0: none",
    "max_num_seqs": "most sequences in one batch (default: 256 on CUDA, 64 on the CPU)",
    "max_num_batched_tokens": "token budget of one engine step (prefill chunks and decodes together; default: 8192 "
                              "on CUDA, 2048 on the CPU; 4096 there for the offline LLM class, as vLLM)",
    "max_model_len": "context limit in tokens (default: the model's)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts across steps so decodes keep running",
    "preemption_mode": "what frees blocks under memory pressure: recompute or swap",
    "scheduling_policy": "admission order: fcfs, lpm (longest prefix match first) or priority (a request's priority "
                         "field, lowest first, as vLLM's)",
    "batching": "continuous (admit every step) or static",
    "attention_backend": "auto, cpu, reference, flex or triton",
    "check_integrity": "verify the KV pool's bookkeeping after every step (slow; for debugging)",
    "data_parallel_size": "engine replicas on Ray behind this front end, routed by prefix affinity (the ray extra)",
    "ray_address": "Ray cluster for the replicas (e.g. auto, ray://host:10001); default: a local Ray instance",
    "disaggregate": "prefill=P,decode=D: P replicas compute prompts, their KV moves to D replicas that generate",
    "seed": "random seed of the engine",
    "device": "where the model, KV cache and sampler live: auto (cuda when available, else cpu), cpu, cuda[:N]",
    "enforce_eager": "run every step eagerly: no CUDA graphs (by default decode steps replay graphs captured per "
                     "batch-size bucket, on CUDA with the triton backend)",
    "tensor_parallel_size": "shard the model over this many worker processes (torch.distributed: gloo on CPU, "
                            "NCCL on CUDA); each holds its share of every KV block",
    "distributed_executor_backend": "where the worker runs: uni (in the engine core's process), mp (a child process), "
                                    "or external_launcher (ranks torchrun started, across nodes: rank 0 runs the "
                                    "engine and the server, the others execute its steps)",
    "kv_events_config": "publish KV cache events for KV-aware routers, vLLM's JSON: '{\"enable_kv_cache_events\": "
                        "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}' (optional replay_endpoint, "
                        "topic, buffer_steps, hwm)",
    "speculative_config": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                          "(methods: ngram, suffix, draft_model with model or num_layers)",
    # issue 32: multi-LoRA serving
    "enable_lora": "serve PEFT LoRA adapters (requests choose one by its name as the OpenAI 'model')",
    "lora_modules": "adapters to serve from the start, as name=path (a PEFT adapter directory) ...",
    "max_loras": "adapter compute slots on the device (their memory comes out of the KV cache budget; resident "
                 "adapters are stored in KV blocks); a step mixes at most this many adapters",
    "max_lora_rank": "the highest adapter rank accepted; higher ones are refused at load",
    "max_cpu_loras": "adapters kept read and packed in host memory (one paged in again is not read again), least "
                     "recently used dropped first (default: max_loras)",
    "gpu_memory_utilization": "fraction of the GPU's memory this engine may use: the KV pool gets it less the weights "
                              "and the peak of a profiled forward at --max-num-batched-tokens (CUDA only; "
                              "--kv-cache-memory or --num-blocks override it)",
    "async_scheduling": "schedule step N+1 while step N runs; its sampled ids feed N+1 on the worker, and a stop "
                        "found a step late is dropped (default: on for CUDA, off elsewhere; plain requests only: "
                        "beam search, n > 1, speculative decoding and structured outputs run synchronously)",
}

ENGINE_FLAG_HELP.update({  # issue 31: KV tiers
    "kv_offload_memory": "bytes of host RAM for KV blocks the pool evicts (L2), promoted back on a prefix hit "
                         "instead of recomputed, units allowed (8GiB); 0: none",
    "kv_disk_path": "directory for the persistent KV disk tier (L3): checksummed block files a restarted engine "
                    "finds again; shared safely by several engines",
    "kv_disk_size": "bytes the KV disk tier may use, units allowed (50GiB)",
    "kv_eviction": "which cached KV blocks the pool and the KV tiers give up first: lru, or reuse (decayed use "
                   "count, shallow prefix blocks weighted up)",
})

SIZE_FIELDS = ("kv_cache_memory", "swap_space", "kv_offload_memory", "kv_disk_size")
GIB_FIELDS = ("swap_space",)  # a plain number means GiB on the command line, as vLLM's --swap-space

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, plain_unit: str = "") -> int:
    """Bytes from ``4GiB``, ``512MB``, ``1.5g`` or a plain number (of ``plain_unit``s; argparse type: errors
    name the value)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use a number of bytes or units like 4GiB, 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower() or plain_unit])


def parse_gib_size(text: str) -> int:
    """Bytes from a plain number of GiB (vLLM's unit) or a size with units."""
    return parse_size(text, "gib")

ENGINE_FLAG_HELP.update({  # issue 36: CPU speed per CPU class
    "cpu_thread_policy": "adaptive (default): on the CPU, a few steps run on one thread fewer (every 2 s at most) "
                         "and the faster thread count keeps the steps (a team of spinning threads stalls on a core a "
                         "neighbour took); fixed: torch's thread count as set",
})
