"""``pagedllm bench waste``: seed 003's naive-batching waste demo, next to continuous batching.

Table 1 (seed 003): the four prompts in one naive batch run until the longest finishes; per prompt,
the decode steps it needed (its own length to EOS, capped at max_tokens) vs the steps it spun on padding.
Table 2: a queue of those prompts (repeated) through 4 slots: naive batching (our engine's static
mode, and HF generate in padded batches of 4) vs continuous batching: wall time, tok/s, slot utilization.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.bench import baselines as bl
from pagedllm.bench.common import engine_warmup, make_llm, ratio, run_engine
from pagedllm.bench.report import Report, Table
from pagedllm.bench.workloads import WASTE_DEMO_PROMPTS, BenchRequest, chat_request_ids


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None, help="cap per prompt (seed 003: 200; quick 24)")
    p.add_argument("--repeat", type=int, default=None, help="queue = the 4 prompts x repeat (default 4; quick 2)")
    p.add_argument("--no-hf", action="store_true")


def _short(s: str, n: int = 30) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def run(args) -> Report:
    from pagedllm.config.device import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    cap = args.max_tokens or (24 if args.quick else 200)
    rep_n = args.repeat or (2 if args.quick else 4)
    base = {"max_num_seqs": 4, **args.engine_args}
    cont = make_llm(args.dtype, seed=args.seed, batching="continuous", **base)
    tok = cont.engine.tokenizer
    prompt_ids = chat_request_ids(tok, WASTE_DEMO_PROMPTS)
    engine_warmup(cont)

    # table 1: steps needed per prompt (greedy, EOS honoured), one naive batch of 4
    r1 = run_engine(cont, [BenchRequest(p, cap) for p in prompt_ids], ignore_eos=False, desc="4 prompts")
    needed = r1.output_lens
    ran_for = max(needed)
    rows1 = [[_short(p), n, ran_for - n, 100.0 * (ran_for - n) / ran_for] for p, n in zip(WASTE_DEMO_PROMPTS, needed)]
    total_waste = 100.0 * sum(ran_for - n for n in needed) / (ran_for * len(needed))
    rows1.append(["all (slot-steps)", sum(needed), sum(ran_for - n for n in needed), total_waste])
    hf_lens = None
    if not args.no_hf:
        model, htok = bl.hf_model(dtype)
        gen = bl.hf_generate(model, htok, prompt_ids, cap, eos=True)
        eos = set(cont.engine.eos_token_ids)
        hf_lens = []
        for row in gen.tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            hf_lens.append(n)

    # table 2: a queue through 4 slots
    queue = [BenchRequest(p, cap, f"q{i}") for i in range(rep_n) for p in prompt_ids]
    rc = run_engine(cont, queue, ignore_eos=False, desc="continuous")
    del cont
    static = make_llm(args.dtype, seed=args.seed, batching="static", **base)
    engine_warmup(static)
    rs = run_engine(static, queue, ignore_eos=False, desc="static")
    systems = [("pagedllm continuous batching", rc), ("pagedllm static (naive) batching", rs)]
    if not args.no_hf:
        model, htok = bl.hf_model(dtype)
        t0 = time.monotonic()
        toks = 0
        for i in range(0, len(queue), 4):
            b = queue[i:i + 4]
            bl.hf_generate(model, htok, [r.prompt_ids for r in b], cap, eos=True)
        hf_el = time.monotonic() - t0
        from pagedllm.bench.common import RunResult

        rh = RunResult("HF generate, padded batches of 4", hf_el, len(queue), sum(r.prompt_len for r in queue),
                       rc.output_tokens)
        rh.extra = {"num_steps": None}
        systems.append((rh.system, rh))
        del toks
    useful = sum(rc.output_lens)
    rows2 = []
    for name, r in systems:
        steps = r.extra.get("num_steps")
        util = 100.0 * useful / (4 * steps) if steps else None
        rows2.append([name, r.elapsed_s, useful / r.elapsed_s, steps, util, ratio(r.elapsed_s, rc.elapsed_s)])
    notes = [f"Seed 003's four prompts (chat template), greedy, EOS honoured, cap {cap} tokens; dtype {dtype}.",
             f"Naive batch ran for {ran_for} decode steps (the longest prompt).",
             f"Queue: the 4 prompts x {rep_n} = {len(queue)} requests, at most 4 running; slot utilisation = useful "
             "tokens / (4 slots x engine steps)."]
    if hf_lens is not None:
        notes.append(f"HF generate on the same batch stops each row at EOS after {hf_lens} steps "
                     f"(ours: {needed}) — a cross-check that both run the same model.")
    rep = Report("waste", "Naive batching waste vs continuous batching (seed 003)", notes,
                 [Table(["prompt", "steps needed", "steps wasted", "waste %"], rows1, "Naive batch of 4", 1),
                  Table(["system", "time (s)", "useful tok/s", "engine steps", "slot util %", "time / continuous"],
                        rows2, f"Queue of {len(queue)} through 4 slots", 2)])
    rep.result = {"cap": cap, "needed": needed, "ran_for": ran_for, "waste_pct": [r[3] for r in rows1[:-1]],
                  "total_waste_pct": total_waste, "hf_needed": hf_lens,
                  "queue": {name: {"elapsed_s": r.elapsed_s, "steps": r.extra.get("num_steps"),
                                   "useful_tok_s": useful / r.elapsed_s} for name, r in systems}}
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(121)
    n = result["needed"]
    ran = result["ran_for"]
    xs = range(len(n))
    ax.bar(xs, n, label="needed", color="tab:green")
    ax.bar(xs, [ran - v for v in n], bottom=n, label="wasted (padding)", color="tab:red", alpha=0.6)
    ax.set_xticks(list(xs), [f"p{i}" for i in xs])
    ax.set_ylabel("decode steps")
    ax.set_title(f"naive batch: {result['total_waste_pct']:.0f}% wasted", fontsize=9)
    ax.legend(fontsize=7)
    ax2 = fig.add_subplot(122)
    q = result["queue"]
    names = list(q)
    ax2.barh(range(len(names)), [q[k]["elapsed_s"] for k in names], color="tab:blue")
    ax2.set_yticks(range(len(names)), [k.replace(" batching", "\nbatching").replace(", ", "\n") for k in names],
                   fontsize=6)
    ax2.set_xlabel("wall time (s)")
    ax2.set_title("queue through 4 slots", fontsize=9)
