"""Help text for every engine flag, and sizes with units (``4GiB``) for the byte-valued ones."""

from __future__ import annotations

import argparse
import re

ENGINE_FLAG_HELP = {
    "model": "GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    "dtype": "weights and activations dtype: auto (bf16 where the CPU has native bf16, else fp32), float32, "
             "bfloat16, float16",
    "kv_cache_dtype": "KV cache dtype (auto: same as --dtype)",
    "quantization": "auto, none, gguf (keep a GGUF's Q4_1/Q8_0 blocks, exact) or gguf-a8 (int8 activations, faster)",
    "block_size": "tokens per KV block",
    "kv_cache_memory": "bytes for the KV pool, units allowed (4GiB, 512MB); default: --kv-cache-fraction of free memory",
    "kv_cache_fraction": "fraction of free memory for the KV pool when --kv-cache-memory is not given",
    "num_blocks": "exact number of KV blocks (overrides the memory settings)",
    "swap_space": "bytes of host memory for preemption by swap, units allowed (e.g. 2GiB); 0: none",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one engine step (prefill chunks and decodes together)",
    "max_model_len": "context limit in tokens (default: the model's)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts across steps so decodes keep running",
    "preemption_mode": "what frees blocks under memory pressure: recompute or swap",
    "scheduling_policy": "admission order: fcfs or lpm (longest prefix match first)",
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
    "speculative_config": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                          "(methods: ngram, suffix, draft_model with model or num_layers)",
    "async_scheduling": "schedule step N+1 while step N runs; its sampled ids feed N+1 on the worker, and a stop "
                        "found a step late is dropped (default: on for CUDA, off elsewhere; plain requests only: "
                        "beam search, n > 1, speculative decoding and structured outputs run synchronously)",
}

SIZE_FIELDS = ("kv_cache_memory", "swap_space")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``4GiB``, ``512MB``, ``1.5g`` or a plain number (argparse type: errors name the value)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use a number of bytes or units like 4GiB, 512MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
