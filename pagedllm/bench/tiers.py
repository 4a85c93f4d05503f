"""``pagedllm bench tiers``: KV tiers below the pool (host RAM L2, disk L3) on a multi-turn chat trace and a
Zipf RAG trace; tiers off / L2 / L2 + L3 / after a restart, and the tiers' eviction policies compared.

* chat (bench/tiers_chat.py): conversations over shared system prompts, each turn sending the whole history;
  per-user arrivals with think times (``--arrivals users``) or all conversations' turn t at once (``waves``).
* rag: R requests, each a document picked with Zipf popularity from D documents plus a question; the host
  tier holds only some documents, so what it keeps decides the hits.

Prompts are token ids (the cache does not care what they say); greedy, ``ignore_eos``. Each configuration is
a fresh engine; "after restart" is a new engine on the L3 directory the previous run left, replaying the
returning turns (chat) or the whole trace (rag).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile

from pagedllm.bench import tiers_common as tc
from pagedllm.bench.common import RunResult, run_engine
from pagedllm.bench.report import Report, Table
from pagedllm.bench.tiers_chat import run_chat_configs
from pagedllm.bench.tiers_common import Sizes
from pagedllm.bench.workloads import BenchRequest


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=None, help="chat conversations (default 200; quick 8)")
    p.add_argument("--turns", type=int, default=None, help="turns per conversation (default 5; quick 3)")
    p.add_argument("--documents", type=int, default=None, help="RAG documents (default 64; quick 8)")
    p.add_argument("--rag-requests", type=int, default=None, help="RAG requests (default 400; quick 24)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity (default 1.0)")
    p.add_argument("--disk-dir", default=None, help="L3 directory (default: a fresh temp dir, removed after)")
    p.add_argument("--traces", default="chat,rag", help="which traces to run (default chat,rag)")
    p.add_argument("--arrivals", default="users", help="chat arrivals: users (think time after each answer; "
                   "default) or waves (every conversation's turn t at once)")
    p.add_argument("--users", type=int, default=None, help="chat users under way at once (default: one per "
                   "conversation)")
    p.add_argument("--think-time", type=float, default=None, help="chat users' mean think time in s, "
                   "exponential (default 5.0; quick 0.05)")
    for flag, what in (("system", "shared system prompt"), ("context", "conversation's own opening"),
                       ("question", "question of each turn"), ("answer", "answer of each turn (joins the history)")):
        p.add_argument(f"--{flag}-tokens", type=int, default=None,
                       help=f"chat: tokens of the {what} (default: the --arrivals preset, see tiers_common.Sizes)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="chat: sequences a step at most (default 32; "
                   "quick 2); the pool is a quarter of the live working set but at least this many longest prompts")


def run_rag(llm, s: Sizes, seed: int, zipf: float) -> RunResult:
    rng = random.Random(seed + 1)
    docs = [tc.ids(rng, s.doc_tokens) for _ in range(s.documents)]
    weights = [1 / (i + 1) ** zipf for i in range(s.documents)]
    picks = rng.choices(range(s.documents), weights, k=s.rag_requests)
    reqs = [BenchRequest(docs[d] + tc.ids(rng, s.question_tokens), s.rag_out) for d in picks]
    # arrivals in small groups: popularity, not one giant batch, decides what stays cached
    runs = [run_engine(llm, reqs[i:i + s.rag_max_num_seqs], desc="rag", progress=False)
            for i in range(0, len(reqs), s.rag_max_num_seqs)]
    return tc.merge(runs)


def _rag(args, s: Sizes, disk_dir: str) -> list[dict]:
    rows = []
    probe = tc.engine(args, s, s.rag_l1, s.rag_max_num_seqs)
    l2 = tc.tier_bytes(probe, s.rag_l2)
    probe.engine.shutdown()
    configs = [("tiers off", {}), ("L2, lru", {"kv_offload_memory": l2, "kv_eviction": "lru"}),
               ("L2, reuse", {"kv_offload_memory": l2, "kv_eviction": "reuse"}),
               ("L2 + L3, reuse", {"kv_offload_memory": l2, "kv_disk_path": disk_dir, "kv_eviction": "reuse"}),
               ("after restart (L2 + L3)", {"kv_offload_memory": l2, "kv_disk_path": disk_dir, "kv_eviction": "reuse"})]
    for name, tiers in configs:
        llm = tc.engine(args, s, s.rag_l1, s.rag_max_num_seqs, **tiers)
        before = llm.engine.pool_stats()
        r = run_rag(llm, s, args.seed, args.zipf)
        rows.append(tc.row(name, r, r.ttft_s, before, llm.engine.pool_stats(), s.block_size))
        tc.close(llm, rows[-1])
    return rows


def _chat_note(s: Sizes) -> str:
    shape = (f"chat ({s.arrivals} arrivals): {s.conversations} conversations x {s.turns} turns over {s.systems} shared "
             f"{s.system_tokens}-token system prompts, each conversation opening with its own {s.context_tokens} "
             f"tokens, then {s.user_tokens}-token questions and {s.out_tokens}-token answers; working set "
             f"{s.chat_working_set} blocks of {s.block_size}, pool (L1) {s.chat_l1} blocks, L2 {s.chat_l2} blocks; "
             f"TTFT over returning turns (2..{s.turns}), ")
    if s.arrivals == "waves":
        return shape + "each turn's requests arriving together; hit tokens over the returning turns."
    return shape + (f"from each request's arrival: {s.users} users under way at once, joining evenly over "
                    f"{s.think_time:g} s, each sending its next question an exponential think time (mean "
                    f"{s.think_time:g} s) after its answer; hit tokens per tier over every turn.")


COLUMNS = ["config", "TTFT p50 (ms)", "TTFT p99 (ms)", "out tok/s", "hit tokens", "L1", "L2", "L3",
           "computed tokens", "promotion (ms)"]


def _table(rows: list[dict], title: str, ttft_of: str) -> Table:
    return Table([c if "TTFT" not in c else f"{c} {ttft_of}" for c in COLUMNS],
                 [[r["config"], 1000 * (r["ttft_p50_s"] or 0), 1000 * (r["ttft_p99_s"] or 0), r["out_tok_s"],
                   r["hit_tokens"], r["l1_hit_tokens"], r["l2_hit_tokens"], r["l3_hit_tokens"], r["computed_tokens"],
                   r["promotion_ms"]] for r in rows], title, 1)


def run(args) -> Report:
    from pagedllm.config.device import resolve_dtype

    s = Sizes(args)
    own_dir = args.disk_dir is None
    root = tempfile.mkdtemp(prefix="pagedllm-tiers-") if own_dir else args.disk_dir
    try:
        traces = set(args.traces.split(","))
        if not traces or traces - {"chat", "rag"}:
            raise SystemExit(f"--traces: chat and/or rag, got {args.traces!r}")
        chat = run_chat_configs(args, s, os.path.join(root, "chat")) if "chat" in traces else []
        rag = _rag(args, s, os.path.join(root, "rag")) if "rag" in traces else []
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    summary = {}
    if chat:
        off, l2c, l3c, restart = chat
        summary.update({
            "chat_ttft_p50_speedup_l2": off["ttft_p50_s"] / l2c["ttft_p50_s"],
            "chat_ttft_p50_speedup_l2_l3": off["ttft_p50_s"] / l3c["ttft_p50_s"],
            "chat_restart_hit_fraction": restart["returning_hit_tokens"] / max(l3c["returning_hit_tokens"], 1),
            # the wait-or-recompute rule: a promoted block vs a recomputed one (wall time of the whole run per
            # computed block, decode included: an upper bound on prefill alone)
            "promotion_ms_per_block_l2": l2c["promotion_ms_per_block"],
            "promotion_ms_per_block_l3": restart["promotion_ms_per_block"],
            "compute_ms_per_block": off["prefill_ms_per_block"],
        })
    if rag:
        summary["rag_reuse_vs_lru_hit_tokens"] = rag[2]["hit_tokens"] / max(rag[1]["hit_tokens"], 1)
    notes = [(f"dtype {resolve_dtype(args.dtype)}; max_num_seqs {s.max_num_seqs} (chat), {s.rag_max_num_seqs} (rag); "
              "greedy, ignore_eos.")]
    if chat:
        notes.append(_chat_note(s))
    if rag:
        notes.append(f"rag: {s.rag_requests} requests over {s.documents} {s.doc_tokens}-token documents, Zipf "
                     f"{args.zipf}, +{s.question_tokens}-token questions, arriving {s.rag_max_num_seqs} at a time; "
                     f"pool {s.rag_l1} blocks, L2 {s.rag_l2} blocks (an eighth of the documents); TTFT over all "
                     "requests.")
    if chat:
        notes.append("targets (chat): returning-turn TTFT p50 3x lower than tiers off ({:.2f}x with L2, {:.2f}x with "
                     "L2 + L3); after a restart >= 90% of the returning turns' hit tokens ({:.0%}).".format(
                         summary["chat_ttft_p50_speedup_l2"], summary["chat_ttft_p50_speedup_l2_l3"],
                         summary["chat_restart_hit_fraction"]))
        notes.append("wait or recompute: a block promoted from L2 took {:.2f} ms, from L3 (after restart) {:.2f} ms, "
                     "against {:.1f} ms of engine time per block computed with tiers off, so a request always waits "
                     "for its blocks.".format(summary["promotion_ms_per_block_l2"], summary["promotion_ms_per_block_l3"],
                                              summary["compute_ms_per_block"]))
    if rag:
        notes.append("target (rag): reuse eviction >= 1.10x LRU's hit tokens ({:.2f}x).".format(
            summary["rag_reuse_vs_lru_hit_tokens"]))
    tables = ([_table(chat, f"Multi-turn chat, {s.arrivals} arrivals (TTFT: returning turns)", "returning")]
              if chat else []) + (
        [_table(rag, "RAG, Zipf document popularity", "all")] if rag else [])
    return Report("tiers", "KV tiers: host RAM and disk below the pool", notes, tables,
                  {"chat": chat, "rag": rag, "summary": summary})


def plot(fig, result: dict) -> None:
    for i, key in enumerate(k for k in ("chat", "rag") if result[k]):
        rows = result[key]
        ax = fig.add_subplot(1, 2, i + 1)
        names = [r["config"].replace(" (", "\n(").replace(", ", ",\n") for r in rows]
        bottom = [0.0] * len(rows)
        for tier, color in (("l1", "tab:gray"), ("l2", "tab:orange"), ("l3", "tab:green")):
            vals = [r[f"{tier}_hit_tokens"] for r in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, color=color, label=tier.upper())
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(rows)), names, fontsize=6)
        ax.set_ylabel("prompt tokens hit")
        ax2 = ax.twinx()
        ax2.plot(range(len(rows)), [1000 * (r["ttft_p50_s"] or 0) for r in rows], "k.-", label="TTFT p50")
        ax2.set_ylabel("TTFT p50 (ms)")
        ax.set_title("multi-turn chat (returning turns)" if key == "chat" else "RAG (Zipf)", fontsize=9)
        if i == 0:
            ax.legend(fontsize=7, loc="upper left")
