"""``pagedllm bench serve --baselines vllm``: our ``pagedllm serve`` and vLLM's CPU OpenAI server under the
same Poisson load, one after the other in one run.

Both servers get the same weights (vLLM the HF directory the loader converts the embedded GGUF into), the same
``--max-model-len`` and served model name, and the same requests: W1-shaped streaming
completions of Wikipedia text (``ignore_eos``, greedy unless ``--sampling chat``), sent at seeded Poisson arrival
times at each rate (a light one and a saturating one). Each rate has its own prompts, so the second rate on a server
is no prefix-cache replay of the first. Never both servers at once (2 cores): per round one server starts, is warmed
up, serves every rate, and stops; the other follows; the order alternates across rounds (ours first in even rounds).
``--quick`` (the CI smoke test; CI has no vLLM) runs our server only on a tiny workload.

Beside the timings: each load's bounds (the arrival ceiling, and its requests' floor at the cores' peak from a
roofline measured in the run, unless ``--no-roofline``), and the CPU seconds of each server's HTTP process, its
engine and this client while a rate is served. On a machine whose cores all run the engine's threads, the others'
CPU time is time the engine's thread team stalls.

Dtypes as in ``bench throughput``: our server gets ``--dtype`` as given, so ``auto`` runs what our ``auto`` picks
(on a CPU with native bf16 and a GGUF model: ``gguf-bf16``, bf16 GEMMs from ``BF16_MIN_ROWS`` = 2 rows on, a bf16
KV pool and batch-1 decode steps from the exact blocks), and vLLM gets the dtype ``auto``
resolves to (bf16 there), its own choice for that model. Before session 13 both got the resolved dtype, which held
ours to dense bf16 weights: batch-1 decode then streamed 2.8x the bytes and its ITL was vLLM's, not half of it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

from pagedllm.bench.common import ratio
from pagedllm.bench.report import Report, Table
from pagedllm.bench.serve_http import drive
from pagedllm.bench.serve_procs import (
    cpu_seconds,
    cpu_split,
    free_port,
    launch,
    pagedllm_serve_command,
    stop_server,
)
from pagedllm.bench.serve_split import scrape, split
from pagedllm.bench.serve_stats import summarize
from pagedllm.bench.workloads import CHAT_SAMPLING, GREEDY, BenchRequest, random_requests

OURS, VLLM = "pagedllm serve", "vLLM CPU serve"
SERVED_NAME = "smollm2"
METRICS = ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
SPLIT = ("client", "ttft", "before_core", "queue", "prefill", "outside")  # serve_split.split's means, ms
CPU_PARTS = ("front_end", "engine", "client")  # CPU seconds while a rate is served (serve_procs.cpu_split)
SAMPLING = {"greedy": GREEDY, "chat": CHAT_SAMPLING}  # --sampling -> the completions' sampling fields


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baselines", choices=("none", "vllm"), default="none",
                   help="vllm: our HTTP server against vLLM's CPU OpenAI server ($PAGEDLLM_VLLM_PYTHON) on W1-shaped "
                        "streaming completions at --rates, instead of the in-process systems")
    p.add_argument("--rates", default=None, help="with --baselines vllm: Poisson rates, req/s (default 2,16)")
    p.add_argument("--rounds", type=int, default=None, help="with --baselines vllm: rounds, order alternating "
                                                           "(default 2; quick 1)")
    p.add_argument("--prompt-len", default=None, help="with --baselines vllm: prompt tokens LO-HI (default 32-512)")
    p.add_argument("--output-range", default=None, help="with --baselines vllm: output tokens LO-HI (default 16-256)")
    p.add_argument("--max-model-len", type=int, default=2048, help="with --baselines vllm: both servers' limit")
    p.add_argument("--no-roofline", action="store_true",
                   help="with --baselines vllm: skip measuring this CPU's roofline (~10 s) for each load's floor")
    p.add_argument("--sampling", choices=tuple(SAMPLING), default="greedy",
                   help="with --baselines vllm: the requests' sampling fields: greedy (default), or chat: "
                        + ", ".join(f"{k} {v}" for k, v in SAMPLING["chat"].items()))


def settings(args) -> dict:
    """The run's workload settings, ``--quick`` sizes where a flag is not given; ValueError names a bad flag."""
    q = args.quick

    def span(flag: str, s: str) -> tuple[int, int]:
        try:
            lo, hi = (int(x) for x in s.split("-"))
        except ValueError:
            raise ValueError(f"{flag} expects LO-HI token counts, e.g. 32-512; got {s!r}") from None
        if not 1 <= lo <= hi:
            raise ValueError(f"{flag} needs 1 <= LO <= HI, got {s!r}")
        return lo, hi

    try:
        rates = [float(x) for x in (args.rates or "2,16").split(",")]
    except ValueError:
        raise ValueError(f"--rates expects comma-separated req/s, e.g. 2,16; got {args.rates!r}") from None
    if not all(r > 0 for r in rates):
        raise ValueError(f"--rates must be positive, got {args.rates!r}")
    return {"num_requests": args.num_requests or (6 if q else 64), "rates": rates,
            "rounds": args.rounds or (1 if q else 2),
            "prompt_len": span("--prompt-len", args.prompt_len or ("8-48" if q else "32-512")),
            "output_len": span("--output-range", args.output_range or ("4-16" if q else "16-256")),
            "sampling": args.sampling}


def workload(tokenizer, cfg: dict, k: int, seed: int) -> tuple[list[BenchRequest], list[float]]:
    """Rate ``k``'s requests (prompts of their own) and Poisson arrival offsets (s)."""
    reqs = random_requests(tokenizer, cfg["num_requests"], cfg["prompt_len"], cfg["output_len"], seed + 1000 * k)
    rng, t, arrivals = random.Random(seed + k), 0.0, []
    for _ in reqs:
        arrivals.append(t)
        t += rng.expovariate(cfg["rates"][k])
    return reqs, arrivals


def arrival_ceiling(reqs: list[BenchRequest], arrivals: list[float]) -> float | None:
    """The most output tok/s any server can show on this load: its tokens over the time the last request arrives
    (the run's wall clock is at least that long). At a light rate it is the target's floor, not the server."""
    return sum(r.max_tokens for r in reqs) / arrivals[-1] if arrivals and arrivals[-1] > 0 else None


def vllm_serve_command(py: str, model_dir: str, port: int, dtype: str, max_model_len: int, seed: int) -> list[str]:
    """``vllm serve`` from vLLM's own venv (the ``vllm`` script next to ``py``) on the same weights and limits."""
    return [os.path.join(os.path.dirname(py), "vllm"), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
            "--served-model-name", SERVED_NAME, "--uvicorn-log-level", "warning"]


def vllm_server_env(py: str, threads: int) -> dict[str, str]:
    """The bench's vLLM CPU environment (thread binding, KV space, preloads), offline, without our tree."""
    from pagedllm.bench.baselines import vllm_env

    env = {**vllm_env(py, threads), "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)  # vLLM's venv must not import our checkout
    return env


def ours_format(args) -> str:
    """What our server computes in under ``args.dtype`` and ``--engine quantization`` (a roofline format name,
    resolved as the worker and the model resolve it)."""
    from pagedllm.bench.roofline import format_of
    from pagedllm.config.args import EngineArgs
    from pagedllm.config.device import DeviceConfig
    from pagedllm.models.loader import has_gguf_blocks
    from pagedllm.models.quant import kernel_available, resolve_auto

    blocks = has_gguf_blocks()
    asked = EngineArgs(dtype=args.dtype, quantization=str(args.engine_args.get("quantization", "auto")), device="cpu")
    r = DeviceConfig.from_args(asked, gguf_blocks=lambda: blocks and kernel_available())
    return format_of(r.dtype, resolve_auto(r.quantization, blocks, r.dtype))


def start(system: str, args, dtype: str, vllm_py: str | None):
    """``system``'s server started on a free port: (process or None, status, base URL). vLLM runs ``dtype``
    (resolved), ours ``args.dtype`` as given."""
    import torch

    from pagedllm.models.loader import resolve_model_dir

    port = free_port()
    log = os.path.join(args.out, f"serve_{'vllm' if system == VLLM else 'pagedllm'}_server.log")
    if system == VLLM:
        cmd = vllm_serve_command(vllm_py, resolve_model_dir(), port, dtype, args.max_model_len, args.seed)
        proc, status = launch(cmd, port, log, vllm_server_env(vllm_py, torch.get_num_threads()), timeout=900)
    else:
        extra = ("--served-model-name", SERVED_NAME, "--max-model-len", str(args.max_model_len))
        proc, status = launch(pagedllm_serve_command(args, port, extra, args.dtype), port, log, timeout=300)
    return proc, status, f"http://127.0.0.1:{port}"


def serve_round(system: str, args, cfg: dict, dtype: str, vllm_py: str | None, loads: list, warm) -> list[dict]:
    """One server up, warmed up, every rate served in turn; a record per rate (or one saying why none ran)."""
    print(f"bench serve: starting {system}...", file=sys.stderr, flush=True)
    proc, status, url = start(system, args, dtype, vllm_py)
    if proc is None:
        return [{"system": system, "skipped": status}]
    out = []
    try:
        asyncio.run(drive(url, SERVED_NAME, warm, [0.0] * len(warm)))
        for k, (reqs, arrivals) in enumerate(loads):
            # the client's CPU (this process, every thread): the load generator shares the cores too
            before, cpu0, client0 = scrape(url), cpu_seconds(proc), time.process_time()
            results, wall = asyncio.run(drive(url, SERVED_NAME, reqs, arrivals, sampling=SAMPLING[cfg["sampling"]]))
            cpu1, client = cpu_seconds(proc), time.process_time() - client0
            stats = summarize(results, wall, {})
            cpu = None if cpu0 is None else {**cpu_split(proc.pid, cpu0, cpu1), "client": client}
            out.append({"system": system, "rate": cfg["rates"][k], "load": os.getloadavg()[0], **stats,
                        "split": split(before, scrape(url), stats["ttft_s"]), "cpu": cpu})
            a = out[-1]["all"]
            print(f"  {cfg['rates'][k]} req/s: {out[-1]['tok_s']:.1f} out tok/s, TTFT p50 {a['ttft_p50'] or 0:.0f} ms, "
                  f"p99 {a['ttft_p99'] or 0:.0f} ms, {out[-1]['failed']} failed", file=sys.stderr, flush=True)
    finally:
        stop_server(proc)
    return out


def load_floors(cfg: dict, loads: list, fmt: str, quick: bool) -> dict[str, float | None]:
    """Per rate: the floor at the cores' peak of its requests in ``fmt`` (``bench roofline``'s rates, measured
    here; prompts and outputs as sent: ``ignore_eos`` makes every output its ``max_tokens``)."""
    from pagedllm.bench import roofline

    print("bench serve: measuring this CPU's roofline...", file=sys.stderr, flush=True)
    roof = roofline.measure(quick)
    return {str(rate): roofline.load_floor_tok_s(roof, fmt, [len(r.prompt_ids) for r in reqs],
                                                 [r.max_tokens for r in reqs])
            for rate, (reqs, _) in zip(cfg["rates"], loads)}


def run(args) -> Report:
    from pagedllm.bench.baselines import vllm_python
    from pagedllm.config.device import resolve_dtype
    from pagedllm.models.loader import load_tokenizer

    os.makedirs(args.out, exist_ok=True)
    cfg = settings(args)
    dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    tokenizer = load_tokenizer()
    loads = [workload(tokenizer, cfg, k, args.seed) for k in range(len(cfg["rates"]))]
    cfg["ceilings"] = {str(rate): arrival_ceiling(*load) for rate, load in zip(cfg["rates"], loads)}
    ours = ours_format(args)
    cfg["floors"] = {} if args.no_roofline else load_floors(cfg, loads, ours, args.quick)
    warm = random_requests(tokenizer, 2, (16, 48), (4, 4), args.seed + 7)
    vllm_py = None if args.quick else vllm_python()
    systems = [OURS] + ([VLLM] if vllm_py else [])
    runs: list[dict] = []
    for rnd in range(cfg["rounds"]):
        for system in systems if rnd % 2 == 0 else systems[::-1]:
            runs += [{**r, "round": rnd} for r in serve_round(system, args, cfg, dtype, vllm_py, loads, warm)]
    why_not = ("--quick runs our server only" if args.quick else None if vllm_py else
               "vLLM CPU not installed (set PAGEDLLM_VLLM_PYTHON=/opt/vllm-venv/bin/python)")
    return report(runs, cfg, dtype, why_not, f"--dtype {args.dtype}: {ours}")


def metric(run: dict, m: str) -> float | None:
    return run["tok_s"] if m == "tok_s" else run["all"][m]


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def means(runs: list[dict]) -> dict:
    """{system: {rate: {metric: mean over rounds, completed, failed}}} of the runs that ran."""
    out: dict = {}
    for r in runs:
        if "skipped" not in r:
            out.setdefault(r["system"], {}).setdefault(str(r["rate"]), []).append(r)
    return {s: {rate: {**{m: mean(metric(x, m) for x in rs) for m in METRICS},
                       "split": {p: mean(x["split"][p] for x in rs if "split" in x) for p in SPLIT},
                       "cpu": {p: mean(x["cpu"][p] for x in rs if x.get("cpu")) for p in CPU_PARTS},
                       "wall_s": mean(x.get("wall_s") for x in rs),
                       "completed": sum(x["completed"] for x in rs), "failed": sum(x["failed"] for x in rs)}
                for rate, rs in by_rate.items()} for s, by_rate in out.items()}


def report(runs: list[dict], cfg: dict, dtype: str, why_not: str | None, ours: str) -> Report:
    avg = means(runs)
    rows, ratio_rows = [], []
    for rate in map(str, cfg["rates"]):
        for s in (OURS, VLLM):
            if (m := avg.get(s, {}).get(rate)) is not None:
                rows.append([rate, s, m["completed"], m["failed"], *(m[k] for k in METRICS)])
        if (o := avg.get(OURS, {}).get(rate)) and (v := avg.get(VLLM, {}).get(rate)):
            ratio_rows.append([rate, *(ratio(o[k], v[k]) for k in METRICS),
                               ratio(cfg.get("ceilings", {}).get(rate), v["tok_s"])])
    cols = ["req/s", "system", "done", "failed", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    tables = [Table(cols, rows, f"Serving under Poisson load (means over {cfg['rounds']} round(s))", 1)]
    if ratio_rows:
        tables.append(Table(["req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                             "arrival ceiling / vLLM"], ratio_rows,
                            "pagedllm / vLLM (target: tok/s >= 1.5, TTFT <= 1)", 2))
    tables.append(Table(["req/s", "system", "client TTFT", "server TTFT", "before core", "queue", "prefill",
                         "outside server"],
                        [[rate, s, *(avg[s][rate]["split"][p] for p in SPLIT)] for rate in map(str, cfg["rates"])
                         for s in (OURS, VLLM) if rate in avg.get(s, {})],
                        "Where a first token's time goes (means, ms; the servers' /metrics)", 1))
    floors = cfg.get("floors") or {}
    if any(floors.values()):
        tables.append(Table(["req/s", "arrival ceiling", "floor at the cores' peak", "1.5x vLLM", "1.5x vLLM / floor",
                             "pagedllm / floor", "vLLM / floor"],
                            [floor_row(rate, cfg, avg) for rate in map(str, cfg["rates"]) if floors.get(rate)],
                            "Each load's bounds (out tok/s): no server beats either", 2))
    cpu_rows = [[rate, s, *(avg[s][rate]["cpu"][p] for p in CPU_PARTS), avg[s][rate]["wall_s"]]
                for rate in map(str, cfg["rates"]) for s in (OURS, VLLM)
                if rate in avg.get(s, {}) and avg[s][rate]["cpu"]["engine"] is not None]
    if cpu_rows:
        tables.append(Table(["req/s", "system", "front end CPU s", "engine CPU s", "client CPU s", "wall s"], cpu_rows,
                            "CPU seconds while each rate is served (means)", 1))
    tables.append(Table(["round", "req/s", "system", "load", "out tok/s", "TTFT p50 ms", "TTFT p99 ms"],
                        [[r["round"], str(r["rate"]), r["system"], r["load"], r["tok_s"], r["all"]["ttft_p50"],
                          r["all"]["ttft_p99"]] for r in runs if "skipped" not in r], "Per round, in run order", 1))
    n, (plo, phi), (olo, ohi) = cfg["num_requests"], cfg["prompt_len"], cfg["output_len"]
    sampling = cfg.get("sampling", "greedy")
    fields = ", ".join(f"{k} {v}" for k, v in SAMPLING[sampling].items())
    notes = [f"{n} streaming /v1/completions per rate (prompts {plo}-{phi} tokens of Wikipedia text, {olo}-{ohi} "
             f"output tokens, {sampling} sampling ({fields}), ignore_eos), Poisson arrivals at "
             f"{', '.join(map(str, cfg['rates']))} req/s; "
             f"vLLM dtype {dtype}, ours {ours} (each engine's choice for that dtype, as in bench throughput); "
             "servers one at a time, order alternating across rounds.",
             "Client-side timing: TTFT = send -> first text chunk; ITL = gaps between text chunks; out tok/s = the "
             "servers' completion_tokens / (first send -> last end). Arrival ceiling: the requests' output tokens "
             "over the last arrival's offset, the most out tok/s any server can show on that load "
             f"({', '.join(f'{r} req/s: {c:.1f}' for r, c in cfg.get('ceilings', {}).items() if c)}).",
             "TTFT split, from each server's vllm:* histograms: server TTFT = its arrival stamp -> first token = "
             "before core (-> its core takes the request in; ours stamps arrival there) + queue (-> first "
             "scheduled) + prefill (-> first token); outside server = client TTFT - server TTFT (HTTP, parsing, "
             "tokenizing, the first token's hand-back, detokenizing, SSE)."]
    if any(floors.values()):
        notes.append("Floor at the cores' peak: the rate's requests' FLOPs at this CPU's instruction peak for our "
                     "format's arithmetic (or its best GEMM path, where faster), decode attention at its K/V reads "
                     "at the read bandwidth where they outlast its FLOPs (bench roofline, measured in this run); no "
                     "norms, sampling, scheduling, HTTP.")
    if cpu_rows:
        notes.append("CPU seconds: the server's own process (HTTP, tokenizing, detokenizing, SSE), its descendants "
                     "(the engine core), and this bench's client, from the send of the first request to the end of "
                     "the last. On a machine whose cores all run the engine's threads, any other process's CPU "
                     "time stalls the engine's thread team for about as long.")
    if any("skipped" not in r and r.get("cpu") is None for r in runs):
        notes.append("CPU seconds not measured: psutil is not installed")
    notes += [f"{r['system']} round {r['round']}: not run: {r['skipped']}" for r in runs if "skipped" in r]
    if why_not:
        notes.append(f"vLLM not run: {why_not}")
    errors = {f"{r['system']} @ {r['rate']}": r["errors"] for r in runs if r.get("errors")}
    if errors:
        notes.append(f"errors: {errors}")
    res = {"mode": "vllm", "dtype": dtype, "ours": ours, **cfg, "runs": runs, "mean": avg,
           "ratios": {r[0]: dict(zip((*METRICS, "ceiling"), r[1:])) for r in ratio_rows}}
    return Report("serve", "Serving: pagedllm serve vs vLLM's CPU server under Poisson load", notes, tables, res)


def floor_row(rate: str, cfg: dict, avg: dict) -> list:
    """A rate's bounds and how near each server and the 1.5x target come to its floor."""
    floor = cfg["floors"][rate]
    ours, vllm = (avg.get(s, {}).get(rate, {}).get("tok_s") for s in (OURS, VLLM))
    target = 1.5 * vllm if vllm else None
    return [rate, cfg.get("ceilings", {}).get(rate), floor, target, ratio(target, floor), ratio(ours, floor),
            ratio(vllm, floor)]


def load_bound(result: dict, rate: str) -> float | None:
    """The most out tok/s any server can show on a rate's load: the lower of its arrival ceiling and its floor at
    the cores' peak (None without a floor)."""
    floor, ceiling = result.get("floors", {}).get(rate), result.get("ceilings", {}).get(rate)
    return min(floor, ceiling) if floor and ceiling else floor


def plot(fig, result: dict) -> None:
    rates = [str(r) for r in result["rates"]]
    systems = [s for s in (OURS, VLLM) if s in result["mean"]]
    w = 0.8 / max(1, len(systems))
    for i, (metric, label) in enumerate((("tok_s", "output tok/s"), ("ttft_p50", "TTFT p50 (ms)"),
                                         ("ttft_p99", "TTFT p99 (ms)"))):
        ax = fig.add_subplot(1, 3, i + 1)
        for j, s in enumerate(systems):
            ax.bar([x + (j - (len(systems) - 1) / 2) * w for x in range(len(rates))],
                   [result["mean"][s].get(r, {}).get(metric) or 0 for r in rates], w, label=s)
        if metric == "tok_s":
            bounds = [(x, b) for x, r in enumerate(rates) if (b := load_bound(result, r))]
            if bounds:
                ax.scatter(*zip(*bounds), marker="_", s=900, color="black", label="load's bound")
        ax.set_xticks(range(len(rates)), [f"{r} req/s" for r in rates], fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=6)
