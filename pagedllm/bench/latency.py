"""``pagedllm bench latency``: seed 003's latency demo plus a Poisson serving run against the server.

Part 1: 8 short/long prompts, at most 4 running, EOS honoured, cap 128 tokens: each request's time
(arrival -> finished) under static (naive) batching vs continuous batching, and the speedup.
Part 2: ``pagedllm serve`` started as a subprocess on 127.0.0.1; requests from a seeded Poisson
process stream from ``/v1/completions``; TTFT and inter-token latency p50/p99 (bounded count and time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import time

from tqdm.auto import tqdm

from pagedllm.bench.common import engine_warmup, make_llm, percentile, ratio, run_engine
from pagedllm.bench.report import Report, Table
from pagedllm.bench.serve_procs import free_port as _free_port
from pagedllm.bench.serve_procs import launch, pagedllm_serve_command, stop_server
from pagedllm.bench.workloads import (
    LATENCY_DEMO_PROMPTS,
    BenchRequest,
    chat_request_ids,
    corpus,
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None, help="demo cap (seed 003: 128; quick 16)")
    p.add_argument("--rate", type=float, default=None, help="serving: Poisson request rate, req/s (default 1.0)")
    p.add_argument("--num-requests", type=int, default=None, help="serving: requests (default 40; quick 4)")
    p.add_argument("--serve-time", type=float, default=None, help="serving: time limit in s (default 180)")
    p.add_argument("--no-serve", action="store_true", help="skip the serving run")


def _short(s: str, n: int = 34) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def demo(args) -> tuple[list[list], dict]:
    cap = args.max_tokens or (16 if args.quick else 128)
    base = {"max_num_seqs": 4, **args.engine_args}
    out = {}
    lens = None
    for mode in ("static", "continuous"):
        llm = make_llm(args.dtype, seed=args.seed, batching=mode, **base)
        ids = chat_request_ids(llm.engine.tokenizer, LATENCY_DEMO_PROMPTS)
        engine_warmup(llm)
        r = run_engine(llm, [BenchRequest(p, cap) for p in ids], ignore_eos=False, desc=f"demo {mode}")
        out[mode] = {"latency_s": r.latency_s, "ttft_s": r.ttft_s, "output_lens": r.output_lens, "elapsed_s": r.elapsed_s}
        lens = r.output_lens
        del llm
    rows = []
    for i, p in enumerate(LATENCY_DEMO_PROMPTS):
        s, c = out["static"]["latency_s"][i], out["continuous"]["latency_s"][i]
        rows.append([i, _short(p), 1000 * s, 1000 * c, lens[i], ratio(s, c)])
    out["cap"] = cap
    return rows, out


# ------------------------------------------------------------------------------- serving run
def start_server(args, port: int, timeout: float = 240.0) -> tuple[subprocess.Popen | None, str]:
    """``pagedllm serve`` for this bench, its log in ``--out``/latency_server.log."""
    return launch(pagedllm_serve_command(args, port), port, os.path.join(args.out, "latency_server.log"),
                  timeout=timeout)


async def _one(client, url: str, prompt: list[int], max_tokens: int, deadline: float, model: str | None) -> dict:
    body = {"model": model or "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    t0 = time.monotonic()
    times: list[float] = []
    err = None
    try:
        async with client.stream("POST", url, json=body, timeout=max(5.0, deadline - t0)) as resp:
            if resp.status_code != 200:
                err = f"HTTP {resp.status_code}: {(await resp.aread())[:160]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        ch = json.loads(data)
                    except ValueError:
                        continue
                    if any(c.get("text") for c in ch.get("choices", [])):
                        times.append(time.monotonic())
                    if time.monotonic() > deadline:
                        err = "deadline"
                        break
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"[:160]
    ttft = times[0] - t0 if times else None
    itl = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": ttft, "itl": itl, "chunks": len(times), "error": err, "e2e": (times[-1] - t0) if times else None}


async def _drive(port: int, reqs: list[BenchRequest], rate: float, limit_s: float, seed: int) -> tuple[list[dict], float]:
    import httpx

    rng = random.Random(seed)
    url = f"http://127.0.0.1:{port}/v1/completions"
    t_start = time.monotonic()
    deadline = t_start + limit_s
    bar = tqdm(total=len(reqs), desc="serving", unit="req", leave=False)
    async with httpx.AsyncClient(timeout=None) as client:
        # discover the served model name
        try:
            models = (await client.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"]
            model = models[0]["id"]
        except Exception:  # noqa: BLE001
            model = None
        tasks = []

        async def launch(r: BenchRequest):
            res = await _one(client, url, r.prompt_ids, r.max_tokens, deadline, model)
            bar.update(1)
            return res

        for r in reqs:
            if time.monotonic() >= deadline:
                break
            tasks.append(asyncio.create_task(launch(r)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    bar.close()
    return list(results), time.monotonic() - t_start


def serving(args, tokenizer) -> tuple[list[list], dict, list[str]]:
    rate = args.rate or (2.0 if args.quick else 1.0)
    n = args.num_requests or (4 if args.quick else 40)
    limit = args.serve_time or (90.0 if args.quick else 180.0)
    rng = random.Random(args.seed + 5)
    c = corpus(tokenizer, args.seed)
    plo, phi, olo, ohi = (8, 32, 4, 8) if args.quick else (32, 256, 32, 64)
    reqs = [BenchRequest(c.window(rng.randint(plo, phi), rng), rng.randint(olo, ohi)) for _ in range(n)]
    port = _free_port()
    proc, status = start_server(args, port)
    if proc is None:
        return [], {"skipped": status}, [f"serving run skipped: {status}"]
    try:
        results, wall = asyncio.run(_drive(port, reqs, rate, limit, args.seed))
    finally:
        stop_server(proc)
    ok = [r for r in results if r["error"] is None and r["ttft"] is not None]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    toks = sum(r["chunks"] for r in results)
    rows = [["TTFT (ms)", 1000 * percentile(ttft, 50) if ttft else None, 1000 * percentile(ttft, 99) if ttft else None,
             1000 * sum(ttft) / len(ttft) if ttft else None],
            ["inter-token (ms)", 1000 * percentile(itl, 50) if itl else None, 1000 * percentile(itl, 99) if itl else None,
             1000 * sum(itl) / len(itl) if itl else None]]
    info = {"rate": rate, "sent": len(results), "completed": len(ok), "wall_s": wall, "stream_chunks": toks,
            "errors": [r["error"] for r in results if r["error"]][:5], "ttft_s": ttft, "prompt_range": (plo, phi),
            "output_range": (olo, ohi), "limit_s": limit}
    notes = [f"Serving: `pagedllm serve` subprocess on 127.0.0.1, {len(results)} requests sent with Poisson arrivals at "
             f"{rate} req/s (seeded), prompts {plo}-{phi} tokens of Wikipedia text, {olo}-{ohi} output tokens "
             f"(ignore_eos), streamed /v1/completions; {len(ok)} completed in {wall:.0f} s (limit {limit:.0f} s)."]
    return rows, info, notes


def run(args) -> Report:
    from pagedllm.config.device import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    rows, demo_res = demo(args)
    notes = [f"Demo: seed 003's 8 prompts (short/long interleaved, chat template), at most 4 running, greedy, EOS "
             f"honoured, cap {demo_res['cap']} tokens; dtype {dtype}; time = arrival -> finished (all arrive at t0)."]
    tables = [Table(["seq", "prompt", "static ms", "cont ms", "tokens", "speedup"], rows, "Latency demo", 1)]
    res = {"demo": demo_res}
    if not args.no_serve:
        from pagedllm.models.loader import load_checkpoint

        os.makedirs(args.out, exist_ok=True)
        srows, sinfo, snotes = serving(args, load_checkpoint(None).tokenizer)
        notes += snotes
        res["serving"] = sinfo
        if srows:
            tables.append(Table(["metric", "p50", "p99", "mean"], srows, "Serving run (Poisson arrivals)", 1))
    else:
        notes.append("serving run skipped (--no-serve)")
    mean_s = sum(r[2] for r in rows) / len(rows)
    mean_c = sum(r[3] for r in rows) / len(rows)
    notes.append(f"mean per-request time: static {mean_s:.0f} ms, continuous {mean_c:.0f} ms "
                 f"({mean_s / mean_c:.2f}x)")
    res["mean_speedup"] = mean_s / mean_c
    return Report("latency", "Static vs continuous batching latency; serving TTFT/ITL", notes, tables, res)


def plot(fig, result: dict) -> None:
    d = result["demo"]
    ax = fig.add_subplot(121)
    n = len(d["static"]["latency_s"])
    xs = list(range(n))
    w = 0.4
    ax.bar([x - w / 2 for x in xs], [v * 1000 for v in d["static"]["latency_s"]], w, label="static")
    ax.bar([x + w / 2 for x in xs], [v * 1000 for v in d["continuous"]["latency_s"]], w, label="continuous")
    ax.set_xlabel("request (even = short prompt)")
    ax.set_ylabel("time to finish (ms)")
    ax.legend(fontsize=7)
    ax.set_title("latency demo", fontsize=9)
    ax2 = fig.add_subplot(122)
    s = result.get("serving") or {}
    if s.get("ttft_s"):
        ax2.hist([v * 1000 for v in s["ttft_s"]], bins=20, color="tab:orange")
        ax2.set_xlabel("TTFT (ms)")
        ax2.set_title(f"serving @ {s['rate']} req/s", fontsize=9)
    else:
        ax2.text(0.5, 0.5, "no serving run", ha="center")
        ax2.set_axis_off()
