"""``pagedllm bench throughput``: offline W1 workload, our engine vs the baselines, plus batch-1 decode speed."""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.bench import baselines as bl
from pagedllm.bench import roofline
from pagedllm.bench.common import (
    engine_warmup,
    make_llm,
    ratio,
    run_engine,
    strip_outputs,
    tokens_by,
)
from pagedllm.bench.report import Report, Table, emit
from pagedllm.bench.workloads import W1, W1_QUICK, BenchRequest, corpus, random_requests
from pagedllm.config.device import resolve_dtype
from pagedllm.models.quant import kernel_available

ALL_BASELINES = ("hf-dynamic", "hf-static", "hf-cb", "llama-cpp", "vllm")
AGAIN = "pagedllm, again after vLLM"
A8_NAME = "pagedllm gguf-a8"  # int8 activations: llama.cpp's arithmetic, not bit-exact
EXACT_NAME = "pagedllm exact fp32"  # dtype float32 beside what auto picked: the path token-identical to HF fp32


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=None, help=f"number of requests (W1: {W1['num']})")
    p.add_argument("--min-prompt", type=int, default=None)
    p.add_argument("--max-prompt", type=int, default=None)
    p.add_argument("--min-output", type=int, default=None)
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="HF padded batch size (default 16; quick 4)")
    p.add_argument("--baselines", default=",".join(ALL_BASELINES),
                   help=f"comma list of {', '.join(ALL_BASELINES)} (or 'none')")
    p.add_argument("--a8", action="store_true",
                   help="also run the workload on our engine with quantization=gguf-a8 (int8 activations, llama.cpp's "
                        "arithmetic: faster, not bit-exact), right after our exact runs")
    p.add_argument("--exact", action="store_true",
                   help="also run the workload on our engine in exact fp32 (dtype float32: the GGUF blocks, "
                        "token-identical to HF fp32), where the chosen dtype runs another path (auto on a CPU with "
                        "native bf16)")
    p.add_argument("--no-roofline", action="store_true",
                   help="skip measuring this CPU's roofline (bandwidth, peak GEMMs: ~30 s) for the ceiling column")
    p.add_argument("--decode-tokens", type=int, default=None, help="batch-1 decode run length (default 128)")
    p.add_argument("--budget", type=float, default=40.0,
                   help="seconds per slow baseline: HF padded batches stop at it (mid-batch) and are measured on "
                        "the useful tokens made by then; HF generate_batch stops at twice it and is compared with what "
                        "our engine had made by the same second of its run; sequential llama.cpp stops after the "
                        "request that passes it and is measured on those it completed (0: no limit; default 40)")


def workload(args) -> tuple[dict, bool]:
    base = dict(W1_QUICK if args.quick else W1)
    if args.requests:
        base["num"] = args.requests
    pr, orr = list(base["prompt_range"]), list(base["output_range"])
    for i, v in ((0, args.min_prompt), (1, args.max_prompt)):
        if v:
            pr[i] = v
    for i, v in ((0, args.min_output), (1, args.max_output)):
        if v:
            orr[i] = v
    base["prompt_range"], base["output_range"] = tuple(pr), tuple(orr)
    return base, base == W1


def b1_request(llm, tokens: int, seed: int) -> BenchRequest:
    """The batch-1 decode request: a 32-token prompt, ``tokens`` outputs."""
    import random

    return BenchRequest(corpus(llm.engine.tokenizer, seed).window(32, random.Random(seed + 1)), tokens)


def decode_b1(llm, dtype: torch.dtype, req: BenchRequest, hf: bool, extras: dict | None = None) -> dict:
    """Batch-1 decode tok/s of ``req`` (see :func:`b1_request`): (n-1)/(finish - first token).
    ``extras``: our other engines by name (int8 activations, exact fp32)."""
    ids, tokens = req.prompt_ids, req.max_tokens
    out: dict = {"tokens": tokens}
    for name, engine in {"pagedllm": llm, **(extras or {})}.items():
        r = run_engine(engine, [BenchRequest(ids, tokens)], system=f"{name} b1", progress=False)
        out[name] = 1.0 / r.tpot_s[0] if r.tpot_s[0] else None
    if hf:
        model, htok = bl.hf_model(dtype)
        bl.hf_generate(model, htok, [ids], 2)
        t0 = time.perf_counter()
        bl.hf_generate(model, htok, [ids], 1)
        t1 = time.perf_counter()
        bl.hf_generate(model, htok, [ids], tokens)
        t2 = time.perf_counter()
        # ttft ~ (t1 - t0); decode time = total - prefill
        out["hf_dynamic"] = (tokens - 1) / max(1e-9, (t2 - t1) - (t1 - t0))
    return out


def _run_baseline(name: str, reqs: list[BenchRequest], dtype: torch.dtype, bs: int, llm, budget: float | None,
                  b1: BenchRequest):
    if name in ("hf-dynamic", "hf-static"):
        return bl.hf_padded(reqs, dtype, bs, name.removeprefix("hf-"), budget_s=budget)
    if name == "hf-cb":
        # twice the budget: its first seconds are all prefill
        return bl.hf_continuous(reqs, dtype, max_batch_tokens=llm.engine.args.max_num_batched_tokens,
                                max_requests=llm.engine.args.max_num_seqs, budget_s=budget and 2 * budget)
    if name == "llama-cpp":
        return bl.llama_cpp(reqs, budget_s=budget)
    return bl.vllm_cpu(reqs, dtype, b1=b1)  # names were checked against ALL_BASELINES


def run(args) -> Report:
    dtype = resolve_dtype(args.dtype)
    w, is_w1 = workload(args)
    bs = args.batch_size or (4 if args.quick else 16)
    budget = None if args.quick or not args.budget else args.budget
    chosen = [] if args.baselines == "none" else [b.strip() for b in args.baselines.split(",") if b.strip()]
    unknown = set(chosen) - set(ALL_BASELINES)
    if unknown:
        raise SystemExit(f"unknown baseline(s) {', '.join(sorted(unknown))}; choose from {', '.join(ALL_BASELINES)}")
    llm = make_llm(args.dtype, seed=args.seed, **args.engine_args)
    reqs = random_requests(llm.engine.tokenizer, w["num"], w["prompt_range"], w["output_range"], seed=args.seed)
    engine_warmup(llm)
    roof = None if args.no_roofline else roofline.measure(
        args.quick, w=w, lengths=([r.prompt_len for r in reqs], [r.max_tokens for r in reqs]))

    a8_llm = None
    a8_possible = (llm.engine.forward_pass.model.quantization in ("gguf", "gguf-bf16")
                   and kernel_available(int8_activations=True))
    if args.a8 and not a8_possible:
        raise SystemExit("--a8 needs a GGUF model kept in its blocks with fp32 activations (--dtype float32) and the "
                         f"int8 kernel; this run has dtype {dtype} and quantization "
                         f"{llm.engine.forward_pass.model.quantization!r}")
    if a8_possible:
        small = {} if args.a8 else {"num_blocks": 64}  # batch-1 only: a small pool
        a8_llm = make_llm(args.dtype, seed=args.seed, **{**args.engine_args, "quantization": "gguf-a8", **small})
        engine_warmup(a8_llm)
    model = llm.engine.forward_pass.model
    exact_llm = None
    # exact = fp32 weights, activations and pool: a bf16 engine on a CPU without native bf16 runs fp32 GEMMs
    # (upcast) and its GGUF blocks, but keeps bf16 norms, embeddings and K/V, so it is not the exact path
    exact_already = (model.dtype == model.act_dtype == llm.engine.forward_pass.kv_cache.dtype == torch.float32
                     and model.quantization in ("gguf", "none"))
    if args.exact and not exact_already:
        exact_llm = make_llm("float32", seed=args.seed, **args.engine_args)
        engine_warmup(exact_llm)
    extras = {n: e for n, e in ((A8_NAME, a8_llm), (EXACT_NAME, exact_llm)) if e is not None}
    w1_extras = {n: e for n, e in extras.items() if n != A8_NAME or args.a8}

    def run_extras() -> None:
        for name, engine in w1_extras.items():
            engine.reset_prefix_cache()
            results.append(run_engine(engine, reqs, system=name, desc=name))

    # vLLM, the peer to beat, runs right after our engine and ours runs again right after it: the VM's speed
    # drifts by up to 2x within minutes, so its ratio is taken against both neighbouring runs
    chosen.sort(key=lambda b: b != "vllm")
    b1_req = b1_request(llm, args.decode_tokens or (16 if args.quick else 128), args.seed)
    llm.reset_prefix_cache()  # a cold start for W1 (a reused engine may have seen these prompts)
    results = [run_engine(llm, reqs, desc="pagedllm")]
    if "vllm" not in chosen:
        run_extras()
    for i, b in enumerate(chosen):
        # a bench cut short (time limit, Ctrl-C, a crashing baseline) leaves what it measured on disk
        emit(_report(args, w, is_w1, bs, budget, llm, reqs, results, None, chosen[i:], roof), args.out, plot,
             str(dtype), quiet=True)
        results.append(_run_baseline(b, reqs, dtype, bs, llm, budget, b1_req))
        if b == "vllm":
            if not isinstance(results[-1], bl.Skipped):
                llm.reset_prefix_cache()  # the same prompts again: computed, not found in the cache
                results.append(run_engine(llm, reqs, system=AGAIN, desc=AGAIN))
            run_extras()
    b1 = decode_b1(llm, dtype, b1_req, hf="hf-dynamic" in chosen, extras=extras)
    lcpp = next((r for r in results if not isinstance(r, bl.Skipped) and r.system == bl.LLAMA_CPP_NAME), None)
    if lcpp is not None and lcpp.tpot_s:
        b1["llama_cpp"] = len(lcpp.tpot_s) / sum(lcpp.tpot_s)  # mean decode step of its one-at-a-time requests
    vllm = next((r for r in results if not isinstance(r, bl.Skipped) and r.system == bl.VLLM_NAME), None)
    if vllm is not None and vllm.extra.get("b1_tok_s"):
        b1["vllm"] = vllm.extra["b1_tok_s"]
    return _report(args, w, is_w1, bs, budget, llm, reqs, results, b1, [], roof)


def _report(args, w: dict, is_w1: bool, bs: int, budget: float | None, llm, reqs: list[BenchRequest],
            results: list, b1: dict | None, pending: list[str], roof: dict | None = None) -> Report:
    """The report over the systems run so far (``pending``: baselines not run yet, for a partial write); ``roof``:
    this CPU's roofline (``bench/roofline.py``), whose ceilings for our engine's format become a column."""
    ours = results[0]
    ran = [r for r in results if not isinstance(r, bl.Skipped)]
    skipped = [r for r in results if isinstance(r, bl.Skipped)]
    rows, speedup = [], {}
    again = next((r for r in ran if r.system == AGAIN), None)
    vllm = next((r for r in ran if r.system == bl.VLLM_NAME), None)
    # baselines are compared with the mean of our runs (one, or two around vLLM): the VM's speed drifts
    ours_runs = [r for r in (ours, again) if r is not None]
    ours_mean = sum(r.output_tok_s for r in ours_runs) / len(ours_runs)
    for r in ran:
        note, ours_tok_s = "", ours_mean
        if r is ours:
            rows.append([r.system, r.requests_per_s, r.output_tok_s, r.total_tok_s, r.elapsed_s, 1.0, ""])
            continue
        if r.system in (AGAIN, A8_NAME, EXACT_NAME):
            note = "our engine again, right after vLLM (the VM's drift between runs)"
            if r.system != AGAIN:
                what = ("with int8 activations (llama.cpp's arithmetic, not bit-exact)" if r.system == A8_NAME
                        else "in exact fp32 (token-identical to HF fp32)")
                note = (f"our engine {what}: {ratio(r.output_tok_s, ours.output_tok_s):.2f}x our first run"
                        + (f", {ratio(r.output_tok_s, vllm.output_tok_s):.2f}x vLLM" if vllm else ""))
            rows.append([r.system, r.requests_per_s, r.output_tok_s, r.total_tok_s, r.elapsed_s, None, note])
            continue
        if again is not None and r.system == bl.VLLM_NAME:
            note = (f"vs the mean of pagedllm's runs right before and after it ({ours.output_tok_s:.1f} and "
                    f"{again.output_tok_s:.1f} tok/s: {ratio(ours.output_tok_s, r.output_tok_s):.2f}x and "
                    f"{ratio(again.output_tok_s, r.output_tok_s):.2f}x)")
        elif "cut_at_s" in r.extra:
            # stopped mid-run: compare with what we had made by the same second of our own run
            cut = r.extra["cut_at_s"]
            ours_by = sum(tokens_by(o.extra["timeline"], cut) for o in ours_runs) / len(ours_runs)
            ours_tok_s = ours_by / cut
            note = (f"stopped at {cut:.0f} s ({r.num_requests} of {len(reqs)} requests finished); speedup vs "
                    f"pagedllm's first {cut:.0f} s ({ours_by:.0f} tokens{', mean of our 2 runs' if again else ''})")
        elif "stopped_mid_batch_at_s" in r.extra:
            note = (f"stopped at {r.extra['stopped_mid_batch_at_s']:.0f} s, inside batch "
                    f"{r.extra['completed_batches'] + 1} ({r.num_requests} of {len(reqs)} requests finished): its "
                    "useful tokens by then, before the batch's padded tail (favours HF)")
        elif r.num_requests < len(reqs):
            note = f"time budget {budget:.0f} s: measured on the first {r.num_requests} of {len(reqs)} requests"
        if again is not None and r.system != bl.VLLM_NAME and "cut_at_s" not in r.extra:  # the cut note says it
            note += ("; " if note else "") + "speedup vs the mean of our 2 runs"
        speedup[r.system] = ratio(ours_tok_s, r.output_tok_s)
        rows.append([r.system, r.requests_per_s, r.output_tok_s, r.total_tok_s, r.elapsed_s, speedup[r.system], note])
    for s in skipped:
        rows.append([s.system, None, None, None, None, None, s.note])
    rows += [[p, None, None, None, None, None, "not run yet (partial results)"] for p in pending]
    cols = ["system", "req/s", "output tok/s", "total tok/s", "time (s)", "pagedllm speedup", "note"]
    fmt = roofline.format_of(llm.engine.forward_pass.model.act_dtype, llm.engine.forward_pass.model.quantization)
    ceiling = roof and roofline.floor_for(roof, fmt)
    if ceiling and ceiling["w1_tok_s"]:
        cols.insert(-1, f"% of {fmt} W1 ceiling")
        for row in rows:
            row.insert(-1, None if row[2] is None else 100 * row[2] / ceiling["w1_tok_s"])
        rows.append([f"roofline: W1 ceiling, {fmt}", None, ceiling["w1_tok_s"], None, None, None, 100.0,
                     (f"these requests' FLOPs at {ceiling['gemm_gflops']:.0f} GFLOP/s ({ceiling['gemm_path']}, "
                      "measured in this run, best of several: see bench roofline)")])
        if ceiling.get("w1_peak_tok_s"):
            rows.append([f"roofline: W1 floor at the cores' peak, {fmt}", None, ceiling["w1_peak_tok_s"], None, None,
                         None, 100 * ceiling["w1_peak_tok_s"] / ceiling["w1_tok_s"],
                         f"these requests' FLOPs at {ceiling['floor_gflops']:.0f} GFLOP/s (the instruction peak "
                         "where it beats the GEMM path), decode attention at its K/V reads at the measured "
                         "bandwidth where they take longer: no engine that runs a step's ops in turn passes it here"])
    mean_p = sum(r.prompt_len for r in reqs) / len(reqs)
    mean_o = sum(r.max_tokens for r in reqs) / len(reqs)
    eng = llm.engine.args
    quantization = llm.engine.forward_pass.model.quantization
    notes = [
        f"Workload {'W1' if is_w1 else 'W1 scaled down'}: {w['num']} requests, prompt {w['prompt_range'][0]}-"
        f"{w['prompt_range'][1]} tokens (mean {mean_p:.0f}), output {w['output_range'][0]}-{w['output_range'][1]} "
        f"(mean {mean_o:.0f}), ignore_eos, greedy; prompts = windows of Wikipedia summaries; seed {args.seed}.",
        f"dtype {resolve_dtype(args.dtype)} for every system (same weights: the embedded SmolLM2-135M-Instruct); "
        f"HF padded batches of {bs} in arrival order (output tok/s counts only the tokens each request asked for)"
        + (f"; time budgets: HF padded stops at {budget:.0f} s (mid-batch), HF generate_batch at {2 * budget:.0f} s, "
           f"llama.cpp after the request that passes {budget:.0f} s" if budget else "")
        + ".",
        ("our engine reads the GGUF's Q4_1/Q8_0 blocks directly (quantization=gguf: the same weight values the "
         "baselines get dense, 96 MB instead of 540 MB to stream per decode step). " if quantization == "gguf" else "")
        + f"engine: max_num_seqs {eng.max_num_seqs}, max_num_batched_tokens {eng.max_num_batched_tokens}, block_size "
        f"{eng.block_size}, {ours.extra['num_steps']} steps, {ours.extra['num_preemptions']} preemptions, peak KV "
        f"{ours.extra['peak_kv_mb']:.0f} MB.",
    ]
    if pending:
        notes.insert(0, f"PARTIAL: still to run: {', '.join(pending)}")
    tables = [Table(cols, rows, "Throughput", 2)]
    if b1:
        names = {"pagedllm": "pagedllm", A8_NAME: f"{A8_NAME} (int8 activations, like llama.cpp)",
                 EXACT_NAME: f"{EXACT_NAME} (token-identical to HF fp32)",
                 "hf_dynamic": "HF generate (DynamicCache)", "vllm": f"{bl.VLLM_NAME} (the same request)",
                 "llama_cpp": "llama.cpp Q4_1 (its sequential W1 requests, prompts 32-512)"}
        b1_rows = [[label, b1[k]] for k, label in names.items() if k in b1]
        b1_cols = ["system", "decode tok/s"]
        if ceiling:
            b1_cols.append(f"% of {fmt} batch-1 ceiling")
            b1_rows = [[label, v, v and 100 * v / ceiling["b1_tok_s"]] for label, v in b1_rows]
            b1_rows.append([(f"roofline: {ceiling['step_bytes'] / 1e6:.0f} MB per token at "
                             f"{roof['bandwidth_Bps']['read'] / 1e9:.1f} GB/s"), ceiling["b1_tok_s"], 100.0])
        tables.append(Table(b1_cols, b1_rows,
                            f"Batch-1 decode ({b1['tokens']} tokens after a 32-token prompt)", 1))
    rep = Report("throughput", "Offline throughput (W1)", notes, tables)
    rep.result = {"workload": {**w, "mean_prompt": mean_p, "mean_output": mean_o, "seed": args.seed, "is_w1": is_w1},
                  "runs": [strip_outputs(r.summary()) for r in ran],
                  "skipped": [{"system": s.system, "note": s.note} for s in skipped],
                  "speedup": speedup,
                  "decode_b1_tok_s": b1 or {}, "hf_batch_size": bs, "pending": pending, "budget_s": budget,
                  "roofline": roof}
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(121)
    runs = result["runs"]
    names = [r["system"].replace(", padded", "\npadded").replace(" (", "\n(") for r in runs]
    vals = [r["output_tok_s"] for r in runs]
    ax.barh(range(len(runs)), vals, color=["tab:orange" if r["system"].startswith("pagedllm") else "tab:blue"
                                          for r in runs])
    ax.set_yticks(range(len(runs)), names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("output tok/s")
    ax.set_title("W1 throughput", fontsize=9)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.0f}", va="center", fontsize=7)
    ax2 = fig.add_subplot(122)
    b1 = {k: v for k, v in result["decode_b1_tok_s"].items() if k != "tokens" and v}
    ax2.bar([k.replace(" ", "\n") for k in b1], list(b1.values()),
            color=["tab:orange" if k.startswith("pagedllm") else "tab:blue" for k in b1])
    ax2.axhline(70, color="gray", ls="--", lw=0.8)  # the target
    ax2.set_ylabel("tok/s")
    ax2.set_title("batch-1 decode", fontsize=9)
    ax2.tick_params(axis="x", labelsize=7)
