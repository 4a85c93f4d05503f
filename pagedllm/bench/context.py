"""``pagedllm bench context``: seed 000's long-context scenarios at CPU scale, paged vs HF DynamicCache.

1. single sequence: ms/token of decode after a prompt of L tokens, L up to 8k (the slope of ms/token
   vs context is the headline number);
2. mixed batch: 16 prompts of different lengths at once (seed 000: 500..8000; CPU scale: 32..512);
3. chat growth: one conversation whose context grows turn by turn (seed 000: 1k..32k; CPU scale
   512..2048); our engine reuses the cached prefix, HF recomputes the whole history each turn.

Every prefill token costs ~0.27 GFLOP on this 135M model, i.e. ~130 tokens/s at fp32 on 2 AVX2 cores,
so the workloads are scaled to stay under 10 minutes; the table header states the sizes run.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from tqdm.auto import tqdm

from pagedllm.bench import baselines as bl
from pagedllm.bench.common import (
    PeakRSS,
    engine_warmup,
    make_llm,
    mean,
    ratio,
    run_engine,
)
from pagedllm.bench.report import Report, Table
from pagedllm.bench.workloads import BenchRequest, corpus
from pagedllm.models.paged_cache import hf_cache_kwargs


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-context", type=int, default=None, help="single-sequence max prompt (default 8000)")
    p.add_argument("--hf-max-context", type=int, default=None,
                   help="largest single-sequence context run on HF (default 4096, to fit 10 min)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens decoded per point (default 16)")
    p.add_argument("--mixed-step", type=int, default=None, help="mixed batch: prompt i has (i+1)*step tokens (32)")
    p.add_argument("--chat-turns", default=None, help="chat growth contexts, comma list (default 512,1024,2048)")


@torch.inference_mode()
def hf_prefill_decode(model, prompts: list[list[int]], steps: int, pad: int) -> dict:
    """Left-padded batch: one prefill, then ``steps`` greedy decode steps with a growing DynamicCache."""
    ids, mask = bl.left_pad(prompts, pad)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    t0 = time.perf_counter()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    t1 = time.perf_counter()
    last = pos[:, -1:]
    times = []
    for _ in range(steps - 1):
        s = time.perf_counter()
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        last = last + 1
        out = model(input_ids=nxt, attention_mask=mask, position_ids=last, use_cache=True,
                    **hf_cache_kwargs(model, past))
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - s)
    return {"ttft_s": t1 - t0, "ms_per_tok": 1000 * mean(times) if times else None, "total_s": time.perf_counter() - t0}


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope (y per x)."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def run(args) -> Report:
    from pagedllm.config.device import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    q = args.quick
    K = args.decode_tokens or (4 if q else 16)
    maxc = args.max_context or (128 if q else 8000)
    hf_maxc = args.hf_max_context or (128 if q else 4096)
    lengths = [L for L in ((64, 128) if q else (512, 1024, 2048, 4096, 8000)) if L <= maxc]
    if maxc not in lengths:
        lengths.append(maxc)
    step = args.mixed_step or (16 if q else 32)
    nmix = 4 if q else 16
    turns = [int(x) for x in (args.chat_turns or ("64,128" if q else "512,1024,2048")).split(",")]

    llm = make_llm(args.dtype, seed=args.seed, **args.engine_args)
    tok = llm.engine.tokenizer
    c = corpus(tok, args.seed)
    rng = random.Random(args.seed + 11)
    engine_warmup(llm)
    model, htok = bl.hf_model(dtype)
    pad = bl.pad_id(htok)
    hf_prefill_decode(model, [[1, 2, 3]], 2, pad)
    res: dict = {"single": {}, "mixed": {}, "chat": {}, "decode_tokens": K}

    # 1. single sequence
    rows1 = []
    for L in tqdm(lengths, desc="single sequence", leave=False):
        ids = c.window(L, rng)
        r = run_engine(llm, [BenchRequest(ids, K)], desc=f"pagedllm ctx {L}", progress=False, measure_memory=True)
        ours = {"ms_per_tok": 1000 * r.tpot_s[0] if r.tpot_s[0] else None, "ttft_s": r.ttft_s[0],
                "peak_mb": r.peak_mb, "kv_mb": r.extra["peak_kv_mb"]}
        h = None
        if L <= hf_maxc:
            with PeakRSS() as mem:
                h = hf_prefill_decode(model, [ids], K, pad)
            h["peak_mb"] = mem.peak_mb
        res["single"][L] = {"pagedllm": ours, "hf_dynamic": h}
        rows1.append([L, ours["ms_per_tok"], ours["ttft_s"], ours["peak_mb"], h and h["ms_per_tok"],
                      h and h["ttft_s"], h and h["peak_mb"], h and ratio(h["ms_per_tok"], ours["ms_per_tok"])])
    xs = list(res["single"])
    s_ours = slope(xs, [res["single"][L]["pagedllm"]["ms_per_tok"] for L in xs])
    hx = [L for L in xs if res["single"][L]["hf_dynamic"]]
    s_hf = slope(hx, [res["single"][L]["hf_dynamic"]["ms_per_tok"] for L in hx])
    s_ours_common = slope(hx, [res["single"][L]["pagedllm"]["ms_per_tok"] for L in hx])
    res["slope_ms_per_1k"] = {"pagedllm": s_ours and 1000 * s_ours, "pagedllm_common": s_ours_common and 1000 * s_ours_common,
                              "hf_dynamic": s_hf and 1000 * s_hf}

    # 2. mixed batch
    mix = [c.window(step * (i + 1), rng) for i in range(nmix)]
    r = run_engine(llm, [BenchRequest(m, K) for m in mix], desc="mixed batch", measure_memory=True)
    ours_m = {"total_s": r.elapsed_s, "ms_per_tok": 1000 * mean(r.tpot_s), "ttft_s": mean(r.ttft_s),
              "peak_mb": r.peak_mb, "kv_mb": r.extra["peak_kv_mb"]}
    with PeakRSS() as mem:
        hm = hf_prefill_decode(model, mix, K, pad)
    hm["peak_mb"] = mem.peak_mb
    res["mixed"] = {"pagedllm": ours_m, "hf_dynamic": hm, "lengths": [len(m) for m in mix]}
    rows2 = [["pagedllm (paged, continuous)", ours_m["total_s"], ours_m["ms_per_tok"], ours_m["ttft_s"],
              ours_m["peak_mb"], None],
             ["HF DynamicCache (padded batch)", hm["total_s"], hm["ms_per_tok"], hm["ttft_s"], hm["peak_mb"],
              ratio(hm["total_s"], ours_m["total_s"])]]

    # 3. chat growth: the context grows turn by turn; each turn decodes K tokens
    ctx: list[int] = []
    rows3 = []
    for T in tqdm(turns, desc="chat growth", leave=False):
        ctx = ctx + c.window(T - len(ctx), rng) if T > len(ctx) else ctx
        r = run_engine(llm, [BenchRequest(list(ctx), K)], desc=f"chat {T}", progress=False, measure_memory=True)
        ctx = ctx + r.extra["outputs"][0].outputs[0].token_ids  # the answer joins the history
        o = {"turn_s": r.elapsed_s, "ttft_s": r.ttft_s[0], "ms_per_tok": 1000 * r.tpot_s[0] if r.tpot_s[0] else None,
             "computed": r.extra["prompt_tokens_computed"], "peak_mb": r.peak_mb}
        with PeakRSS() as mem:
            h = hf_prefill_decode(model, [ctx[: -K] if len(ctx) > K else ctx], K, pad)
        h["peak_mb"] = mem.peak_mb
        res["chat"][T] = {"pagedllm": o, "hf_dynamic": h}
        rows3.append([T, o["turn_s"], o["ttft_s"], o["computed"], h["total_s"], h["ttft_s"], T,
                      ratio(h["total_s"], o["turn_s"])])

    notes = [f"dtype {dtype}; greedy; {K} decode tokens per point; prompts are Wikipedia text. HF = transformers "
             "forward with DynamicCache (SDPA), same weights.",
             f"Single sequence: contexts {lengths} (seed 000 goes to 100k; 8k is SmolLM2's limit); HF run up to "
             f"{hf_maxc} tokens to stay under 10 min. ms/token = mean decode step after the prompt.",
             f"Slope of ms/token vs context: pagedllm {fmt_s(res['slope_ms_per_1k']['pagedllm'])} ms per 1k tokens "
             f"(over {lengths[0]}-{lengths[-1]}); on the points both ran: pagedllm "
             f"{fmt_s(res['slope_ms_per_1k']['pagedllm_common'])}, HF {fmt_s(res['slope_ms_per_1k']['hf_dynamic'])}.",
             f"Mixed batch: {nmix} prompts of {step}..{step * nmix} tokens (seed 000: 16 x 500..8000, scaled 1/16 "
             "for this CPU); HF pads all to the longest.",
             f"Chat growth: contexts {turns} (seed 000: 1k..32k); pagedllm keeps the history in the prefix cache, "
             "HF recomputes it each turn."]
    tables = [Table(["context", "ms/tok", "TTFT (s)", "peak MB", "HF ms/tok", "HF TTFT (s)", "HF peak MB",
                     "HF/ours ms/tok"], rows1, "Single sequence: decode latency vs context", 2),
              Table(["system", "total (s)", "decode ms/tok", "mean TTFT (s)", "peak MB", "HF/ours time"], rows2,
                    f"Mixed batch of {nmix}", 2),
              Table(["context", "turn (s)", "TTFT (s)", "prompt tokens computed", "HF turn (s)", "HF TTFT (s)",
                     "HF tokens computed", "HF/ours time"], rows3, "Chat growth", 2)]
    return Report("context", "Long context at CPU scale (seed 000 scenarios)", notes, tables, res)


def fmt_s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(121)
    s = result["single"]
    xs = sorted(int(k) for k in s)
    get = lambda L: s.get(L) or s.get(str(L))
    ax.plot(xs, [get(L)["pagedllm"]["ms_per_tok"] for L in xs], marker="o", color="tab:orange", label="pagedllm")
    hx = [L for L in xs if get(L)["hf_dynamic"]]
    ax.plot(hx, [get(L)["hf_dynamic"]["ms_per_tok"] for L in hx], marker="o", color="tab:blue",
            label="HF DynamicCache")
    sl = result["slope_ms_per_1k"]
    ax.set_title(f"decode ms/token vs context (slope {fmt_s(sl['pagedllm'])} ms/1k)", fontsize=8)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms/token")
    ax.legend(fontsize=7)
    ax2 = fig.add_subplot(122)
    ch = result["chat"]
    ts = sorted(int(k) for k in ch)
    g2 = lambda T: ch.get(T) or ch.get(str(T))
    ax2.plot(ts, [g2(T)["pagedllm"]["turn_s"] for T in ts], marker="o", color="tab:orange", label="pagedllm")
    ax2.plot(ts, [g2(T)["hf_dynamic"]["total_s"] for T in ts], marker="o", color="tab:blue", label="HF")
    ax2.set_xlabel("chat context tokens")
    ax2.set_ylabel("turn time (s)")
    ax2.set_title("chat growth", fontsize=9)
    ax2.legend(fontsize=7)
