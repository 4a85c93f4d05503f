"""``pagedllm bench <name>``: each bench prints a Markdown table and writes JSON + PNG into ``--out``.

Common flags: ``--quick`` (tiny CI-sized workload), ``--out DIR`` (default ``bench_out/``),
``--dtype`` (default ``auto``: bf16 only where the CPU has fast bf16, else fp32; every system in a run
uses the same dtype), ``--seed``, ``--engine KEY=VALUE`` (repeatable EngineArgs override).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time

BENCHES = {
    "throughput": "offline W1 workload vs HF generate (Dynamic/StaticCache), HF generate_batch, llama.cpp, vLLM",
    "sweep": "batch sizes 1..64 of one prompt: total tok/s, ms/tok, TTFT, peak memory",
    "waste": "naive (padded) batching waste on seed 003's four prompts vs continuous batching",
    "latency": "static vs continuous per-request latency; Poisson serving run against the server",
    "memory": "KV bytes: static vs dynamic vs paged at concurrency 1..32; paged overhead per block size",
    "prefix": "shared system prompt and multi-turn chat: prefix caching on/off, fcfs vs lpm",
    "context": "long context: ms/token vs length to 8k, mixed batch, chat growth; paged vs HF DynamicCache",
    "decode": "decode step time at batch 1/8/32/64 per attention backend vs HF generate",
    "perplexity": "perplexity through the paged path (chunked prefill) vs HF on Wikipedia text",
    "spec": "speculative decoding (ngram / suffix / draft model) vs none: speedup and acceptance, batch 1 and 16",
    "serve": "online serving TTFT/ITL under Poisson arrivals: 1 engine vs 2 Ray replicas (prefix routing on/off) vs P/D; "
             "--baselines vllm: pagedllm serve vs vLLM's CPU server over HTTP",
    "compare": "W1 on this checkout vs a git revision (--rev), alternating fresh processes: the new/old ratio",
    "tp": "W1 at TP=1 (all cores, one process) vs TP=N (cores split between the ranks), alternating",
    "alloc": "block manager microbenchmark",
    "attention": "attention backend microbenchmark",
    "structured": "grammar mask + accept per decode step vs the step itself (JSON schemas, batch 1..64)",
    "kvquant": "int8 / fp8 KV cache vs fp32: tokens per budget, perplexity, decode step at 1k-8k, W1",
    "refusal": "oversized input (10 MB body, 7.9 MB prompt, 100k enum): refusal latency, other clients' TTFT",
    "lora": "multi-LoRA: 1/8/64 adapters (Zipf) mixed in batches vs the base model vs HF + PEFT one at a time",
    "tiers": "KV tiers (host RAM, disk) on multi-turn chat and Zipf RAG: off / L2 / L2+L3 / restart, eviction policies",
    "gpu": "GPU workloads (256 requests, W1 x 1024, batch-1 decode vs the roofline) vs HF generate / generate_batch",
    "steptime": "host time of a decode step by part: schedule, worker prep, forward, sampler, detokenize; --w1: a W1 "
                "run by part (GEMMs by rows, attention decode / prefill, norms, LM head, sampler, Python per step)",
    "threads": "batch-1 decode quiet and beside a busy process: spin 10000 / 1000 adaptive, 10000 / 1000 / 100 fixed",
    "roofline": "measured bandwidth and peak GEMMs (fp32/bf16/int8): the batch-1 and W1 floors per weight format",
    "batch1": "batch-1 decode, wall and CPU ms/token: each path of ours vs the one it replaced vs llama.cpp",
}


def _engine_overrides(items: list[str]) -> dict:
    import dataclasses

    from pagedllm.config.args import EngineArgs

    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"--engine expects KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        k = k.replace("-", "_")
        if k not in fields:
            raise SystemExit(f"unknown engine arg {k!r}; see pagedllm/config/args.py")
        default = fields[k].default
        if isinstance(default, bool) or fields[k].type == "bool | None":
            out[k] = v.lower() in ("1", "true", "yes", "on")
        elif isinstance(default, int) or "int" in str(fields[k].type):  # int | None: block_size, num_blocks, ...
            out[k] = int(float(v))
        elif isinstance(default, float):
            out[k] = float(v)
        else:
            out[k] = v
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm bench", description="pagedllm benchmarks",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(f"  {k:<11} {v}" for k, v in BENCHES.items()))
    sub = parser.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHES) + "}")
    for name, help_ in BENCHES.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--quick", action="store_true", help="tiny workload (CI smoke); numbers are not meaningful")
        p.add_argument("--out", default="bench_out", help="output folder for <name>.md/.json/.png (default bench_out/)")
        p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (same for all systems)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                       help="override an EngineArgs field for our engine (repeatable)")
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
        p.add_argument("--no-plot", action="store_true", help=argparse.SUPPRESS)
        if name in ("alloc", "attention"):
            continue
        try:
            mod = importlib.import_module(f"pagedllm.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"pagedllm.bench.{name}":
                raise
            continue
        if hasattr(mod, "add_args"):
            mod.add_args(p)
    return parser


def run_external(name: str, args) -> object:
    """alloc / attention: their modules expose ``run(quick) -> dict`` and ``to_markdown(result)``."""
    from pagedllm.bench.report import Report

    try:
        mod = importlib.import_module(f"pagedllm.bench.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"pagedllm.bench.{name}":
            raise
        rep = Report(name, f"{name} microbenchmark", [f"pagedllm.bench.{name} is not available in this build; skipped"])
        rep.result = {"skipped": True}
        return rep
    result = mod.run(quick=args.quick)
    rep = Report(name, f"{name} microbenchmark", ["quick run" if args.quick else "full run"])
    rep.result = result
    rep.markdown = mod.to_markdown(result)
    return rep


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.getLogger("pagedllm").setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.engine_args = _engine_overrides(args.engine)
    if args.quick and not {"kv_cache_memory", "num_blocks"} & set(args.engine_args):
        args.engine_args["kv_cache_memory"] = 256 << 20  # tiny runs: skip zeroing a multi-GB pool
    from pagedllm.bench.report import emit
    from pagedllm.config.device import resolve_dtype

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    t0 = time.monotonic()
    if args.bench in ("alloc", "attention"):
        rep, plot = run_external(args.bench, args), None
    else:
        mod = importlib.import_module(f"pagedllm.bench.{args.bench}")
        rep = mod.run(args)
        plot = getattr(mod, "plot", None)
    rep.notes.append(f"bench wall time {time.monotonic() - t0:.0f} s; {os.cpu_count()} CPUs; "
                     f"dtype {resolve_dtype(args.dtype)}{'; --quick' if args.quick else ''}")
    paths = emit(rep, args.out, None if args.no_plot else plot, dtype=str(resolve_dtype(args.dtype)))
    print(f"\nwrote {paths['md']}, {paths['json']}, {paths['png']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
