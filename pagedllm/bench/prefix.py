"""``pagedllm bench prefix``: prefix-heavy workloads with and without prefix caching, fcfs vs lpm.

* shared system prompt: a few long system prompts (instruction + a reference article), each request
  one of them (interleaved, seeded) plus its own short question;
* multi-turn chat: conversations that each start from a system prompt with a reference article; every
  round sends each conversation's whole history plus a new question (a turn depends on the previous
  answer, so rounds run one after another).

Each configuration gets a fresh engine; reported: time, req/s, output tok/s, prefix hit rate
(prompt tokens read from the cache / all prompt tokens) and prompt tokens actually computed.
"""

from __future__ import annotations

import argparse
import random
import time

from pagedllm.bench.common import engine_warmup, make_llm, ratio, run_engine
from pagedllm.bench.report import Report, Table
from pagedllm.bench.workloads import (
    BenchRequest,
    chat_ids,
    system_prompts,
    user_questions,
)

CONFIGS = [("no prefix cache, fcfs", False, "fcfs"), ("prefix cache, fcfs", True, "fcfs"),
           ("prefix cache, lpm", True, "lpm")]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=None, help="shared-prompt requests (default 32; quick 6)")
    p.add_argument("--system-tokens", type=int, default=None, help="system prompt length (default 384; quick 48)")
    p.add_argument("--conversations", type=int, default=None, help="chat conversations (default 8; quick 2)")
    p.add_argument("--turns", type=int, default=None, help="turns per conversation (default 4; quick 2)")
    p.add_argument("--download-chat", action="store_true",
                   help="fetch the OpenAI evals wheel (pip download --no-deps) for real chat prompts")


def shared_workload(tok, n: int, sys_tokens: int, num_sys: int, out: int, seed: int, download: bool):
    rng = random.Random(seed + 3)
    systems = system_prompts(num_sys, sys_tokens, tok, seed)
    qs, src = user_questions(n, seed, download)
    reqs = []
    for i in range(n):
        s = rng.randrange(num_sys)
        reqs.append(BenchRequest(chat_ids(tok, [{"role": "system", "content": systems[s]},
                                                {"role": "user", "content": qs[i]}]), out, f"sys{s}"))
    return reqs, src


def run_chat(llm, tok, convs: int, turns: int, sys_tokens: int, out: int, seed: int, download: bool) -> dict:
    systems = system_prompts(convs, sys_tokens, tok, seed + 101)
    qs, _ = user_questions(convs * turns, seed + 7, download)
    hist = [[{"role": "system", "content": systems[c]}] for c in range(convs)]
    tot = {"elapsed_s": 0.0, "output_tokens": 0, "requests": 0, "computed": 0, "cached": 0, "prompt_tokens": 0}
    for t in range(turns):
        for c in range(convs):
            hist[c].append({"role": "user", "content": qs[t * convs + c]})
        reqs = [BenchRequest(chat_ids(tok, h), out) for h in hist]
        r = run_engine(llm, reqs, desc=f"chat turn {t + 1}/{turns}")
        for c, o in enumerate(r.extra["outputs"]):
            hist[c].append({"role": "assistant", "content": o.outputs[0].text or "ok"})
        tot["elapsed_s"] += r.elapsed_s
        tot["output_tokens"] += r.output_tokens
        tot["requests"] += len(reqs)
        tot["computed"] += r.extra["prompt_tokens_computed"]
        tot["cached"] += r.extra["prompt_tokens_cached"]
        tot["prompt_tokens"] += r.prompt_tokens
    return tot


def run(args) -> Report:
    from pagedllm.config.device import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    q = args.quick
    n = args.requests or (6 if q else 32)
    sys_tokens = args.system_tokens or (48 if q else 384)
    convs = args.conversations or (2 if q else 8)
    turns = args.turns or (2 if q else 4)
    out = 8 if q else 32
    num_sys = 2 if q else 4
    res: dict = {"shared": {}, "chat": {}}
    rows_a, rows_c = [], []
    src = None
    base_a = base_c = None
    for name, cache, policy in CONFIGS:
        llm = make_llm(args.dtype, seed=args.seed, **{**args.engine_args, "enable_prefix_caching": cache,
                                                       "scheduling_policy": policy})
        tok = llm.engine.tokenizer
        reqs, src = shared_workload(tok, n, sys_tokens, num_sys, out, args.seed, args.download_chat)
        engine_warmup(llm)
        r = run_engine(llm, reqs, desc=f"shared: {name}")
        computed, cached = r.extra["prompt_tokens_computed"], r.extra["prompt_tokens_cached"]
        hit = cached / (computed + cached) if computed + cached else 0.0
        a = {"elapsed_s": r.elapsed_s, "req_s": r.requests_per_s, "out_tok_s": r.output_tok_s, "hit_rate": hit,
             "prompt_computed": computed, "prompt_tokens": r.prompt_tokens}
        res["shared"][name] = a
        base_a = base_a or a
        rows_a.append([name, a["elapsed_s"], a["req_s"], a["out_tok_s"], 100 * hit, computed,
                       ratio(base_a["elapsed_s"], a["elapsed_s"])])
        t0 = time.monotonic()
        c = run_chat(llm, tok, convs, turns, sys_tokens, out, args.seed, args.download_chat)
        del t0
        hit_c = c["cached"] / (c["computed"] + c["cached"]) if c["computed"] + c["cached"] else 0.0
        cc = {"elapsed_s": c["elapsed_s"], "req_s": c["requests"] / c["elapsed_s"],
              "out_tok_s": c["output_tokens"] / c["elapsed_s"], "hit_rate": hit_c, "prompt_computed": c["computed"],
              "prompt_tokens": c["prompt_tokens"]}
        res["chat"][name] = cc
        base_c = base_c or cc
        rows_c.append([name, cc["elapsed_s"], cc["req_s"], cc["out_tok_s"], 100 * hit_c, c["computed"],
                       ratio(base_c["elapsed_s"], cc["elapsed_s"])])
        del llm
    cols = ["config", "time (s)", "req/s", "output tok/s", "hit rate %", "prompt tokens computed", "speedup"]
    mean_prompt = sum(r.prompt_len for r in reqs) / len(reqs)
    notes = [f"Shared system prompt: {n} requests over {num_sys} system prompts of {sys_tokens} tokens (Wikipedia "
             f"reference + instruction, interleaved), each + a question ({src}); mean prompt {mean_prompt:.0f} tokens; "
             f"{out} output tokens, ignore_eos, greedy; dtype {dtype}.",
             f"Multi-turn chat: {convs} conversations x {turns} turns, each starting from its own {sys_tokens}-token "
             f"system prompt; each turn resends the whole history (previous answers included); {out} output tokens.",
             "hit rate = prompt tokens served from the prefix cache / all prompt tokens; speedup vs no prefix cache."]
    res["speedup"] = {"shared": {k: base_a["elapsed_s"] / v["elapsed_s"] for k, v in res["shared"].items()},
                      "chat": {k: base_c["elapsed_s"] / v["elapsed_s"] for k, v in res["chat"].items()}}
    return Report("prefix", "Prefix caching: shared system prompt and multi-turn chat", notes,
                  [Table(cols, rows_a, "Shared system prompt", 2), Table(cols, rows_c, "Multi-turn chat", 2)], res)


def plot(fig, result: dict) -> None:
    for i, key in enumerate(("shared", "chat")):
        ax = fig.add_subplot(1, 2, i + 1)
        d = result[key]
        names = list(d)
        ax.bar(range(len(names)), [d[k]["elapsed_s"] for k in names], color=["tab:gray", "tab:orange", "tab:green"])
        ax.set_xticks(range(len(names)), [k.replace(", ", "\n") for k in names], fontsize=7)
        ax.set_ylabel("time (s)")
        for j, k in enumerate(names):
            ax.text(j, d[k]["elapsed_s"], f"hit {100 * d[k]['hit_rate']:.0f}%", ha="center", va="bottom", fontsize=7)
        ax.set_title("shared system prompt" if key == "shared" else "multi-turn chat", fontsize=9)
