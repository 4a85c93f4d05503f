"""``pagedllm bench kvquant``: a quantized KV cache (int8, fp8) against the default one, in the same run.

* capacity: tokens of SmolLM2 that fit in a fixed byte budget (scales counted);
* perplexity on the Wikipedia summaries through the paged path (chunked prefill reading the pool back);
* decode step time of the whole model at batch 1 with 1k / 4k / 8k tokens of context in the pool, with torch's
  thread count and with one;
* W1 throughput through the engine (scaled down unless ``--full``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from pagedllm.attention import AttentionMetadata, default_backend, get_backend, write_kv
from pagedllm.bench.perplexity import paged_nll, wiki_token_ids
from pagedllm.bench.report import Report, Table
from pagedllm.kv.kv_cache import KVCache

DTYPES = ("float32", "int8", "fp8_e4m3", "fp8_e5m2")
DECODE_DTYPES = ("float32", "int8")
BUDGET = 1 << 30


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="1024,4096,8192", help="decode-step context lengths")
    p.add_argument("--full", action="store_true", help="the full W1 workload (default: 16 requests)")
    p.add_argument("--ppl-tokens", type=int, default=8192, help="tokens scored for perplexity")


def capacity(cfg) -> dict[str, int]:
    dims = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16)
    return {d: KVCache.num_blocks_for_budget(BUDGET, *dims, d) * 16 for d in DTYPES}


def fill_pool(kv: KVCache) -> None:
    """Random K/V in every slot (through the write path, so int8 scales are real)."""
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(kv.num_blocks * kv.block_size)
    for i in range(kv.num_layers):
        x = torch.randn(len(slots), 2, kv.num_kv_heads, kv.head_dim, generator=g)
        write_kv(x[:, 0], x[:, 1], *kv.layer(i), slots)


@torch.inference_mode()
def decode_step_ms(model, cfg, backend, dtypes: tuple[str, ...], ctx: int, steps: int) -> dict[str, dict]:
    """Median wall times at batch 1 with ``ctx`` tokens of context, per KV dtype: one decode step of the whole
    model ("step") and the attention of all its layers alone ("attention": one call per layer on that layer's
    pool, so the K/V bytes come from memory as in the step, not from a cache one layer's pool fits in), so the
    share the K/V bytes can move is visible. The dtypes alternate, so the machine's drift falls on all of them
    alike."""
    meta = AttentionMetadata.build([1], [ctx], [list(range(-(-ctx // 16)))], 16)
    pools = {}
    for d in dtypes:
        pools[d] = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, -(-ctx // 16) + 1, 16, dtype=d)
        fill_pool(pools[d])
    tok = torch.tensor([42])
    q = torch.randn(1, cfg.num_heads, cfg.head_dim)
    new_kv = torch.randn(1, cfg.num_kv_heads, cfg.head_dim)
    times: dict[str, dict[str, list[float]]] = {d: {"step": [], "attention": []} for d in dtypes}
    for _ in range(steps + 2):
        for d, kv in pools.items():
            t0 = time.perf_counter()
            model.compute_logits(model(tok, meta.positions, kv, meta, backend))
            t1 = time.perf_counter()
            for i in range(cfg.num_layers):
                backend.forward(q, new_kv, new_kv, *kv.layer(i), meta, cfg.head_dim ** -0.5)
            t2 = time.perf_counter()
            times[d]["step"].append(t1 - t0)
            times[d]["attention"].append(t2 - t1)
    return {d: {k: 1e3 * statistics.median(v[2:]) for k, v in t.items()} for d, t in times.items()}


def decode_rows(model, cfg, backend, contexts: list[int], steps: int) -> list[dict]:
    """:func:`decode_step_ms` for fp32 and int8 at each context, with torch's thread count and with one thread
    (on a shared 2-core machine a second thread often waits for a core, so one thread is the steadier figure),
    each row with the load average it ran under."""
    rows, default = [], torch.get_num_threads()
    try:
        for threads in sorted({default, 1}, reverse=True):
            torch.set_num_threads(threads)
            for ctx in contexts:
                load = os.getloadavg()[0]
                ms = decode_step_ms(model, cfg, backend, DECODE_DTYPES, ctx, steps)
                rows.append({"threads": threads, "context": ctx, "load_1m": load, "ms": ms})
    finally:
        torch.set_num_threads(default)
    return rows


def throughput(dtype: str, full: bool) -> dict:
    from pagedllm.bench.common import engine_warmup, make_llm, run_engine
    from pagedllm.bench.workloads import W1, random_requests

    w = dict(W1) if full else dict(num=16, prompt_range=(32, 256), output_range=(16, 64))
    llm = make_llm("float32", kv_cache_dtype=dtype, kv_cache_memory=BUDGET)  # int8: ~4x the tokens
    reqs = random_requests(llm.engine.tokenizer, w["num"], w["prompt_range"], w["output_range"])
    engine_warmup(llm)
    r = run_engine(llm, reqs, desc=f"W1 kv {dtype}", progress=False)
    return {"workload": w, "output_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s, "seconds": r.elapsed_s}


def run(args) -> Report:
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.models.loader import load_checkpoint

    ckpt = load_checkpoint(None)
    cfg = ckpt.config
    model = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, "auto")
    backend = get_backend(default_backend())
    quick = args.quick
    contexts = [256, 1024] if quick else [int(c) for c in args.contexts.split(",")]
    ppl_tokens, window = (1024, 512) if quick else (args.ppl_tokens, 1024)
    ids = wiki_token_ids(ckpt.tokenizer, ppl_tokens)
    res: dict = {"budget_bytes": BUDGET, "capacity_tokens": capacity(cfg), "backend": backend.name}
    res["bytes_per_token"] = {d: KVCache.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, d) / 16
                              for d in DTYPES}
    res["perplexity"] = {}
    for d in DTYPES:
        kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, -(-window // 16), 16, dtype=d)
        nll, n = paged_nll(model, kv, backend, ids, window, 256)
        res["perplexity"][d] = math.exp(nll / n)
    res["decode"] = decode_rows(model, cfg, backend, contexts, 3 if quick else 40)
    res["throughput"] = {d: throughput(d, args.full) for d in (DECODE_DTYPES if not quick else ())}
    return _report(res)


def _report(r: dict) -> Report:
    cap, ppl = r["capacity_tokens"], r["perplexity"]
    base = ppl["float32"]
    rows = [[d, r["bytes_per_token"][d], cap[d], cap[d] / cap["float32"], ppl[d], 100 * (ppl[d] / base - 1)]
            for d in DTYPES]
    tables = [Table(["kv cache", "bytes/token", f"tokens in {r['budget_bytes'] >> 20} MiB", "x fp32",
                     "perplexity", "ppl delta %"], rows, digits=3)]
    dec = []
    for row in r["decode"]:
        f, i = row["ms"]["float32"], row["ms"]["int8"]
        dec.append([row["threads"], row["context"], f["step"], i["step"], f["step"] / i["step"], f["attention"],
                    i["attention"], f["attention"] / i["attention"], f["attention"] / f["step"], row["load_1m"]])
    tables.append(Table(["threads", "context", "fp32 ms/step", "int8 ms/step", "int8 speedup", "fp32 attention ms",
                         "int8 attention ms", "attention speedup", "attention share of the fp32 step", "load 1m"],
                        dec, digits=2))
    if r["throughput"]:
        t = r["throughput"]
        tables.append(Table(["kv cache", "output tok/s", "total tok/s", "seconds"],
                            [[d, v["output_tok_s"], v["total_tok_s"], v["seconds"]] for d, v in t.items()], digits=1))
    notes = [f"SmolLM2-135M-Instruct (Q4_1 GGUF weights), fp32 activations, attention backend {r['backend']}; "
             "decode: batch 1, whole model, median of alternating fp32 / int8 steps (attention: one call per layer "
             "on its own pool, the same pools), at the given torch thread count, with the 1-minute load average "
             "when each row started; perplexity: Wikipedia summaries, windows of 1024, chunks of 256"]
    rep = Report("kvquant", "Quantized KV cache: int8 / fp8 vs fp32", notes, tables)
    rep.result = r
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(121)
    for threads in sorted({row["threads"] for row in result["decode"]}):
        rows = [row for row in result["decode"] if row["threads"] == threads]
        for d in DECODE_DTYPES:
            ax.plot([row["context"] for row in rows], [row["ms"][d]["step"] for row in rows], marker="o",
                    label=f"{d}, {threads} thread{'s' if threads > 1 else ''}")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms / decode step (batch 1)")
    ax.legend(fontsize=7)
    ax2 = fig.add_subplot(122)
    cap = result["capacity_tokens"]
    ax2.bar(list(cap), list(cap.values()), color="#4c72b0")
    ax2.set_ylabel(f"tokens in {result['budget_bytes'] >> 20} MiB")
