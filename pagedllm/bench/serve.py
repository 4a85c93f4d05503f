"""``pagedllm bench serve``: online serving latency under Poisson arrivals, in the manner of
``vllm bench serve``, for one engine and for the scale-out layouts on Ray, on the same requests.

The workload mixes long prompts (one of a few shared system prompts of real text, plus a question
of its own) and short ones (a window of text of their own). Requests arrive by a seeded Poisson
process and stream through each system's front end (``AsyncEngine`` / ``ScaleOutEngine``: what
``pagedllm serve`` runs, without HTTP). Per system: TTFT and inter-token latency p50/p99 (for short
and long prompts apart), output throughput, the prefix-cache hit rate, and for prefill/decode the
KV handed over and what moving it cost (export on the prefill replica, transit through Ray's object
store, import on the decode replica).

Systems, one after another on the same machine: one engine (the core in its own process, all
cores); 2 replicas routed least-loaded (no prefix affinity); 2 replicas with prefix-aware routing;
prefill 1 + decode 1. Each Ray replica takes one CPU (and Ray gives it one thread).

``--baselines vllm`` runs ``serve_vllm`` instead: our HTTP server against vLLM's CPU OpenAI server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

from pagedllm.bench import serve_vllm
from pagedllm.bench.common import ratio
from pagedllm.bench.report import Report, Table
from pagedllm.bench.serve_stats import summarize
from pagedllm.bench.workloads import BenchRequest, corpus

SYSTEMS = ("1 engine", "2 replicas, least-loaded", "2 replicas, prefix-aware", "prefill 1 + decode 1")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=None, help="requests per system (default 40; quick 8)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrival rate, req/s (default 1.0; quick 2)")
    p.add_argument("--long-len", type=int, default=None, help="shared system prompt tokens (default 384; quick 96)")
    p.add_argument("--short-len", default=None, help="short prompt token range LO-HI (default 24-64; quick 20-32)")
    p.add_argument("--long-fraction", type=float, default=0.5, help="share of long prompts (default 0.5)")
    p.add_argument("--num-prefixes", type=int, default=4, help="distinct shared system prompts (default 4)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 32; quick 8)")
    serve_vllm.add_args(p)
    p.add_argument("--systems", default=",".join(str(i) for i in range(len(SYSTEMS))),
                   help="which systems to run, by index: " + "; ".join(f"{i}={s}" for i, s in enumerate(SYSTEMS)))


def workload(tokenizer, args) -> tuple[list[BenchRequest], list[float]]:
    """The requests (label ``long``/``short``) and their arrival offsets (s)."""
    q = args.quick
    n = args.num_requests or (8 if q else 40)
    long_len = args.long_len or (96 if q else 384)
    lo, hi = map(int, (args.short_len or ("20-32" if q else "24-64")).split("-"))
    out_len = args.output_len or (8 if q else 32)
    rate = args.rate or (2.0 if q else 1.0)
    rng = random.Random(args.seed)
    text = corpus(tokenizer, args.seed)
    prefixes = [text.window(long_len, rng) for _ in range(args.num_prefixes)]
    reqs, t, arrivals = [], 0.0, []
    for _ in range(n):
        if rng.random() < args.long_fraction:
            reqs.append(BenchRequest(rng.choice(prefixes) + text.window(rng.randint(12, 24), rng), out_len, "long"))
        else:
            reqs.append(BenchRequest(text.window(rng.randint(lo, hi), rng), out_len, "short"))
        arrivals.append(t)
        t += rng.expovariate(rate)
    return reqs, arrivals


async def drive(engine, reqs: list[BenchRequest], arrivals: list[float], tag: str) -> list[dict]:
    """Send each request at its arrival time; per request: TTFT, per-token gaps, tokens, error."""
    from pagedllm.protocol.sampling_params import SamplingParams

    t0 = time.monotonic()

    async def one(i: int, r: BenchRequest) -> dict:
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        start = last = time.monotonic()
        res = {"label": r.label, "ttft": None, "itl": [], "tokens": 0, "error": None}
        try:
            async for out in engine.generate(r.prompt_ids, params, f"{tag}-{i}"):
                now, k = time.monotonic(), len(out.outputs[0].token_ids)
                if k > res["tokens"]:
                    if res["ttft"] is None:
                        res["ttft"] = now - start
                    else:
                        res["itl"] += [(now - last) / (k - res["tokens"])] * (k - res["tokens"])
                    last, res["tokens"] = now, k
        except RuntimeError as e:
            res["error"] = str(e)
        res["end"] = time.monotonic() - t0
        return res

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))))


def start(index: int, eargs):
    """System ``index``'s front end (started, warmed up by the caller)."""
    if index == 0:
        from pagedllm.frontend.async_engine import AsyncEngine

        return AsyncEngine(eargs)
    from pagedllm.scaleout.config import ScaleOutConfig
    from pagedllm.scaleout.engine import ScaleOutEngine

    layout = {1: dict(num_replicas=2, routing="least-loaded"), 2: dict(num_replicas=2, routing="prefix"),
              3: dict(num_prefill=1, num_decode=1)}[index]
    return ScaleOutEngine(eargs, ScaleOutConfig(**layout))


def run(args) -> Report:
    if args.baselines == "vllm":
        return serve_vllm.run(args)
    from pagedllm.config.args import EngineArgs
    from pagedllm.config.device import resolve_dtype
    from pagedllm.models.loader import load_tokenizer

    eargs = EngineArgs(dtype=args.dtype, seed=args.seed, **args.engine_args)
    tokenizer = load_tokenizer(eargs.model)
    reqs, arrivals = workload(tokenizer, args)
    warm = [BenchRequest(corpus(tokenizer, args.seed + 1).window(48, random.Random(i)), 4, "warm") for i in range(2)]
    chosen = [int(s) for s in args.systems.split(",")]
    res: dict = {"systems": {}, "num_requests": len(reqs), "rate": args.rate or (2.0 if args.quick else 1.0),
                 "long": sum(r.label == "long" for r in reqs), "dtype": str(resolve_dtype(args.dtype))}
    for i in chosen:
        name = SYSTEMS[i]
        t0 = time.monotonic()
        engine = start(i, eargs)
        try:
            startup = time.monotonic() - t0
            asyncio.run(drive(engine, warm, [0.0] * len(warm), "warm"))
            before = asyncio.run(engine.stats())
            t1 = time.monotonic()
            results = asyncio.run(drive(engine, reqs, arrivals, "bench"))
            wall = time.monotonic() - t1
            after = asyncio.run(engine.stats())
        finally:
            engine.shutdown()
        delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
        delta["hit_rate"] = delta["hit_tokens"] / delta["query_tokens"] if delta.get("query_tokens") else 0.0
        res["systems"][name] = {**summarize(results, wall, delta), "startup_s": startup}
    return _report(res, args)


def _report(res: dict, args) -> Report:
    rows, rows_split = [], []
    base = res["systems"].get(SYSTEMS[0])
    for name, s in res["systems"].items():
        a = s["all"]
        rows.append([name, s["completed"], a["ttft_p50"], a["ttft_p99"], a["itl_p50"], a["itl_p99"], s["tok_s"],
                     100 * (s["hit_rate"] or 0.0), ratio(a["ttft_p50"], base and base["all"]["ttft_p50"])])
        for label in ("short", "long"):
            p = s[label]
            rows_split.append([name, label, p["n"], p["ttft_p50"], p["ttft_p99"], p["itl_p50"], p["itl_p99"]])
    tables = [Table(["system", "done", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "out tok/s",
                     "prefix hit %", "TTFT p50 / 1 engine"], rows, "Serving latency (all requests)", 1),
              Table(["system", "prompts", "n", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"], rows_split,
                    "Short vs long prompts", 1)]
    moved = [[n, t["handovers"], t["kib_per_handover"], t["export_ms"], t["transit_ms"], t["queue_ms"], t["import_ms"]]
             for n, s in res["systems"].items() if (t := s.get("transfer"))]
    if moved:
        tables.append(Table(["system", "handovers", "KiB each", "export ms", "transit ms", "wait for step ms",
                             "import ms"], moved, "KV moved between replicas (means per handover)", 2))
    notes = [f"{res['num_requests']} requests ({res['long']} long), Poisson arrivals at {res['rate']} req/s "
             f"(seed {args.seed}), greedy, ignore_eos; dtype {res['dtype']}; {os.cpu_count()} CPUs; each Ray replica "
             f"1 CPU (1 thread), the single engine all of them.",
             "TTFT: arrival -> first token seen by the front end; ITL: gaps between streamed tokens. "
             "Startup (s): " + ", ".join(f"{n} {s['startup_s']:.0f}" for n, s in res["systems"].items()) + "."]
    errors = {n: s["errors"] for n, s in res["systems"].items() if s["errors"]}
    if errors:
        notes.append(f"errors: {errors}")
    return Report("serve", "Serving: one engine vs replicas on Ray (prefix routing, prefill/decode)", notes, tables,
                  res)


def plot(fig, result: dict) -> None:
    if result.get("mode") == "vllm":
        return serve_vllm.plot(fig, result)
    ax = fig.add_subplot(111)
    names = list(result["systems"])
    xs = range(len(names))
    w = 0.2
    for k, (label, key) in enumerate((("short TTFT", ("short", "ttft_p50")), ("long TTFT", ("long", "ttft_p50")),
                                      ("ITL", ("all", "itl_p50")))):
        ax.bar([x + (k - 1) * w for x in xs], [result["systems"][n][key[0]][key[1]] or 0 for n in names], w,
               label=f"{label} p50")
    ax.set_xticks(list(xs), [n.replace(", ", "\n") for n in names], fontsize=7)
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
    ax.set_title("serving latency by system", fontsize=9)

