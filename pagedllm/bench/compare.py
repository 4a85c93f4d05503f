"""``pagedllm bench compare --rev REV``: W1 on our engine (exact path, no baselines) with this checkout
and with git revision REV, alternately, each run in a fresh process, so the VM's drift falls on both
sides alike. Reports out tok/s per run and the new/old ratio per round and overall."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedllm.bench.report import Report, Table

# Uses only the API both revisions have (LLM.generate and the seeded W1 workload).
_RUN_W1 = """
import json, sys, time
from pagedllm import LLM, SamplingParams
from pagedllm.bench.workloads import W1, W1_QUICK, random_requests
quick, seed, dtype, engine = sys.argv[1] == "1", int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
w = W1_QUICK if quick else W1
llm = LLM(dtype=dtype, seed=seed, **{**({"kv_cache_memory": 256 << 20} if quick else {}), **engine})
reqs = random_requests(llm.tokenizer, w["num"], w["prompt_range"], w["output_range"], seed=seed)
warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
llm.generate([r.prompt_ids for r in reqs[:2]], warm, use_tqdm=False)
llm.reset_prefix_cache()
params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0) for r in reqs]
t0 = time.monotonic()
outs = llm.generate([r.prompt_ids for r in reqs], params, use_tqdm=False)
dt = time.monotonic() - t0
n = sum(len(o.outputs[0].token_ids) for o in outs)
print("RESULT " + json.dumps({"out_tok_s": n / dt, "elapsed_s": dt, "tokens": n}))
"""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rev", default="main", help="git revision to compare against (default main)")
    p.add_argument("--rounds", type=int, default=2, help="old/new pairs, alternating (default 2)")


def run_w1(root: Path, args, engine: dict | None = None, threads: int | None = None) -> dict:
    """W1 once in a fresh process on the package at ``root``: out tok/s, seconds, tokens. ``engine``: extra
    ``LLM`` keyword arguments; ``threads``: the process's OMP threads (default: inherited)."""
    env = {**os.environ, "PYTHONPATH": str(root), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    proc = subprocess.run([sys.executable, "-c", _RUN_W1, "1" if args.quick else "0", str(args.seed), args.dtype,
                           json.dumps({**args.engine_args, **(engine or {})})],
                          cwd=root, env=env, capture_output=True, text=True, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"W1 run in {root} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def run(args) -> Report:
    here = Path(__file__).resolve().parents[2]
    results: list[tuple[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-compare-") as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", str(old), args.rev], check=True,
                       capture_output=True)
        try:
            for r in range(args.rounds):
                for name, root in (("old", old), ("new", here)) if r % 2 == 0 else (("new", here), ("old", old)):
                    res = run_w1(root, args)
                    print(f"round {r + 1} {name}: {res['out_tok_s']:.1f} out tok/s", file=sys.stderr)
                    results.append((name, res))
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(old)], check=False,
                           capture_output=True)
    rev = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", args.rev], capture_output=True,
                         text=True).stdout.strip()
    rows = [[i // 2 + 1, name, res["out_tok_s"], res["elapsed_s"]] for i, (name, res) in enumerate(results)]
    old_rates = [res["out_tok_s"] for name, res in results if name == "old"]
    new_rates = [res["out_tok_s"] for name, res in results if name == "new"]
    ratio = statistics.fmean(new_rates) / statistics.fmean(old_rates)
    rep = Report("compare", f"W1 out tok/s: this checkout vs {args.rev} ({rev}), alternating fresh processes",
                 [f"{args.rounds} rounds; new/old = {ratio:.3f} (means {statistics.fmean(new_rates):.1f} / "
                  f"{statistics.fmean(old_rates):.1f} out tok/s)"])
    rep.tables.append(Table(["round", "engine", "out tok/s", "seconds"], rows))
    rep.result = {"rev": args.rev, "rev_sha": rev, "runs": [{"engine": n, **r} for n, r in results],
                  "ratio_new_over_old": ratio}
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    for name, color in (("old", "tab:gray"), ("new", "tab:blue")):
        xs = [i for i, r in enumerate(result["runs"]) if r["engine"] == name]
        ax.bar(xs, [result["runs"][i]["out_tok_s"] for i in xs], color=color, label=name)
    ax.set_xlabel("run (alternating)")
    ax.set_ylabel("W1 out tok/s")
    ax.set_title(f"new / {result['rev']} = {result['ratio_new_over_old']:.3f}")
    ax.legend()
