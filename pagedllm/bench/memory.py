"""``pagedllm bench memory``: seed 003's KV "wall" and seed 000's paged-KV overhead per block size.

KV bytes per token come from the model config and dtype (``KVCache.bytes_per_block``, checked against a
real ``KVCache`` pool tensor's ``nbytes``). Paged usage is measured by driving the real
``KVCacheManager`` (prefill allocation, then one ``allocate_slots`` per decoded token), so block
rounding is exactly what the engine does. Static = HF StaticCache's per-sequence reservation of
``max_seq_len`` slots; dynamic = HF DynamicCache's exact-size, grow-by-concat tensors.
"""

from __future__ import annotations

import argparse
import math

from tqdm.auto import tqdm

from pagedllm.bench.report import Report, Table

BLOCK_SIZES = (8, 16, 32, 64, 128)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-seq-len", type=int, default=2048, help="static reservation per sequence (seed 003: 2048)")
    p.add_argument("--concurrency", default=None, help="comma list (default 1,2,4,8,16,32)")


def _lengths(n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths with W1's distribution (prompt 32-512, output 16-256), seeded."""
    import random

    rng = random.Random(seed)
    return [(rng.randint(32, 512), rng.randint(16, 256)) for _ in range(n)]


def paged_blocks(lengths: list[tuple[int, int]], block_size: int, pbar: bool = False) -> tuple[int, int]:
    """Drive the real KVCacheManager: all sequences prefill, then decode token by token together.

    Returns (blocks in use when every sequence reached its final length, peak blocks in use).
    """
    from pagedllm.kv.kv_cache_manager import KVCacheManager

    need = sum(math.ceil((p + o) / block_size) for p, o in lengths)
    kv = KVCacheManager(need + 16, block_size, enable_prefix_caching=False)
    pos = {}
    for i, (p, _) in enumerate(lengths):
        assert kv.allocate_slots(i, 0, p)
        pos[i] = p
    peak = 0
    steps = max(o for _, o in lengths)
    for _ in tqdm(range(steps), desc=f"paged bs={block_size}", leave=False, disable=not pbar):
        for i, (p, o) in enumerate(lengths):
            if pos[i] < p + o:
                assert kv.allocate_slots(i, pos[i], 1)
                pos[i] += 1
        peak = max(peak, kv.stats()["used"])
    used = kv.stats()["used"]
    kv.check_integrity()
    return used, peak


def run(args) -> Report:
    import torch

    from pagedllm.config.device import resolve_dtype
    from pagedllm.kv.kv_cache import KVCache
    from pagedllm.models.loader import load_checkpoint

    dtype = resolve_dtype(args.dtype)
    cfg = load_checkpoint(None).config
    dims = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    bpt = KVCache.bytes_per_block(*dims, 1, dtype)
    # the pool tensor really costs bytes_per_block per block (no padding, no per-block metadata in the tensor)
    probe = KVCache(*dims, 4, 16, dtype=dtype)
    pool_ok = probe.data.nbytes == 4 * KVCache.bytes_per_block(*dims, 16, dtype)
    del probe

    conc = [int(x) for x in (args.concurrency or ("1,2,4" if args.quick else "1,2,4,8,16,32")).split(",")]
    maxlen = args.max_seq_len
    lengths_all = _lengths(max(conc), args.seed)
    G = 2**30
    rows, wall = [], []
    for c in tqdm(conc, desc="wall", leave=False):
        L = lengths_all[:c]
        toks = [p + o for p, o in L]
        need = sum(toks) * bpt
        static = c * maxlen * bpt
        dynamic = need  # exact-size tensors per sequence ...
        dyn_peak = need + max(toks) * bpt // cfg.num_layers  # ... plus one layer's copy during torch.cat
        copied = sum(t * (t + 1) // 2 for t in toks) * bpt  # bytes moved by grow-by-concat over the run
        used, _ = paged_blocks(L, 16)
        paged = used * KVCache.bytes_per_block(*dims, 16, dtype)
        row = {"concurrency": c, "avg_tok": sum(toks) / c, "needed_gb": need / G, "static_gb": static / G,
               "dynamic_gb": dyn_peak / G, "paged_gb": paged / G, "static_waste_pct": 100 * (static - need) / static,
               "dynamic_waste_pct": 100 * (dyn_peak - dynamic) / dyn_peak, "paged_waste_pct": 100 * (paged - need) / paged,
               "dynamic_copied_gb": copied / G}
        wall.append(row)
        rows.append([c, row["static_gb"], row["dynamic_gb"], row["paged_gb"], row["avg_tok"], row["static_waste_pct"],
                     row["paged_waste_pct"], row["dynamic_copied_gb"]])

    # overhead per block size: W1-like mix and seed 000's mixed batch (16 prompts 500..8000, + 128 output)
    n_mix = 4 if args.quick else 32
    mixes = {f"W1 mix ({n_mix} seqs)": _lengths(n_mix, args.seed + 1),
             "seed 000 mixed batch (16 x 500..8000 + 128 out)": [(500 * (i + 1), 128) for i in range(16)]
             if not args.quick else [(500 * (i + 1), 16) for i in range(2)]}
    orow, overhead = [], {}
    for name, L in mixes.items():
        overhead[name] = {}
        need_tokens = sum(p + o for p, o in L)
        for bs in BLOCK_SIZES:
            used, peak = paged_blocks(L, bs)
            bpb = KVCache.bytes_per_block(*dims, bs, dtype)
            table_bytes = used * 4  # int32 block-table entries
            paged = used * bpb + table_bytes
            ov = 100 * (paged / (need_tokens * bpt) - 1)
            overhead[name][bs] = ov
            orow.append([name, bs, used, paged / 2**20, need_tokens * bpt / 2**20, ov, "yes" if ov < 5 else "no"])
    notes = [f"SmolLM2-135M KV: {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} dims x 2 (K,V) "
             f"x {dtype} = {bpt / 1024:.1f} KiB per token; pool tensor bytes == blocks x bytes_per_block: {pool_ok}.",
             f"Wall: sequences with W1 lengths (prompt 32-512 + output 16-256, seeded), snapshot at full length. static = "
             f"c x {maxlen} slots (HF StaticCache); dynamic = exact tensors + one layer's transient copy while growing "
             f"(HF DynamicCache); paged = blocks of 16 held in the real KVCacheManager. 'copied' = bytes moved by "
             f"grow-by-concat over the sequences' lifetimes.",
             "Overhead = (paged blocks x bytes_per_block + int32 block tables) / (tokens x bytes per token) - 1; "
             "seed 000's target is < 5%."]
    rep = Report("memory", "KV memory: the wall and the paged overhead", notes,
                 [Table(["concur", "static GB", "dynamic GB", "paged GB", "avg tok", "static waste %", "paged waste %",
                         "dyn. copied GB"], rows, "The wall (seed 003)", 2),
                  Table(["workload", "block size", "blocks", "paged MiB", "minimum MiB", "overhead %", "< 5%"], orow,
                        "Paged overhead per block size (seed 000)", 2)],
                 {"bytes_per_token": bpt, "pool_bytes_match": pool_ok, "wall": wall, "overhead_pct": overhead,
                  "max_seq_len": maxlen})
    del torch
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(121)
    w = result["wall"]
    xs = [r["concurrency"] for r in w]
    for key, label in (("static_gb", "static (HF StaticCache)"), ("dynamic_gb", "dynamic (grow-by-concat)"),
                       ("paged_gb", "paged (block 16)"), ("needed_gb", "needed")):
        ax.plot(xs, [r[key] for r in w], marker="o", label=label, linestyle="--" if key == "needed_gb" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("KV GB")
    ax.legend(fontsize=6)
    ax.set_title("the wall", fontsize=9)
    ax2 = fig.add_subplot(122)
    for name, d in result["overhead_pct"].items():
        bs = sorted(int(k) for k in d)
        ax2.plot(bs, [d.get(b, d.get(str(b))) for b in bs], marker="o", label=name[:28])
    ax2.axhline(5, color="gray", linestyle=":", label="5% target")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("block size")
    ax2.set_ylabel("overhead %")
    ax2.legend(fontsize=6)
    ax2.set_title("paged overhead", fontsize=9)
