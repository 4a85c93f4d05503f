"""``pagedllm bench tiers``: KV tiers below the pool (host RAM L2, disk L3) on a multi-turn chat trace and a
Zipf RAG trace; tiers off / L2 / L2 + L3 / after a restart, and the tiers' eviction policies compared.

* chat: C conversations x T turns; each starts from one of a few shared system prompts and each turn
  sends the whole history (earlier answers included) plus a new question. Turns go out in waves (every
  conversation's turn t, then turn t + 1), so by the time a conversation returns the other conversations
  have pushed its blocks out of a pool sized to about a quarter of the working set.
* rag: R requests, each a document picked with Zipf popularity from D documents plus a question; the host
  tier holds only some documents, so what it keeps decides the hits.

Prompts are token ids (the cache does not care what they say); greedy, ``ignore_eos``. Each configuration is
a fresh engine; "after restart" is a new engine on the L3 directory the previous run left, replaying the
returning turns (chat) or the whole trace (rag). Hit tokens per tier: L1 = prompt tokens read from the pool
that no tier promoted, L2 / L3 = tokens promoted from host RAM / disk.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile

from pagedllm.bench.common import RunResult, make_llm, percentile, run_engine
from pagedllm.bench.report import Report, Table
from pagedllm.bench.workloads import BenchRequest

VOCAB = (1000, 30000)  # plain-token id range for synthetic prompts


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=None, help="chat conversations (default 200; quick 8)")
    p.add_argument("--turns", type=int, default=None, help="turns per conversation (default 5; quick 3)")
    p.add_argument("--documents", type=int, default=None, help="RAG documents (default 64; quick 8)")
    p.add_argument("--rag-requests", type=int, default=None, help="RAG requests (default 400; quick 24)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity (default 1.0)")
    p.add_argument("--disk-dir", default=None, help="L3 directory (default: a fresh temp dir, removed after)")
    p.add_argument("--traces", default="chat,rag", help="which traces to run (default chat,rag)")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


class Sizes:
    """Token and block counts of one run (full or --quick)."""

    def __init__(self, args) -> None:
        q = args.quick
        self.block_size = 16
        self.conversations = args.conversations or (8 if q else 200)
        self.turns = args.turns or (3 if q else 5)
        self.systems = 2 if q else 4
        self.system_tokens = 32
        self.context_tokens = 16 if q else 32  # the conversation's own opening (a pasted text, a long first ask)
        self.user_tokens = 8
        self.out_tokens = 4
        self.documents = args.documents or (16 if q else 64)
        self.doc_tokens = 64 if q else 128
        self.rag_requests = args.rag_requests or (24 if q else 200)
        self.question_tokens = 8 if q else 16
        self.rag_out = 2 if q else 4
        self.max_num_seqs = 2 if q else 32
        self.rag_max_num_seqs = 2 if q else 8  # a small pool: a handful of documents fit
        bs = self.block_size
        last_turn = (self.system_tokens + self.context_tokens + self.turns * self.user_tokens
                     + (self.turns - 1) * self.out_tokens)
        self.chat_working_set = self.conversations * -(-last_turn // bs)  # blocks
        # the pool: a quarter of the working set, but room for a full batch of the longest prompts
        self.chat_l1 = max(self.chat_working_set // 4, self.max_num_seqs * (-(-(last_turn + self.out_tokens) // bs) + 1))
        self.chat_l2 = self.chat_working_set
        doc_blocks = self.doc_tokens // bs
        rag_prompt = -(-(self.doc_tokens + self.question_tokens + self.rag_out) // bs)
        self.rag_l1 = self.rag_max_num_seqs * (rag_prompt + 1)
        self.rag_l2 = max(self.documents * doc_blocks // 8, doc_blocks)  # an eighth of the documents


def _chat_trace(s: Sizes, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    systems = [_ids(rng, s.system_tokens) for _ in range(s.systems)]
    hist = [systems[c % s.systems] + _ids(rng, s.context_tokens) for c in range(s.conversations)]
    questions = [[_ids(rng, s.user_tokens) for _ in range(s.turns)] for _ in range(s.conversations)]
    return hist, questions


def run_chat(llm, s: Sizes, seed: int, replay: list[list[BenchRequest]] | None = None) -> dict:
    """The chat trace turn by turn (or ``replay``: given waves of requests); per-turn results and prompts."""
    hist, questions = _chat_trace(s, seed)
    waves, runs = [], []
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
    return {"waves": waves, "runs": runs}


def run_rag(llm, s: Sizes, seed: int, zipf: float) -> RunResult:
    rng = random.Random(seed + 1)
    docs = [_ids(rng, s.doc_tokens) for _ in range(s.documents)]
    weights = [1 / (i + 1) ** zipf for i in range(s.documents)]
    picks = rng.choices(range(s.documents), weights, k=s.rag_requests)
    reqs = [BenchRequest(docs[d] + _ids(rng, s.question_tokens), s.rag_out) for d in picks]
    # arrivals in small groups: popularity, not one giant batch, decides what stays cached
    runs = [run_engine(llm, reqs[i:i + s.rag_max_num_seqs], desc="rag", progress=False)
            for i in range(0, len(reqs), s.rag_max_num_seqs)]
    return _merge(runs)


def _merge(runs: list[RunResult]) -> RunResult:
    out = RunResult("pagedllm", sum(r.elapsed_s for r in runs), sum(r.num_requests for r in runs),
                    sum(r.prompt_tokens for r in runs), sum(r.output_tokens for r in runs))
    for r in runs:
        out.ttft_s += r.ttft_s
    out.extra = {k: sum(r.extra[k] for r in runs) for k in ("prompt_tokens_computed", "prompt_tokens_cached")}
    return out


def _tier_tokens(before: dict, after: dict, bs: int) -> tuple[int, int]:
    host = after.get("host_tier_promoted_blocks", 0) - before.get("host_tier_promoted_blocks", 0)
    disk = after.get("disk_tier_promoted_blocks", 0) - before.get("disk_tier_promoted_blocks", 0)
    return host * bs, disk * bs


def _row(name: str, r: RunResult, returning: list[float], before: dict, after: dict, bs: int) -> dict:
    l2, l3 = _tier_tokens(before, after, bs)
    cached = r.extra["prompt_tokens_cached"]
    return {"config": name, "ttft_p50_s": percentile(returning, 50), "ttft_p99_s": percentile(returning, 99),
            "out_tok_s": r.output_tok_s, "req_s": r.requests_per_s, "elapsed_s": r.elapsed_s,
            "hit_tokens": cached, "l1_hit_tokens": max(cached - l2 - l3, 0), "l2_hit_tokens": l2, "l3_hit_tokens": l3,
            "prompt_tokens": r.prompt_tokens, "computed_tokens": r.extra["prompt_tokens_computed"],
            "promotion_ms": 1000 * after.get("promotion_seconds_mean", 0.0),
            "promotion_ms_per_block": _promotion_ms_per_block(after),
            "prefill_ms_per_block": 1000 * r.elapsed_s * bs / max(r.extra["prompt_tokens_computed"], 1)}


def _promotion_ms_per_block(s: dict) -> float:
    """Mean time from a tier hit to its blocks in the pool, per block (the cost of waiting instead of recomputing)."""
    blocks = s.get("host_tier_promoted_blocks", 0) + s.get("disk_tier_promoted_blocks", 0)
    return 1000 * s.get("promotion_seconds_mean", 0.0) * s.get("promotions", 0) / blocks if blocks else 0.0


def _engine(args, s: Sizes, num_blocks: int, max_num_seqs: int, **tiers):
    opts = {**args.engine_args, "num_blocks": num_blocks, "block_size": s.block_size, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": 2048, **tiers}
    opts.pop("kv_cache_memory", None)
    return make_llm(args.dtype, seed=args.seed, **opts)


def _bytes(llm, blocks: int) -> int:
    kv = llm.engine.forward_pass.kv_cache
    return blocks * kv.bytes_per_block(kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size, kv.dtype)


def _chat(args, s: Sizes, disk_dir: str) -> list[dict]:
    rows = []
    configs = [("tiers off", {}), ("L2", {"kv_offload_memory": "L2"}),
               ("L2 + L3", {"kv_offload_memory": "L2", "kv_disk_path": disk_dir})]
    replay = None
    for name, tiers in configs:
        llm = _engine(args, s, s.chat_l1, s.max_num_seqs)
        if tiers:
            llm.engine.shutdown()
            tiers = {**tiers, "kv_offload_memory": _bytes(llm, s.chat_l2)}
            llm = _engine(args, s, s.chat_l1, s.max_num_seqs, **tiers)
        before = llm.engine.kv.stats()
        res = run_chat(llm, s, args.seed)
        rows.append(_chat_row(name, res["runs"], before, llm.engine.kv.stats(), s))
        replay = res["waves"][1:]
        llm.engine.shutdown()  # L2 + L3: the pool's cached blocks go to disk
    llm = _engine(args, s, s.chat_l1, s.max_num_seqs, kv_offload_memory=_bytes(llm, s.chat_l2),
                  kv_disk_path=disk_dir)
    before = llm.engine.kv.stats()
    res = run_chat(llm, s, args.seed, replay)
    rows.append(_chat_row("after restart (L2 + L3)", [None] + res["runs"], before, llm.engine.kv.stats(), s))
    llm.engine.shutdown()
    return rows


def _chat_row(name: str, runs: list[RunResult | None], before: dict, after: dict, s: Sizes) -> dict:
    returning = [r for r in runs[1:] if r is not None]
    merged = _merge(returning)
    ttfts = [t for r in returning for t in r.ttft_s]
    row = _row(name, merged, ttfts, before, after, s.block_size)
    row["returning_hit_tokens"] = merged.extra["prompt_tokens_cached"]
    return row


def _rag(args, s: Sizes, disk_dir: str) -> list[dict]:
    rows = []
    probe = _engine(args, s, s.rag_l1, s.rag_max_num_seqs)
    l2 = _bytes(probe, s.rag_l2)
    probe.engine.shutdown()
    configs = [("tiers off", {}), ("L2, lru", {"kv_offload_memory": l2, "kv_eviction": "lru"}),
               ("L2, reuse", {"kv_offload_memory": l2, "kv_eviction": "reuse"}),
               ("L2 + L3, reuse", {"kv_offload_memory": l2, "kv_disk_path": disk_dir, "kv_eviction": "reuse"}),
               ("after restart (L2 + L3)", {"kv_offload_memory": l2, "kv_disk_path": disk_dir, "kv_eviction": "reuse"})]
    for name, tiers in configs:
        llm = _engine(args, s, s.rag_l1, s.rag_max_num_seqs, **tiers)
        before = llm.engine.kv.stats()
        r = run_rag(llm, s, args.seed, args.zipf)
        rows.append(_row(name, r, r.ttft_s, before, llm.engine.kv.stats(), s.block_size))
        llm.engine.shutdown()
    return rows


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
        chat = _chat(args, s, os.path.join(root, "chat")) if "chat" in traces else []
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
        notes.append(f"chat: {s.conversations} conversations x {s.turns} turns over {s.systems} shared "
                     f"{s.system_tokens}-token system prompts, each conversation opening with its own "
                     f"{s.context_tokens} tokens, then {s.user_tokens}-token questions and {s.out_tokens}-token "
                     f"answers; working set {s.chat_working_set} blocks of {s.block_size}, pool (L1) {s.chat_l1} "
                     f"blocks, L2 {s.chat_l2} blocks; TTFT over returning turns (2..{s.turns}), each turn's requests "
                     "arriving together.")
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
    tables = ([_table(chat, "Multi-turn chat (returning turns)", "returning")] if chat else []) + (
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
