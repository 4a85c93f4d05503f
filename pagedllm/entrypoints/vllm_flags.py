"""``vllm serve`` flags on ``pagedllm serve``, so a vLLM command line runs unchanged.

Each flag either works with vLLM's meaning (mapped onto ours, or exactly what this server always does), or,
where it asks for something this server cannot do, is refused at parse time with a message saying why. The
flags pagedllm already shares with vLLM (``--max-model-len``, ``--tensor-parallel-size``...) are its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os

from pagedllm.config.args import EngineArgs
from pagedllm.kv.kv_events import KVEventsConfig

log = logging.getLogger("pagedllm.cli")

LOG_LEVELS = ["debug", "info", "warning", "error"]
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's names for ours
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's "fp8" is e4m3
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# flags that only name things this server never does (downloads, remote code, CUDA-graph lengths): accepted,
# with what they mean here; value None: a switch
_INERT = {
    "trust_remote_code": (None, "models load through pagedllm's own Llama code; no model code is ever run"),
    "disable_log_requests": (None, "requests are not logged unless --enable-log-requests"),
    "download_dir": (str, "models load from local paths only; nothing is downloaded"),
    "max_seq_len_to_capture": (int, "CUDA graphs are captured per batch size, for any sequence length"),
    "disable_frontend_multiprocessing": (None, "the API server runs in this process, the engine core in its own"),
    "enable_prompt_tokens_details": (None, "usage always carries prompt_tokens_details.cached_tokens"),
    "compilation_config": (str, "compilation settings do not change outputs; pagedllm uses CUDA graphs on its "
                                "own (--enforce-eager turns them off)"),
}

# flags accepted only with the value that means what this server does; any other value is refused with why
_ONLY = {
    "pipeline_parallel_size": (int, 1, "pipeline parallelism is not supported; use --tensor-parallel-size"),
    "cpu_offload_gb": (float, 0.0, "weight offload to the CPU is not supported"),
    "response_role": (str, "assistant", "replies always have the role 'assistant'"),
    "chat_template_content_format": (str, "string", "message content reaches the template as a string"),
    "tokenizer_mode": (str, "hf", "only the Hugging Face tokenizer of the model is supported"),
    "load_format": (str, "auto", "the format is read from the model's files"),
    "guided_decoding_backend": (str, "xgrammar", "structured outputs use xgrammar"),
}
_ONLY_ALSO = {"chat_template_content_format": {"auto"}, "tokenizer_mode": {"auto"},
              "load_format": {"gguf", "safetensors"}, "guided_decoding_backend": {"auto"}}

# flags for features not built yet: refused whatever their value
_REFUSED = {
    "hf_overrides": (str, "overriding the model's config is not supported"),
    "override_generation_config": (str, "generation-config defaults are not applied (see --generation-config)"),
    "revision": (str, "models load from local paths; a hub revision cannot be chosen"),
}


def add_vllm_serve_flags(p: argparse.ArgumentParser) -> None:
    """Add vLLM's serve flags that ``serve`` lacks (checked by ``apply_vllm_serve_flags`` after parsing)."""
    g = p.add_argument_group("vLLM compatibility (vllm serve flags)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                   help="log level (also accepted before the command)")
    g.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None,
                   help="the HTTP server's log level (default: --log-level)")
    g.add_argument("--enable-log-requests", action="store_true", help="log each request's prompt size and settings")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line (--stats-interval 0)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens as 'token_id:N' (a request's field of the same name overrides)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto' (needs --tool-call-parser, as in vLLM)")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="<think>...</think> in outputs goes to reasoning_content (streamed too)")
    g.add_argument("--root-path", default="", help="path prefix the app is mounted under behind a proxy")
    g.add_argument("--allowed-origins", type=json.loads, default=None, help="CORS origins, JSON list (vLLM's)")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key file")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    g.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs (the default here; see --enable-docs)")
    g.add_argument("--tokenizer", default=None, help="accepted when it names the model itself")
    g.add_argument("--generation-config", default="auto",
                   help="vllm: no model defaults; auto: accepted when the model has no sampling defaults")
    g.add_argument("--max-logprobs", type=int, default=20, help="most logprobs a request may ask for (at most 20)")
    g.add_argument("--structured-outputs-config", type=json.loads, default=None,
                   help="JSON; only the xgrammar (or auto) backend")
    if _own_gpu_memory_flag():
        g.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="vLLM's fraction of GPU memory; the KV pool here is sized by --kv-cache-memory or "
                            "--kv-cache-fraction")
    for name, (kind, why) in _INERT.items():
        _add(g, name, kind, f"accepted: {why}")
    for name, (kind, value, why) in _ONLY.items():
        _add(g, name, kind, f"only {value!r}: {why}", default=value)
    for name, (kind, why) in _REFUSED.items():
        _add(g, name, kind, f"refused: {why}")


def _add(g, name: str, kind, helptext: str, default=None) -> None:
    flag = "--" + name.replace("_", "-")
    if kind is None:
        g.add_argument(flag, action="store_true", help=helptext)
    elif kind == "+":
        g.add_argument(flag, nargs="+", default=None, help=helptext)
    else:
        g.add_argument(flag, type=kind, default=default, help=helptext)


def apply_vllm_serve_flags(args: argparse.Namespace) -> None:
    """Check the vLLM flags and map them onto ours, in place; ValueError saying why for one we cannot honour."""
    for name, (_, why) in _REFUSED.items():
        if getattr(args, name) not in (None, False):
            raise ValueError(f"--{name.replace('_', '-')}: {why}")
    for name, (kind, value, why) in _ONLY.items():
        got = getattr(args, name)
        if got != value and got not in _ONLY_ALSO.get(name, ()):
            raise ValueError(f"--{name.replace('_', '-')} {got}: {why}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.disable_fastapi_docs and args.enable_docs:
        raise ValueError("--disable-fastapi-docs conflicts with --enable-docs")
    if args.tokenizer is not None and args.tokenizer != args.model:
        raise ValueError(f"--tokenizer {args.tokenizer}: the tokenizer is always the model's own ({args.model})")
    if not 0 <= args.max_logprobs <= 20:
        raise ValueError(f"--max-logprobs {args.max_logprobs}: must be in [0, 20] (the engine's limit)")
    backend = (args.structured_outputs_config or {}).get("backend", "auto")
    if backend not in ("auto", "xgrammar"):
        raise ValueError(f"--structured-outputs-config backend {backend!r}: structured outputs use xgrammar")
    _check_generation_config(args.generation_config, args.model)
    if args.kv_events_config is not None and KVEventsConfig.from_json(args.kv_events_config).publishes and \
            args.data_parallel_size > 1:
        raise ValueError("--kv-events-config with --data-parallel-size > 1: one event endpoint per replica is not "
                         "supported yet")
    if args.disable_log_stats:
        args.stats_interval = 0
    args.uvicorn_log_level = args.uvicorn_log_level or args.log_level
    if _own_gpu_memory_flag() and args.gpu_memory_utilization is not None and \
            not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]")


def _own_gpu_memory_flag() -> bool:
    """Whether this module adds --gpu-memory-utilization (until EngineArgs has the field, issue 29)."""
    return "gpu_memory_utilization" not in {f.name for f in dataclasses.fields(EngineArgs)}


def log_vllm_serve_notes(args: argparse.Namespace) -> None:
    """Say once, at start, what each accepted vLLM flag means here (they are never silently dropped)."""
    if args.command != "serve":
        return
    for name, (_, why) in _INERT.items():
        if getattr(args, name) not in (None, False):
            log.info("--%s: %s", name.replace("_", "-"), why)
    if _own_gpu_memory_flag() and args.gpu_memory_utilization is not None:
        log.info("--gpu-memory-utilization %s: the KV pool is sized by --kv-cache-memory / --kv-cache-fraction",
                 args.gpu_memory_utilization)


def _check_generation_config(value: str, model: str | None) -> None:
    """vLLM's ``auto`` applies the model's sampling defaults, which this server does not: accepted only when
    the model has none (a GGUF file, or a folder whose generation_config.json sets none)."""
    if value == "vllm":
        return
    if value != "auto":
        raise ValueError(f"--generation-config {value}: only 'vllm' or 'auto' (no sampling defaults are read)")
    path = os.path.join(model, "generation_config.json") if model and os.path.isdir(model) else None
    if path is None or not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        defaults = sorted(set(json.load(f)) & set(GENERATION_DEFAULT_KEYS))
    if defaults:
        raise ValueError(f"--generation-config auto: the model's generation_config.json sets {', '.join(defaults)}, "
                         "which this server does not apply; pass --generation-config vllm")


def resolve_cli_dtypes(args: argparse.Namespace) -> None:
    """vLLM's dtype names mapped to ours, in place; float16 runs only on CUDA (the CPU kernels take float32 or
    bfloat16), so on the CPU it is refused here, at parse time, rather than when the engine starts."""
    from pagedllm.config.device import resolve_device

    given, args.dtype = args.dtype, DTYPE_ALIASES.get(args.dtype, args.dtype)
    args.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(args.kv_cache_dtype, args.kv_cache_dtype)
    if args.dtype in ("float16", "fp16") and resolve_device(args.device).type == "cpu":
        raise ValueError(f"--dtype {given}: float16 needs a CUDA device; on the CPU use bfloat16 or float32")
