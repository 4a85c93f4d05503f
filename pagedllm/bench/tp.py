"""``pagedllm bench tp``: W1 on our engine at TP=1 with every core to one process, against TP=N with the
cores split between the ranks (``cpu_count // N`` threads each, what ``TensorParallelExecutor`` gives
them), alternating fresh processes so the VM's drift falls on both alike. On one CPU socket TP does not
add memory bandwidth or cores, so this measures what the sharding and the per-layer all-reduces cost."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from pagedllm.bench.compare import run_w1
from pagedllm.bench.report import Report, Table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel size set against TP=1 (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="TP=1 / TP=N pairs, alternating (default 2)")


def run(args) -> Report:
    here = Path(__file__).resolve().parents[2]
    cores = os.cpu_count() or 1
    configs = {1: ({}, cores), args.tp: ({"tensor_parallel_size": args.tp}, None)}  # ranks set their own threads
    runs: list[tuple[int, dict]] = []
    for r in range(args.rounds):
        for tp in (1, args.tp) if r % 2 == 0 else (args.tp, 1):
            engine, threads = configs[tp]
            res = run_w1(here, args, engine, threads)
            print(f"round {r + 1} TP={tp}: {res['out_tok_s']:.1f} out tok/s", file=sys.stderr)
            runs.append((tp, res))
    mean = {tp: statistics.fmean(res["out_tok_s"] for t, res in runs if t == tp) for tp in (1, args.tp)}
    ratio = mean[args.tp] / mean[1]
    rep = Report("tp", f"W1 out tok/s: TP=1 ({cores} threads) vs TP={args.tp} ({max(1, cores // args.tp)} "
                 "thread(s) per rank), alternating fresh processes",
                 [f"model {args.engine_args.get('model') or 'SmolLM2-135M-Instruct (embedded)'}; {args.rounds} rounds; "
                  f"TP={args.tp} / TP=1 = {ratio:.3f} (means {mean[args.tp]:.1f} / {mean[1]:.1f} out tok/s)"])
    rep.tables.append(Table(["round", "TP", "out tok/s", "seconds"],
                            [[i // 2 + 1, tp, res["out_tok_s"], res["elapsed_s"]] for i, (tp, res) in enumerate(runs)]))
    rep.result = {"tp": args.tp, "cores": cores, "runs": [{"tp": tp, **res} for tp, res in runs],
                  "ratio_tp_over_tp1": ratio}
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    for tp, color in ((1, "tab:gray"), (result["tp"], "tab:blue")):
        xs = [i for i, r in enumerate(result["runs"]) if r["tp"] == tp]
        ax.bar(xs, [result["runs"][i]["out_tok_s"] for i in xs], color=color, label=f"TP={tp}")
    ax.set_xlabel("run (alternating)")
    ax.set_ylabel("W1 out tok/s")
    ax.set_title(f"TP={result['tp']} / TP=1 = {result['ratio_tp_over_tp1']:.3f}")
    ax.legend()
