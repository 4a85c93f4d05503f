"""Microbenchmark of the paged KV bookkeeping (no model): what the scheduler pays per step.

``run(quick=False) -> dict`` times (wall and process CPU) block allocate+free, fork, a 2,048-token prefix lookup, a decode
step's ``allocate_slots`` + ``cache_full_blocks`` and the batched slot mapping of 64 sequences;
``to_markdown`` renders it. Each figure is the median over repeats, in µs.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from pagedllm.bench.report import md_table
from pagedllm.kv import BlockPool, KVCacheManager, slot_mapping

BLOCK_SIZE = 16
TARGET_US_PER_BLOCK_OP = 5.0


def _time_us(fn: Callable[[], object], reps: int, inner: int) -> tuple[float, float]:
    """Median (wall, CPU) µs of one call over ``reps`` timings of ``inner`` back-to-back calls.
    CPU time of this process is the robust figure on a machine shared with other jobs."""
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter_ns(), time.process_time_ns()
        for _ in range(inner):
            fn()
        cpu.append((time.process_time_ns() - c0) / inner / 1e3)
        wall.append((time.perf_counter_ns() - t0) / inner / 1e3)
    return statistics.median(wall), statistics.median(cpu)


def run(quick: bool = False) -> dict:
    reps, inner = (3, 20) if quick else (7, 100)
    prompt_len, batch = 2048, 64
    nb = prompt_len // BLOCK_SIZE
    rows: list[dict] = []

    def add(name: str, us: tuple[float, float], blocks: int, note: str) -> None:
        wall, cpu = us
        rows.append({"op": name, "us": wall, "cpu_us": cpu, "blocks": blocks, "cpu_us_per_block": cpu / blocks,
                     "note": note})

    pool = BlockPool(4 * nb, BLOCK_SIZE)

    def pool_cycle() -> None:
        ids = [pool.allocate() for _ in range(nb)]
        for b in ids:
            pool.free(b)

    add("pool allocate+free", _time_us(pool_cycle, reps, inner), nb, f"{nb} blocks, BlockPool")

    m = KVCacheManager(4 * nb, BLOCK_SIZE)

    def seq_cycle() -> None:
        m.allocate_slots("s", 0, prompt_len)
        m.free("s")

    add("allocate_slots+free", _time_us(seq_cycle, reps, inner), nb, f"{prompt_len}-token sequence")

    m.allocate_slots("p", 0, prompt_len)

    def fork_cycle() -> None:
        m.fork("p", "c")
        m.free("c")

    add("fork+free", _time_us(fork_cycle, reps, inner), nb, f"child of a {prompt_len}-token sequence")

    tokens = list(range(prompt_len))
    m.cache_full_blocks("p", tokens)
    probe = tokens + [0]
    hit = m.match_prefix(probe)
    assert hit.num_tokens == prompt_len
    add("match_prefix (hit)", _time_us(lambda: m.match_prefix(probe), reps, inner), nb,
        f"{prompt_len}-token cached prompt")
    add("match_prefix (miss)", _time_us(lambda: m.match_prefix([1] + tokens), reps, inner), 1,
        "first block misses")
    add("cache_full_blocks", _time_us(lambda: _register(m, tokens), reps, max(inner // 10, 2)), nb,
        f"hash + register {nb} blocks (+ allocate/free)")

    # A decode step for a batch: one allocate_slots + cache_full_blocks per sequence.
    ctx, steps = 500, reps * max(inner // 10, 2)
    dm = KVCacheManager(batch * ((ctx + steps) // BLOCK_SIZE + 1), BLOCK_SIZE)
    seq_tokens = {i: list(range(i, i + ctx)) for i in range(batch)}
    for i, t in seq_tokens.items():
        dm.allocate_slots(i, 0, len(t))

    def decode_step() -> None:
        for i, t in seq_tokens.items():
            if not dm.allocate_slots(i, len(t), 1):
                raise RuntimeError("bench pool too small")
            t.append(7)
            dm.cache_full_blocks(i, t)

    add(f"decode step x{batch} seqs", _time_us(decode_step, reps, max(inner // 10, 2)), batch,
        "allocate_slots + cache_full_blocks per seq")

    tables = [dm.block_table(i) for i in range(batch)]
    lens = [len(seq_tokens[i]) for i in range(batch)]
    add(f"slot_mapping decode x{batch}",
        _time_us(lambda: slot_mapping(tables, [n - 1 for n in lens], [1] * batch, BLOCK_SIZE), reps, inner),
        batch, "1 token per seq, vectorised")
    add(f"slot_mapping prefill x{batch}",
        _time_us(lambda: slot_mapping(tables, [0] * batch, [256] * batch, BLOCK_SIZE), reps, inner),
        batch * 256 // BLOCK_SIZE, "256 tokens per seq")
    block_ops = [r["cpu_us_per_block"] for r in rows if r["op"] in ("pool allocate+free", "allocate_slots+free", "fork+free")]
    return {"block_size": BLOCK_SIZE, "quick": quick, "rows": rows,
            "max_us_per_block_op": max(block_ops), "target_us_per_block_op": TARGET_US_PER_BLOCK_OP}


def _register(m: KVCacheManager, tokens: list[int]) -> None:
    """Hash and register a fresh sequence's blocks (the first call after its prefill)."""
    m.allocate_slots("r", 0, len(tokens))
    m.cache_full_blocks("r", tokens, cache_salt="bench")
    m.free("r")
    m.prefix_cache.evict(len(tokens))


def to_markdown(result: dict) -> str:
    rows = [[r["op"], r["us"], r["cpu_us"], r["blocks"], r["cpu_us_per_block"], r["note"]] for r in result["rows"]]
    table = md_table(["op", "wall µs", "CPU µs", "blocks", "CPU µs/block", "what"], rows, digits=2)
    verdict = "meets" if result["max_us_per_block_op"] <= result["target_us_per_block_op"] else "misses"
    return (f"{table}\n\nBlock size {result['block_size']}; medians; worst block op (CPU) "
            f"{result['max_us_per_block_op']:.2f} µs/block ({verdict} the ≤ "
            f"{result['target_us_per_block_op']:.0f} µs target).\n")


if __name__ == "__main__":
    print(to_markdown(run(quick="--quick" in sys.argv)))
