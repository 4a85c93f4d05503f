"""``pagedllm bench structured``: what grammar-constrained decoding adds to a decode step.

At each batch size, the same run times (1) one decode step of the model (``bench decode``'s
measurement, paged attention, every sequence decoding one token) and (2) the structured-output work
that step adds when every sequence is constrained by a JSON schema: fill the batch's bitmask row by
row, mask the logits in one call, and advance each sequence's grammar by its sampled token
(``StructuredOutputManager.mask`` + ``accept``). The ratio (2)/(1) is the overhead; the target is
< 5% at batch 32.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.bench.report import Report, Table

TARGET_OVERHEAD = 0.05

# realistic response_format schemas: an API object, an enum-tagged record, a list of records
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "email": {"type": "string"}}, "required": ["name", "age", "email"]},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "confidence": {"type": "number"}}, "required": ["sentiment", "confidence"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                                "required": ["id", "tags"]}},
]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default=None, help="comma list (default 1,8,32,64; quick 2,32)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens per sequence (default 256; quick 32)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 32; quick 8)")


def _structured_step_s(tokenizer, vocab: int, eos: list[int], batch: int, steps: int, seed: int) -> float:
    """Median seconds of mask + accept for ``batch`` JSON-schema sequences over ``steps`` steps of
    seeded random logits (a sequence whose grammar ends starts again, so every row stays structured)."""
    from pagedllm.structured import StructuredOutputsParams
    from pagedllm.structured.manager import StructuredOutputManager

    mgr = StructuredOutputManager(tokenizer, vocab, eos)
    specs = [StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]) for i in range(batch)]
    ids = list(range(batch))
    for i in ids:
        mgr.add(i, specs[i])
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps + 1):
        logits = torch.randn(batch, vocab, generator=gen)
        t0 = time.perf_counter()
        mgr.mask(logits, ids)
        tokens = logits.argmax(-1).tolist()  # stands in for the sampler, whose cost is not counted
        t1 = time.perf_counter()
        mgr.accept(ids, tokens)
        times.append(time.perf_counter() - t1 + (t1 - t0))
        for i in ids:
            if mgr.states[i].is_terminated():
                mgr.add(i, specs[i])
    times = sorted(times[1:])
    return times[len(times) // 2]


def run(args) -> Report:
    from pagedllm.attention import get_backend
    from pagedllm.bench.decode import _ours
    from pagedllm.config.device import resolve_dtype
    from pagedllm.kv import KVCache
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.models.loader import load_checkpoint

    sizes = [int(x) for x in (args.batch_sizes or ("2,32" if args.quick else "1,8,32,64")).split(",")]
    context = args.context or (32 if args.quick else 256)
    steps = args.steps or (8 if args.quick else 32)
    dt = resolve_dtype(args.dtype)
    ckpt = load_checkpoint(None)
    cfg, tokenizer = ckpt.config, ckpt.tokenizer
    model = LlamaForCausalLM.from_checkpoint(ckpt, dt, args.engine_args.get("quantization", "auto"))
    per_seq = -(-(context + steps + 2) // 16)
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, per_seq * max(sizes), 16, dtype=dt)
    backend = get_backend("cpu")
    step_ms = [1000 * _ours(model, kv, backend, b, context, steps) for b in sizes]
    eos = [tokenizer.eos_token_id]
    grammar_ms = [1000 * _structured_step_s(tokenizer, cfg.vocab_size, eos, b, steps, args.seed) for b in sizes]
    overhead = [g / s for g, s in zip(grammar_ms, step_ms)]
    result = {"batch_sizes": sizes, "context": context, "steps": steps, "dtype": str(dt),
              "ms": {"decode step": step_ms, "structured (mask + accept)": grammar_ms}, "overhead": overhead,
              "target_overhead": TARGET_OVERHEAD}
    rows = [["decode step (ms)"] + step_ms, ["structured mask + accept (ms)"] + grammar_ms,
            ["overhead (%)"] + [100 * o for o in overhead]]
    rep = Report("structured", "Structured-output cost per decode step (JSON schemas on every sequence)",
                 [f"SmolLM2-135M, {dt}, cpu attention, {context}-token context, median of {steps} steps, "
                  f"{torch.get_num_threads()} torch threads; xgrammar bitmask filled per row, applied in one call; "
                  f"target < {100 * TARGET_OVERHEAD:.0f}% at batch 32"])
    rep.tables.append(Table(["cost"] + [f"batch {b}" for b in sizes], rows, digits=2))
    rep.result = result
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    ax.plot(result["batch_sizes"], [100 * o for o in result["overhead"]], marker="o", label="structured overhead")
    ax.axhline(100 * result["target_overhead"], linestyle="--", color="gray", label="target")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("% of a decode step")
    ax.set_title("Grammar mask + accept per decode step")
    ax.legend(fontsize=8)
