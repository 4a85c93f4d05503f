"""Attention backend micro-benchmark (per layer call) and the random paged batch it runs on.

``run(quick=False) -> dict`` times every backend in ``pagedllm.attention.BACKENDS`` for decode at
batch 1/8/32/64 over ~512 cached tokens and for one 512-token prefill, with the shapes of the two models we ship
for (SmolLM2-135M: 9 heads, 3 kv heads; Qwen2.5-0.5B: 14 heads, 2 kv heads, a GQA group of 7; head_dim 64), plus
flex's per-step BlockMask build and compile cost. ``to_markdown(result)`` renders it, with each shape's time per
(query head, key) so the two groups compare.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from pagedllm.attention.metadata import AttentionMetadata


@dataclass
class RandomBatch:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [Hkv, num_slots, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def to(self, device: torch.device | str) -> "RandomBatch":
        """The same batch on ``device`` (made on the CPU from a seeded generator, so every device sees one batch)."""
        q, k, v, kc, vc = (t.to(device) for t in (self.q, self.k, self.v, self.k_cache, self.v_cache))
        return RandomBatch(q, k, v, kc, vc, self.meta.to(torch.device(device)), self.scale)


def make_random_batch(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int = 16,
    num_kv_heads: int = 3,
    group: int = 3,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    shuffle: bool = True,
    spare_blocks: int = 7,
    seed: int = 0,
) -> RandomBatch:
    """Random pool + queries for a flat batch; each sequence gets its own (shuffled) pool blocks."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g) if shuffle else torch.arange(num_blocks)
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n].tolist())
        at += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    T, H = sum(query_lens), num_kv_heads * group
    slots = num_blocks * block_size
    k_cache = torch.randn(num_kv_heads, slots, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_kv_heads, slots, head_dim, generator=g).to(cache_dtype)
    q = torch.randn(T, H, head_dim, generator=g).to(dtype)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    return RandomBatch(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)


def run_backend(backend, b: RandomBatch, prepare: bool = True) -> torch.Tensor:
    """One step through ``backend`` on copies of the pool (the batch stays reusable)."""
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    if prepare:
        backend.prepare(b.meta)
    return backend.forward(b.q, b.k, b.v, kc, vc, b.meta, b.scale)


def _median_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


SMOLLM2 = dict(num_kv_heads=3, group=3, head_dim=64)
SHAPES = {"SmolLM2-135M": SMOLLM2, "Qwen2.5-0.5B": dict(num_kv_heads=2, group=7, head_dim=64)}


def run(quick: bool = False, backends: tuple[str, ...] | None = None, context: int = 512,
        reps: int | None = None) -> dict:
    from pagedllm.attention import BACKENDS, get_backend

    names = tuple(backends or BACKENDS)
    reps = reps or (5 if quick else 11)
    batches = (1, 8) if quick else (1, 8, 32, 64)
    prefill_len = 128 if quick else 512
    result: dict = {"threads": torch.get_num_threads(), "setup": {}, "models": {}}
    instances = {}
    for name in names:
        t0 = time.perf_counter()
        instances[name] = get_backend(name)
        result["setup"][name] = {"init_s": time.perf_counter() - t0}
    for model, shape in SHAPES.items():
        res = result["models"][model] = {
            "shapes": dict(shape, block_size=16, context=context, prefill_len=prefill_len),
            "decode_us": {}, "prefill_us": {}, "prepare_us": {},
        }
        cases = {f"decode_b{bs}": make_random_batch([1] * bs, [context] * bs, **shape) for bs in batches}
        cases["prefill"] = make_random_batch([prefill_len], [prefill_len], **shape)
        for name, be in instances.items():
            for case, b in cases.items():
                # first call: compile (flex) / build; timed separately
                t0 = time.perf_counter()
                run_backend(be, b)
                result["setup"][name][f"first_call_{model}_{case}_s"] = time.perf_counter() - t0
                kc, vc = b.k_cache.clone(), b.v_cache.clone()
                be.prepare(b.meta)
                t = _median_time(lambda: be.forward(b.q, b.k, b.v, kc, vc, b.meta, b.scale), reps)
                key = "prefill_us" if case == "prefill" else "decode_us"
                sub = "prefill" if case == "prefill" else int(case.split("_b")[1])
                res[key].setdefault(name, {})[sub] = t * 1e6
                res["prepare_us"].setdefault(name, {})[sub] = _median_time(lambda: be.prepare(b.meta), reps) * 1e6
    return result


def to_markdown(result: dict) -> str:
    lines = []
    for model, res in result["models"].items():
        sh = res["shapes"]
        heads = sh["num_kv_heads"] * sh["group"]
        lines.append(
            f"**{model}**: attention per layer call, {result['threads']} threads; H={heads}, Hkv={sh['num_kv_heads']}, "
            f"D={sh['head_dim']}, block_size={sh['block_size']}, decode context {sh['context']}, prefill "
            f"{sh['prefill_len']} tokens (median µs; last column: decode at the largest batch in ns per query head "
            "and key, which compares the shapes)"
        )
        lines.append("")
        batches = sorted({b for d in res["decode_us"].values() for b in d})
        lines.append("| backend | " + " | ".join(f"decode b={b}" for b in batches)
                     + " | prefill | prepare (b=max) | ns / (head, key) |")
        lines.append("|---|" + "---|" * (len(batches) + 3))
        for name, d in res["decode_us"].items():
            p = res["prefill_us"].get(name, {}).get("prefill", float("nan"))
            prep = res["prepare_us"].get(name, {}).get(batches[-1], float("nan"))
            per_key = d.get(batches[-1], float("nan")) * 1e3 / (batches[-1] * heads * sh["context"])
            lines.append(f"| {name} | " + " | ".join(f"{d.get(b, float('nan')):.0f}" for b in batches)
                         + f" | {p:.0f} | {prep:.0f} | {per_key:.3f} |")
        lines.append("")
    lines.append("First call (build / compile) seconds:")
    for name, s in result["setup"].items():
        parts = ", ".join(f"{k}={v:.2f}" for k, v in s.items())
        lines.append(f"- {name}: {parts}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(to_markdown(run(quick="--quick" in sys.argv)))
