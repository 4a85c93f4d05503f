"""What ``pagedllm bench tiers``' chat and RAG traces share: sizes, synthetic ids, engines, one table row.

Hit tokens per tier: L1 = prompt tokens read from the pool that no tier promoted, L2 / L3 = tokens promoted
from host RAM / disk.
"""

from __future__ import annotations

import random

from pagedllm.bench.common import RunResult, make_llm, percentile

VOCAB = (1000, 30000)  # plain-token id range for synthetic prompts
ARRIVALS = ("users", "waves")


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


class Sizes:
    """Token and block counts of one run (full or --quick).

    Chat turn sizes depend on ``--arrivals``. ``waves`` keeps the first trace's short turns (32-token system
    prompt and opening, 8-token questions, 4-token answers) so its tables stay comparable. ``users`` follows
    LMCache's multi-round QA (one shared system prompt, a user context twice as long, short questions, answers
    that become history; a user's requests 20 s apart, about 7 answer-times of think) and SGLang HiCache's
    multi-turn bench (all clients under way at once), scaled to a 2-core CPU running SmolLM2 in fp32 (~2 ms a
    computed prompt token, ~90 ms a decode step of ~25 rows): a 64-token shared system prompt (twice the
    waves'), a 32-token opening, 8-token questions, 8-token answers (twice the waves'), and a mean think time
    of 5 s (7 x an 8-token answer's ~0.7 s). 200 x 5 turns then compute ~60 prompt tokens a returning turn
    with tiers off and ~24 with them; the four configurations took 22 min at load 8 (bench/README.md).
    ``--system-tokens``, ``--context-tokens``, ``--question-tokens`` and ``--answer-tokens`` set the turn sizes
    (the anchors' own sizes on a faster CPU).
    """

    def __init__(self, args) -> None:
        q = args.quick
        self.block_size = 16
        self.arrivals = getattr(args, "arrivals", "users")
        if self.arrivals not in ARRIVALS:
            raise SystemExit(f"--arrivals: one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        users = self.arrivals == "users"
        self.conversations = args.conversations or (8 if q else 200)
        self.turns = args.turns or (3 if q else 5)
        self.users = min(getattr(args, "users", None) or self.conversations, self.conversations)
        self.think_time = getattr(args, "think_time", None) or (0.05 if q else 5.0)  # mean, seconds
        self.systems = 2 if q else 4
        self.system_tokens = _given(args, "system_tokens") or (64 if users and not q else 32)
        self.context_tokens = _given(args, "context_tokens") or (16 if q else 32)  # the conversation's own opening
        self.user_tokens = _given(args, "question_tokens") or 8
        self.out_tokens = _given(args, "answer_tokens") or (6 if q and users else (8 if users else 4))
        self.documents = args.documents or (16 if q else 64)
        self.doc_tokens = 64 if q else 128
        self.rag_requests = args.rag_requests or (24 if q else 200)
        self.question_tokens = 8 if q else 16
        self.rag_out = 2 if q else 4
        self.max_num_seqs = getattr(args, "max_num_seqs", None) or (2 if q else 32)
        self.rag_max_num_seqs = 2 if q else 8  # a small pool: a handful of documents fit
        bs = self.block_size
        last_turn = (self.system_tokens + self.context_tokens + self.turns * self.user_tokens
                     + (self.turns - 1) * self.out_tokens)
        live = self.users if users else self.conversations  # conversations under way at once
        self.chat_working_set = live * _blocks(last_turn, bs)  # blocks
        # the pool: a quarter of the working set, but room for a full batch of the longest prompts
        self.chat_l1 = max(self.chat_working_set // 4, self.max_num_seqs * (_blocks(last_turn + self.out_tokens, bs) + 1))
        self.chat_l2 = self.conversations * _blocks(last_turn, bs)
        doc_blocks = self.doc_tokens // bs
        rag_prompt = _blocks(self.doc_tokens + self.question_tokens + self.rag_out, bs)
        self.rag_l1 = self.rag_max_num_seqs * (rag_prompt + 1)
        self.rag_l2 = max(self.documents * doc_blocks // 8, doc_blocks)  # an eighth of the documents


def _given(args, name: str) -> int | None:
    """A chat size set on the command line (``--system-tokens`` ...), refused if not positive; None if not set."""
    v = getattr(args, name, None)
    if v is not None and v < 1:
        raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    return v


def merge(runs: list[RunResult]) -> RunResult:
    out = RunResult("pagedllm", sum(r.elapsed_s for r in runs), sum(r.num_requests for r in runs),
                    sum(r.prompt_tokens for r in runs), sum(r.output_tokens for r in runs))
    for r in runs:
        out.ttft_s += r.ttft_s
    out.extra = {k: sum(r.extra[k] for r in runs) for k in ("prompt_tokens_computed", "prompt_tokens_cached")}
    return out


def _tier_tokens(before: dict, after: dict) -> tuple[int, int]:
    """Hit tokens whose blocks L2 / L3 promoted for the request that hit them, between two engine snapshots
    (counted when the hit is scheduled; a promoted block evicted unused, or promoted twice, is not a hit)."""
    return tuple(after[f"prompt_tokens_cached_{t}"] - before[f"prompt_tokens_cached_{t}"] for t in ("host", "disk"))


def row(name: str, r: RunResult, ttfts: list[float], before: dict, after: dict, bs: int) -> dict:
    """One configuration: TTFT over ``ttfts``, throughput and computed tokens of ``r``, hits per tier
    (``before`` / ``after``: the engine's ``pool_stats`` around the run)."""
    l2, l3 = _tier_tokens(before, after)
    cached = r.extra["prompt_tokens_cached"]
    return {"config": name, "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "out_tok_s": r.output_tok_s, "req_s": r.requests_per_s, "elapsed_s": r.elapsed_s,
            "hit_tokens": cached, "l1_hit_tokens": cached - l2 - l3, "l2_hit_tokens": l2, "l3_hit_tokens": l3,
            "prompt_tokens": r.prompt_tokens, "computed_tokens": r.extra["prompt_tokens_computed"],
            "promotion_ms": 1000 * after.get("promotion_seconds_mean", 0.0),
            "promotion_ms_per_block": _promotion_ms_per_block(after),
            "prefill_ms_per_block": 1000 * r.elapsed_s * bs / max(r.extra["prompt_tokens_computed"], 1)}


def _promotion_ms_per_block(s: dict) -> float:
    """Mean time from a tier hit to its blocks in the pool, per block (the cost of waiting instead of recomputing)."""
    blocks = s.get("host_tier_promoted_blocks", 0) + s.get("disk_tier_promoted_blocks", 0)
    return 1000 * s.get("promotion_seconds_mean", 0.0) * s.get("promotions", 0) / blocks if blocks else 0.0


def engine(args, s: Sizes, num_blocks: int, max_num_seqs: int, **tiers):
    opts = {**args.engine_args, "num_blocks": num_blocks, "block_size": s.block_size, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": 2048, **tiers}
    opts.pop("kv_cache_memory", None)
    return make_llm(args.dtype, seed=args.seed, **opts)


def tier_bytes(llm, blocks: int) -> int:
    kv = llm.engine.forward_pass.kv_cache
    return blocks * kv.bytes_per_block(kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size, kv.dtype)


def close(llm, row_: dict) -> None:
    """Check the pool after a configuration (invariants; no block held once every request finished), note it in
    the row, then shut the engine down (L2 + L3: the pool's cached blocks go to the tiers)."""
    eng = llm.engine
    eng.core.check_integrity()  # AssertionError, with what is wrong, on a broken invariant
    row_["used_blocks_after"] = eng.kv.stats()["used"]
    if row_["used_blocks_after"]:
        raise AssertionError(f"{row_['config']}: {row_['used_blocks_after']} blocks still held after the trace")
    eng.shutdown()
