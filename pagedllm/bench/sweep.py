"""``pagedllm bench sweep``: seed 003's first table — batch sizes of one prompt, ours vs HF padded generate."""

from __future__ import annotations

import argparse
import time

from pagedllm.bench import baselines as bl
from pagedllm.bench.common import PeakRSS, engine_warmup, make_llm, ratio, run_engine
from pagedllm.bench.report import Report, Table
from pagedllm.bench.workloads import SWEEP_PROMPT, BenchRequest


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default=None, help="comma list (default 1,2,4,8,16,32,64; quick 1,2,4)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per sequence (default 128; quick 12)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")


def run(args) -> Report:
    from pagedllm.config.device import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    sizes = [int(x) for x in (args.batch_sizes or ("1,2,4" if args.quick else "1,2,4,8,16,32,64")).split(",")]
    new = args.new_tokens or (12 if args.quick else 128)
    extra = {"max_num_seqs": max(sizes)} if max(sizes) > 64 else {}
    llm = make_llm(args.dtype, seed=args.seed, **{**extra, **args.engine_args})
    tok = llm.engine.tokenizer
    ids = tok.encode(SWEEP_PROMPT, add_special_tokens=True)
    engine_warmup(llm)
    hf = None if args.no_hf else bl.hf_model(dtype)
    if hf:
        bl.hf_generate(hf[0], hf[1], [ids], 2)
    rows, res = [], {"batch_sizes": sizes, "new_tokens": new, "pagedllm": {}, "hf_dynamic": {}}
    for b in sizes:
        r = run_engine(llm, [BenchRequest(list(ids), new) for _ in range(b)], desc=f"pagedllm b={b}",
                       measure_memory=True)
        ours = {"total_tok_s": r.output_tok_s, "ms_per_tok": 1000 * sum(r.tpot_s) / len(r.tpot_s),
                "ttft_ms": 1000 * sum(r.ttft_s) / len(r.ttft_s), "peak_mb": r.peak_mb,
                "kv_mb": r.extra["peak_kv_mb"], "elapsed_s": r.elapsed_s}
        res["pagedllm"][b] = ours
        h = None
        if hf:
            model, htok = hf
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                bl.hf_generate(model, htok, [ids] * b, 1)
                t1 = time.perf_counter()
                bl.hf_generate(model, htok, [ids] * b, new)
                t2 = time.perf_counter()
            ttft = t1 - t0
            h = {"total_tok_s": b * new / (t2 - t1), "ms_per_tok": 1000 * max(0.0, (t2 - t1) - ttft) / max(1, new - 1),
                 "ttft_ms": 1000 * ttft, "peak_mb": mem.peak_mb, "elapsed_s": t2 - t1}
            res["hf_dynamic"][b] = h
        rows.append([b, ours["total_tok_s"], ours["ms_per_tok"], ours["ttft_ms"], ours["peak_mb"], ours["kv_mb"],
                     h and h["total_tok_s"], h and h["ms_per_tok"], h and h["ttft_ms"], h and h["peak_mb"],
                     h and ratio(ours["total_tok_s"], h["total_tok_s"])])
    cols = ["batch", "tok/s", "ms/tok (per seq)", "TTFT (ms)", "peak MB", "KV MB",
            "HF tok/s", "HF ms/tok", "HF TTFT (ms)", "HF peak MB", "speedup"]
    notes = [f"Prompt {SWEEP_PROMPT!r} ({len(ids)} tokens) repeated batch times, {new} new tokens each, ignore_eos, "
             f"greedy; dtype {dtype}. Left: pagedllm (continuous batching, paged KV); right: HF generate with "
             "DynamicCache on the same weights/dtype.",
             "peak MB = process RSS growth during the run (sampled every 3 ms; pagedllm's KV pool is preallocated, "
             "so its growth is activations only); KV MB = pagedllm KV blocks in use at the peak."]
    rep = Report("sweep", "Batch-size sweep (seed 003, table 1)", notes, [Table(cols, rows, None, 1)], res)
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(121)
    sizes = result["batch_sizes"]
    for key, label, c in (("pagedllm", "pagedllm", "tab:orange"), ("hf_dynamic", "HF generate", "tab:blue")):
        d = result[key]
        xs = [b for b in sizes if b in d or str(b) in d]
        if not xs:
            continue
        get = lambda b: d.get(b) or d.get(str(b))
        ax.plot(xs, [get(b)["total_tok_s"] for b in xs], marker="o", label=label, color=c)
        fig.axes[0].set_xscale("log", base=2)
        ax2 = fig.axes[1] if len(fig.axes) > 1 else fig.add_subplot(122)
        ax2.plot(xs, [get(b)["ms_per_tok"] for b in xs], marker="o", label=label, color=c)
        ax2.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("total tok/s")
    ax.legend(fontsize=7)
    ax.set_title("throughput", fontsize=9)
    fig.axes[1].set_xlabel("batch size")
    fig.axes[1].set_ylabel("ms/tok per sequence")
    fig.axes[1].set_title("per-sequence latency", fontsize=9)
