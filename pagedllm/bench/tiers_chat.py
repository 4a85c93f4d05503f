"""``pagedllm bench tiers --traces chat``: C conversations x T turns over a few shared system prompts; each
turn sends the whole history (earlier answers included) plus a new question.

Two arrival modes (``--arrivals``):

* ``users`` (default), as LMCache's multi-round QA and SGLang HiCache's multi-turn bench run it: U users
  (default: one per conversation, all under way at once, as HiCache's clients), each sending its next question
  a think time after its previous answer came back (exponential, seeded per conversation and turn: the same
  schedule relative to each answer in every configuration). Users join evenly over one mean think time (as
  LMCache spreads its users' starts); with U < C a user starts its next conversation after its last answer
  and a think time (LMCache's fixed number of concurrent users). The engine is stepped in this thread; a
  request is added at the first step boundary after its arrival and its TTFT counts from the arrival (a
  server queues it meanwhile).
* ``waves``: every conversation's turn t at once, then turn t + 1 (the first trace: TTFT is mostly queueing).
"""

from __future__ import annotations

import heapq
import random
import sys
import time

from pagedllm.bench.common import RunResult, run_engine
from pagedllm.bench.tiers_common import (
    Sizes,
    close,
    engine,
    ids,
    merge,
    row,
    tier_bytes,
)
from pagedllm.bench.workloads import BenchRequest


def chat_trace(s: Sizes, seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's opening (shared system prompt + its own context) and its T questions."""
    rng = random.Random(seed)
    systems = [ids(rng, s.system_tokens) for _ in range(s.systems)]
    hist = [systems[c % s.systems] + ids(rng, s.context_tokens) for c in range(s.conversations)]
    questions = [[ids(rng, s.user_tokens) for _ in range(s.turns)] for _ in range(s.conversations)]
    return hist, questions


def think_times(s: Sizes, seed: int) -> list[list[float]]:
    """[c][t]: the think time before conversation c's turn t + 1 (t = T - 1: before the user's next conversation)."""
    rng = random.Random(seed + 2)
    return [[rng.expovariate(1 / s.think_time) for _ in range(s.turns)] for _ in range(s.conversations)]


def run_waves(llm, s: Sizes, seed: int, replay: list[list[BenchRequest]] | None = None) -> dict:
    """The chat trace turn by turn (or ``replay``: given waves of requests); per-turn results and prompts, and
    the engine's ``pool_stats`` before each wave and after the last (``stats``: per-tier hits of any turns)."""
    hist, questions = chat_trace(s, seed)
    waves, runs, stats = [], [], [llm.engine.pool_stats()]
    for t in range(s.turns if replay is None else len(replay)):
        if replay is None:
            reqs = [BenchRequest(hist[c] + questions[c][t], s.out_tokens) for c in range(s.conversations)]
        else:
            reqs = replay[t]
        r = run_engine(llm, reqs, desc=f"chat turn {t + 1}", progress=False)
        if replay is None:
            for c, o in enumerate(r.extra["outputs"]):
                hist[c] = reqs[c].prompt_ids + list(o.outputs[0].token_ids)
        waves.append(reqs)
        runs.append(r)
        stats.append(llm.engine.pool_stats())
    return {"waves": waves, "runs": runs, "stats": stats}


def run_users(llm, s: Sizes, seed: int, replay: dict[tuple[int, int], list[int]] | None = None,
              first_turn: int = 0) -> dict:
    """The chat trace with per-user arrivals (module doc). ``replay``: the prompts of a previous run by
    (conversation, turn), sent from ``first_turn`` on (a restart replays the returning turns).

    Returns ``records`` (one per request: conversation, turn, arrival, TTFT and finish in s, prompt, cached
    and output tokens), ``prompts`` by (conversation, turn), and the run's RunResult (all requests)."""
    from pagedllm.protocol import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=s.out_tokens, ignore_eos=True, temperature=0.0)
    hist, questions = chat_trace(s, seed)
    think = think_times(s, seed)
    # user u runs conversations u, u + U, u + 2U, ...; users join evenly over one mean think time
    pending = [(u * s.think_time / s.users, u, first_turn) for u in range(s.users)]
    heapq.heapify(pending)
    stats0 = (eng.stats.prompt_tokens_computed, eng.stats.prompt_tokens_cached)
    live: dict[str, tuple[int, int, float, list[int]]] = {}
    records, prompts = [], {}
    t0 = time.monotonic()
    while pending or live:
        now = time.monotonic() - t0
        while pending and pending[0][0] <= now:
            arrival, c, t = heapq.heappop(pending)
            prompt = replay[(c, t)] if replay is not None else hist[c] + questions[c][t]
            prompts[(c, t)] = prompt
            live[eng.add_request(prompt, params)] = (c, t, arrival, prompt)
        if not live:  # idle until the next arrival
            time.sleep(max(0.0, pending[0][0] - (time.monotonic() - t0)))
            continue
        for o in eng.step():
            if not o.finished:
                continue
            c, t, arrival, prompt = live.pop(o.request_id)
            out = list(o.outputs[0].token_ids)
            hist[c] = prompt + out
            records.append({"conversation": c, "turn": t, "arrival_s": arrival,
                            "ttft_s": o.metrics.first_token_time - t0 - arrival,
                            "finished_s": o.metrics.finished_time - t0,
                            "prompt_tokens": len(prompt), "cached_tokens": o.num_cached_tokens,
                            "output_tokens": len(out)})
            back = records[-1]["finished_s"] + think[c][t]
            if t + 1 < s.turns:
                heapq.heappush(pending, (back, c, t + 1))
            elif c + s.users < s.conversations:
                heapq.heappush(pending, (back, c + s.users, first_turn))
    res = RunResult("pagedllm", time.monotonic() - t0, len(records), sum(r["prompt_tokens"] for r in records),
                    sum(r["output_tokens"] for r in records), ttft_s=[r["ttft_s"] for r in records])
    res.extra = {"prompt_tokens_computed": eng.stats.prompt_tokens_computed - stats0[0],
                 "prompt_tokens_cached": eng.stats.prompt_tokens_cached - stats0[1]}
    return {"records": records, "prompts": prompts, "result": res}


def users_row(name: str, res: dict, before: dict, after: dict, s: Sizes) -> dict:
    """Tier columns over every request of the run (they add up to its hit tokens); TTFT over returning turns."""
    returning = [r for r in res["records"] if r["turn"] > 0]
    out = row(name, res["result"], [r["ttft_s"] for r in returning], before, after, s.block_size)
    out["returning_hit_tokens"] = sum(r["cached_tokens"] for r in returning)
    out["returning_prompt_tokens"] = sum(r["prompt_tokens"] for r in returning)
    out["requests"] = len(res["records"])
    return out


def waves_row(name: str, runs: list[RunResult | None], before: dict, after: dict, s: Sizes) -> dict:
    """Every column over the returning turns (``runs[1:]``; ``before`` / ``after``: the stats around them)."""
    returning = [r for r in runs[1:] if r is not None]
    merged = merge(returning)
    out = row(name, merged, [t for r in returning for t in r.ttft_s], before, after, s.block_size)
    out["returning_hit_tokens"] = merged.extra["prompt_tokens_cached"]
    out["returning_prompt_tokens"] = merged.prompt_tokens
    out["requests"] = sum(r.num_requests for r in runs if r is not None)
    return out


def run_chat_configs(args, s: Sizes, disk_dir: str) -> list[dict]:
    """Tiers off, L2, L2 + L3, then a restart on L2 + L3's disk directory replaying the returning turns."""
    users = s.arrivals == "users"
    rows = []
    configs = [("tiers off", {}), ("L2", {"kv_offload_memory": "L2"}),
               ("L2 + L3", {"kv_offload_memory": "L2", "kv_disk_path": disk_dir})]
    replay = l2_bytes = None
    for name, tiers in configs:
        llm = engine(args, s, s.chat_l1, s.max_num_seqs)
        if tiers:
            l2_bytes = l2_bytes or tier_bytes(llm, s.chat_l2)
            llm.engine.shutdown()
            llm = engine(args, s, s.chat_l1, s.max_num_seqs, **{**tiers, "kv_offload_memory": l2_bytes})
        if users:
            before = llm.engine.pool_stats()
            res = run_users(llm, s, args.seed)
            rows.append(users_row(name, res, before, llm.engine.pool_stats(), s))
            replay = res["prompts"]
        else:
            res = run_waves(llm, s, args.seed)
            rows.append(waves_row(name, res["runs"], res["stats"][1], res["stats"][-1], s))
            replay = res["waves"][1:]
        close(llm, rows[-1])
        _progress(rows[-1])
    llm = engine(args, s, s.chat_l1, s.max_num_seqs, kv_offload_memory=l2_bytes, kv_disk_path=disk_dir)
    name = "after restart (L2 + L3)"
    if users:
        before = llm.engine.pool_stats()
        rows.append(users_row(name, run_users(llm, s, args.seed, replay, first_turn=1), before,
                              llm.engine.pool_stats(), s))
    else:
        res = run_waves(llm, s, args.seed, replay)
        rows.append(waves_row(name, [None] + res["runs"], res["stats"][0], res["stats"][-1], s))
    close(llm, rows[-1])
    _progress(rows[-1])
    return rows


def _progress(row: dict) -> None:
    """One line per configuration on stderr: a run of four takes most of an hour below saturation."""
    print(f"bench tiers: chat, {row['config']}: returning-turn TTFT p50 {1000 * (row['ttft_p50_s'] or 0):.0f} ms, "
          f"p99 {1000 * (row['ttft_p99_s'] or 0):.0f} ms, {row['hit_tokens']} hit / {row['computed_tokens']} computed "
          f"tokens", file=sys.stderr, flush=True)
