"""``pagedllm bench threads``: batch-1 decode on a quiet machine and with a busy process pinned on one of our cores,
under OpenMP spin 10000, 1000 and 100 with fixed threads, and spin 10000 and 1000 with ``cpu_thread_policy=adaptive``
(what ships: 10000 on CPUs with AMX tiles, 1000 elsewhere; ``pagedllm/cpu_env.py``).

libgomp reads ``GOMP_SPINCOUNT`` once at start, so every measurement is a fresh process; the configurations
alternate within each round so the machine's drift falls on all of them alike. Targets (issue 36): adaptive quiet
at the spin-1000 figure, adaptive contended at least at the spin-100 figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from pagedllm.bench.report import Report, Table

CONFIGS = {  # name -> (GOMP_SPINCOUNT, cpu_thread_policy)
    "spin 10000, adaptive (the default with AMX)": ("10000", "adaptive"),
    "spin 10000, fixed threads": ("10000", "fixed"),
    "spin 1000, adaptive (the default without AMX)": ("1000", "adaptive"),
    "spin 1000, fixed threads": ("1000", "fixed"),
    "spin 100, fixed threads": ("100", "fixed"),
}
CONDITIONS = ("quiet", "contended")
BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; quick 1)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens per batch-1 run (default 128; quick 8)")


def child() -> None:
    """In a fresh process (its env holds the spin count): batch-1 decode tok/s as JSON on stdout."""
    from pagedllm.bench.common import engine_warmup, make_llm
    from pagedllm.bench.throughput import b1_request, decode_b1

    spec = json.loads(sys.argv[1])
    llm = make_llm(spec["dtype"], **spec["engine"])
    engine_warmup(llm)
    b1 = decode_b1(llm, llm.engine.forward_pass.model.act_dtype, b1_request(llm, spec["tokens"], 0), hf=False)
    g = llm.engine.forward_pass.threads
    print(json.dumps({"tok_s": b1["pagedllm"], "threads_at_end": g.threads if g else None,
                      "spin": os.environ.get("GOMP_SPINCOUNT")}))


def measure(config: str, contended: bool, dtype: str, engine: dict, tokens: int) -> dict:
    """One fresh process's batch-1 decode, with a busy process pinned on our last core while it runs."""
    spin, policy = CONFIGS[config]
    env = {**os.environ, "GOMP_SPINCOUNT": spin}
    spec = json.dumps({"dtype": dtype, "engine": {**engine, "cpu_thread_policy": policy, "num_blocks": 64},
                       "tokens": tokens})
    busy = None
    if contended:
        busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(max(os.sched_getaffinity(0)))])
    try:
        out = subprocess.run([sys.executable, "-c", "from pagedllm.bench.threads import child; child()", spec],
                             env=env, capture_output=True, text=True, check=True, timeout=600)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args) -> Report:
    rounds = args.rounds or (1 if args.quick else 3)
    tokens = args.decode_tokens or (8 if args.quick else 128)
    runs: dict[str, dict[str, list[float]]] = {c: {k: [] for k in CONFIGS} for c in CONDITIONS}
    threads: dict[str, dict[str, list]] = {c: {k: [] for k in CONFIGS} for c in CONDITIONS}
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for cond in CONDITIONS:
            for config in order:
                got = measure(config, cond == "contended", args.dtype, args.engine_args, tokens)
                runs[cond][config].append(got["tok_s"])
                threads[cond][config].append(got["threads_at_end"])
        loads.append(os.getloadavg()[0])
    rows = []
    for cond in CONDITIONS:
        for config in CONFIGS:
            vals = runs[cond][config]
            rows.append([cond, config, sum(vals) / len(vals), statistics.median(vals), min(vals), max(vals),
                         " / ".join(f"{v:.1f}" for v in vals), str(threads[cond][config])])
    notes = [(f"{os.cpu_count()} CPUs; {rounds} rounds, the configurations alternating, each a fresh process; "
              f"batch-1 decode of {tokens} tokens after a 32-token prompt; contended: a busy Python loop pinned on "
              f"CPU {max(os.sched_getaffinity(0))} for the whole run."),
             (f"1-minute load average at the start and after each round: {', '.join(f'{v:.1f}' for v in loads)} "
              "(other work on a shared machine counts as contention for the quiet runs too).")]
    # the median beside the mean: one run a neighbour disturbs moves a mean of five by several %
    table = Table(["machine", "configuration", "mean tok/s", "median", "min", "max", "runs",
                   "adaptive threads at the end"],
                  rows, "Batch-1 decode under OpenMP spin counts and the thread policy", 1)
    rep = Report("threads", "CPU threads on a shared machine: spin 10000 / 1000 adaptive, 10000 / 1000 / 100 fixed",
                 notes, [table])
    rep.result = {"runs": runs, "threads_at_end": threads, "loadavg": loads, "tokens": tokens, "rounds": rounds}
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    width = 0.8 / len(CONFIGS)
    for i, config in enumerate(CONFIGS):
        means = [sum(result["runs"][c][config]) / len(result["runs"][c][config]) for c in CONDITIONS]
        ax.bar([x + i * width for x in range(len(CONDITIONS))], means, width, label=config)
    ax.set_xticks([x + width for x in range(len(CONDITIONS))], list(CONDITIONS))
    ax.set_ylabel("batch-1 decode tok/s")
    ax.legend(fontsize=7)
