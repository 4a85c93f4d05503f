"""``pagedllm bench spec``: speculative decoding against none, in the same run, on the same engine settings:
decode speed and acceptance at batch 1 and batch 16, on a copy-heavy workload (fix the typos of a real
Wikipedia paragraph and return it whole, stopping at EOS) and on W1.

Batch b runs ``--requests`` requests in groups of b (one ``generate`` per group). Each group runs without and
with speculation back to back, which first alternating from group to group and round to round, so the machine's
load drifts into both sides alike; the 1-minute load average is recorded around every round.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field

from pagedllm.bench.report import Report, Table
from pagedllm.bench.workloads import W1, W1_QUICK, random_requests


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="ngram", choices=("ngram", "suffix", "draft_model"))
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--num-layers", type=int, default=None, help="draft_model: self-speculative draft depth")
    p.add_argument("--batches", default="1,16", help="comma list of batch sizes (default 1,16)")
    p.add_argument("--requests", type=int, default=None, help="requests per batch size and workload (default 16)")
    p.add_argument("--rounds", type=int, default=None, help="off/on rounds over every group (default 3)")
    p.add_argument("--max-tokens", type=int, default=None, help="copy workload output cap (default 320)")


@dataclass
class _Side:
    """One configuration's totals over the groups of one (workload, batch) cell."""

    wall: float = 0.0
    cpu: float = 0.0
    tokens: int = 0
    decode_tokens: int = 0  # output tokens after each request's first
    decode_wall: float = 0.0  # first token of the group to its last finish
    per_round: list[float] = field(default_factory=list)  # tok/s per round

    def add(self, wall: float, cpu: float, outs) -> None:
        self.wall += wall
        self.cpu += cpu
        self.tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        self.decode_tokens += sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        self.decode_wall += (max(o.metrics.finished_time for o in outs)
                             - min(o.metrics.first_token_time for o in outs))

    def rate(self) -> float:
        return self.tokens / self.wall

    def decode_rate(self) -> float:
        return self.decode_tokens / self.decode_wall if self.decode_wall > 0 else 0.0


def _copy_cap(args) -> int:
    """The copy workload's output cap (its answers end at EOS before it)."""
    return args.max_tokens or (16 if args.quick else 320)


def _workloads(tok, args, num: int) -> dict[str, tuple[list[list[int]], list[int], bool]]:
    """name -> (prompts, max_tokens, ignore_eos). The copy answers end at EOS; W1 decodes its set lengths."""
    from pagedllm.bench.spec_replay import copy_workload

    n_out = _copy_cap(args)
    w = W1_QUICK if args.quick else W1
    reqs = random_requests(tok, num, w["prompt_range"], w["output_range"], seed=args.seed)
    return {"copy": (copy_workload(tok, num, seed=args.seed), [n_out] * num, False),
            "W1": ([r.prompt_ids for r in reqs], [r.max_tokens for r in reqs], True)}


def _run(llm, prompts: list[list[int]], lens: list[int], ignore_eos: bool):
    from pagedllm.protocol import SamplingParams

    llm.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos) for n in lens]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, time.process_time() - c0, outs


def run(args) -> Report:
    from pagedllm.bench.common import make_llm

    spec = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "draft_model":
        spec["num_layers"] = args.num_layers or 8
    plain = make_llm(args.dtype, seed=args.seed, **args.engine_args)
    fast = make_llm(args.dtype, seed=args.seed, **{**args.engine_args, "speculative_config": json.dumps(spec)})
    stats = fast.engine.core.speculator.stats
    num = args.requests or (2 if args.quick else 16)
    rounds = args.rounds or (1 if args.quick else 3)
    batches = [int(b) for b in args.batches.split(",")]
    work = _workloads(plain.engine.tokenizer, args, num)
    cells = {(name, b): {"off": _Side(), "on": _Side(), "drafts": 0, "accepted": 0, "steps": 0, "same": True}
             for b in batches for name in work}
    loads = []
    for r in range(rounds):
        loads.append(os.getloadavg()[0])
        for b in batches:
            for name, (prompts, lens, ignore_eos) in work.items():
                cell = cells[(name, b)]
                round_tok = {"off": [0, 0.0], "on": [0, 0.0]}
                for g in range(0, num, b):
                    outs = {}
                    for side in (("off", "on") if (r + g // b) % 2 == 0 else ("on", "off")):
                        before = (stats.num_drafts, stats.num_accepted, stats.num_steps)
                        wall, cpu, outs[side] = _run(plain if side == "off" else fast, prompts[g:g + b],
                                                     lens[g:g + b], ignore_eos)
                        cell[side].add(wall, cpu, outs[side])
                        round_tok[side][0] += sum(len(o.outputs[0].token_ids) for o in outs[side])
                        round_tok[side][1] += wall
                        if side == "on":
                            cell["drafts"] += stats.num_drafts - before[0]
                            cell["accepted"] += stats.num_accepted - before[1]
                            cell["steps"] += stats.num_steps - before[2]
                    cell["same"] &= ([o.outputs[0].token_ids for o in outs["on"]]
                                     == [o.outputs[0].token_ids for o in outs["off"]])
                for side in ("off", "on"):
                    cell[side].per_round.append(round_tok[side][0] / round_tok[side][1])
    loads.append(os.getloadavg()[0])
    rows, raw = [], []
    for (name, b), c in cells.items():
        off, on = c["off"], c["on"]
        rate = c["accepted"] / c["drafts"] if c["drafts"] else 0.0
        mean_len = (c["accepted"] + c["steps"]) / c["steps"] if c["steps"] else 0.0
        res = {"workload": name, "batch": b, "tok_s_off": off.rate(), "tok_s_on": on.rate(),
               "speedup": on.rate() / off.rate(), "decode_speedup": on.decode_rate() / off.decode_rate(),
               "cpu_speedup": off.cpu / on.cpu, "acceptance": rate, "mean_accepted_length": mean_len,
               "identical": c["same"], "round_speedups": [a / z for a, z in zip(on.per_round, off.per_round)],
               "output_tokens": on.tokens}
        raw.append(res)
        rows.append([name, b, res["tok_s_off"], res["tok_s_on"], res["speedup"], res["decode_speedup"],
                     res["cpu_speedup"], rate, mean_len, "yes" if c["same"] else "NO"])
    rep = Report("spec", f"speculative decoding ({args.method}, k={args.k}) vs none, greedy, same run", [
        f"{num} requests per workload and batch size, in groups of the batch size; {rounds} round(s), off and on "
        "alternating group by group; copy = fix the typos of a Wikipedia paragraph and return it (ends at EOS, "
        f"cap {_copy_cap(args)} tokens), W1 = its prompt / output lengths",
        "tok/s = output tokens / wall time of LLM.generate; speedup = on / off tok/s; decode speedup = the same "
        "after each group's first token; cpu speedup = process CPU time off / on (the work, whatever the load)",
        "acceptance = kept drafts / drafts; mean accepted len = tokens gained per drafted step",
        f"1-minute load average at the start of each round and the end: {', '.join(f'{x:.2f}' for x in loads)}"])
    rep.tables.append(Table(["workload", "batch", "off tok/s", "on tok/s", "speedup", "decode speedup",
                             "cpu speedup", "acceptance", "mean accepted len", "same tokens"], rows, digits=2))
    rep.result = {"method": args.method, "k": args.k, "requests": num, "rounds": rounds, "loadavg": loads,
                  "runs": raw}
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    runs = result["runs"]
    labels = [f"{r['workload']}\nbatch {r['batch']}" for r in runs]
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r["speedup"] for r in runs], width=0.4, color="tab:blue", label="wall")
    ax.bar([i + 0.2 for i in x], [r["decode_speedup"] for r in runs], width=0.4, color="tab:orange",
           label="decode (after the first token)")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("speedup (on / off)")
    ax.legend()
    ax.set_title(f"speculative decoding: {result['method']}, k={result['k']}")
