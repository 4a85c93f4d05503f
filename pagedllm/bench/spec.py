"""``pagedllm bench spec``: speculative decoding against none, in the same run, on the same engine settings:
decode tok/s and acceptance at batch 1 and batch 16, on a copy-heavy workload (repeat / edit a real
Wikipedia paragraph) and on W1."""

from __future__ import annotations

import argparse
import json
import time

from pagedllm.bench.report import Report, Table
from pagedllm.bench.workloads import W1, W1_QUICK, random_requests


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="ngram", choices=("ngram", "suffix", "draft_model"))
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--num-layers", type=int, default=None, help="draft_model: self-speculative draft depth")
    p.add_argument("--batches", default="1,16", help="comma list of batch sizes (default 1,16)")
    p.add_argument("--max-tokens", type=int, default=None, help="copy workload output length (default 192)")


def _workloads(tok, args, batch: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    from pagedllm.spec_decode.replay import copy_workload

    n_out = args.max_tokens or (16 if args.quick else 192)
    copy = copy_workload(tok, batch, seed=args.seed)
    w = W1_QUICK if args.quick else W1
    reqs = random_requests(tok, batch, w["prompt_range"], w["output_range"], seed=args.seed)
    return {"copy": (copy, [n_out] * batch), "W1": ([r.prompt_ids for r in reqs], [r.max_tokens for r in reqs])}


def _run(llm, prompts: list[list[int]], lens: list[int]) -> tuple[float, int, list[list[int]]]:
    from pagedllm import SamplingParams

    llm.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.monotonic() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].token_ids for o in outs]


def run(args) -> Report:
    from pagedllm.bench.common import make_llm

    spec = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "draft_model":
        spec["num_layers"] = args.num_layers or 8
    plain = make_llm(args.dtype, seed=args.seed, **args.engine_args)
    fast = make_llm(args.dtype, seed=args.seed, **{**args.engine_args, "speculative_config": json.dumps(spec)})
    tok = plain.engine.tokenizer
    rows, raw = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        for name, (prompts, lens) in _workloads(tok, args, batch).items():
            stats = fast.engine.core.speculator.stats
            before = (stats.num_drafts, stats.num_accepted, stats.num_steps)
            t_off, n_off, out_off = _run(plain, prompts, lens)
            t_on, n_on, out_on = _run(fast, prompts, lens)
            drafts, accepted, steps = (stats.num_drafts - before[0], stats.num_accepted - before[1],
                                       stats.num_steps - before[2])
            same = out_on == out_off
            rate = accepted / drafts if drafts else 0.0
            mean_len = (accepted + steps) / steps if steps else 0.0
            rows.append([name, batch, n_off / t_off, n_on / t_on, (n_on / t_on) / (n_off / t_off), rate, mean_len,
                         "yes" if same else "NO"])
            raw.append({"workload": name, "batch": batch, "tok_s_off": n_off / t_off, "tok_s_on": n_on / t_on,
                        "speedup": (n_on / t_on) / (n_off / t_off), "acceptance": rate,
                        "mean_accepted_length": mean_len, "identical": same})
    rep = Report("spec", f"speculative decoding ({args.method}, k={args.k}) vs none, greedy, same run",
                 ["tok/s = output tokens / wall time of LLM.generate over the batch; acceptance = kept drafts / "
                  "drafts; mean accepted length = tokens gained per drafted step"])
    rep.tables.append(Table(["workload", "batch", "off tok/s", "on tok/s", "speedup", "acceptance",
                             "mean accepted len", "same tokens"], rows, digits=2))
    rep.result = {"method": args.method, "k": args.k, "runs": raw}
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    runs = result["runs"]
    labels = [f"{r['workload']}\nbatch {r['batch']}" for r in runs]
    ax.bar(range(len(runs)), [r["speedup"] for r in runs], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(range(len(runs)), labels)
    ax.set_ylabel("decode speedup (on / off)")
    ax.set_title(f"speculative decoding: {result['method']}, k={result['k']}")
