"""``pagedllm bench decode``: per-step decode time of the batched forward pass at batch 1/8/32/64
for every attention backend, side by side with HF ``generate`` (DynamicCache) on the same weights.

Each sequence holds a ``--context``-token prompt; our time is one ForwardPass step (every sequence
decodes one token, attention reading the paged pool); HF's is the time between consecutive forward passes
inside one ``generate`` call. Both: the median over ``--steps`` steps after a warm-up step.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.bench.report import Report, Table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default=None, help="comma list (default 1,8,32,64; quick 1,2)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens per sequence (default 256; quick 32)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 8; quick 2)")
    p.add_argument("--backends", default=None, help="comma list (default: every backend this machine runs)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")


@torch.inference_mode()
def _ours(model, kv_cache, backend, batch: int, context: int, steps: int) -> float:
    """Median seconds per decode step of ``batch`` sequences after a ``context``-token prefill."""
    from pagedllm.models.forward_pass import ForwardPass, SeqChunk

    runner = ForwardPass(model, kv_cache, backend)
    bs = kv_cache.block_size
    per_seq = -(-(context + steps + 2) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = [[(7 * i + j) % 1000 + 100 for j in range(context)] for i in range(batch)]
    for i in range(batch):  # prefill one by one: the timed part is the decode step
        runner.execute([SeqChunk(prompts[i], 0, tables[i])])
    times = []
    for s in range(steps + 1):
        chunks = [SeqChunk([11 + s], context + s, tables[i]) for i in range(batch)]
        t0 = time.perf_counter()
        runner.execute(chunks)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])  # the first step warms caches (and compiles for flex)
    return times[len(times) // 2]


@torch.inference_mode()
def _hf(hf, batch: int, context: int, steps: int) -> float:
    """Median seconds per HF decode step, timed inside one ``generate`` call: a logits processor stamps the
    time after every forward pass. (A difference of two whole generate calls went negative when the VM's
    speed moved between them.)"""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor([[(7 * i + j) % 1000 + 100 for j in range(context)] for i in range(batch)])
    clock = Clock()
    n = steps + 2  # the prefill's stamp, one warm-up step, then the timed steps (as ours)
    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    gaps = sorted(b - a for a, b in zip(clock.stamps[1:], clock.stamps[2:]))
    return gaps[len(gaps) // 2]


def run(args) -> Report:
    from transformers import AutoModelForCausalLM

    from pagedllm.attention import BACKENDS, get_backend
    from pagedllm.config.device import resolve_dtype
    from pagedllm.kv import KVCache
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.models.loader import load_checkpoint

    sizes = [int(x) for x in (args.batch_sizes or ("1,2" if args.quick else "1,8,32,64")).split(",")]
    context = args.context or (32 if args.quick else 256)
    steps = args.steps or (2 if args.quick else 8)
    wanted = ("reference", "cpu") if args.quick else ("reference", "flex", "cpu", "triton")  # quick: no compile
    backends = args.backends.split(",") if args.backends else [b for b in wanted if b in BACKENDS]
    dt = resolve_dtype(args.dtype)
    ckpt = load_checkpoint(None)
    cfg = ckpt.config
    model = LlamaForCausalLM.from_checkpoint(ckpt, dt, args.engine_args.get("quantization", "auto"))
    per_seq = -(-(context + steps + 2) // 16)
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, per_seq * max(sizes), 16, dtype=dt)
    result: dict = {"batch_sizes": sizes, "context": context, "steps": steps, "dtype": str(dt), "ms": {}}
    for name in backends:
        backend = get_backend(name)
        result["ms"][name] = [1000 * _ours(model, kv, backend, b, context, steps) for b in sizes]
    if not args.no_hf:
        hf = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dt).eval()
        result["ms"]["HF generate"] = [1000 * _hf(hf, b, context, steps) for b in sizes]
    rows = []
    for name, ms in result["ms"].items():
        rows.append([name] + ms)
    hf_ms = result["ms"].get("HF generate")
    if hf_ms:
        best = {b: min(v[i] for k, v in result["ms"].items() if k != "HF generate") for i, b in enumerate(sizes)}
        rows.append(["HF / best backend (x)"] + [hf_ms[i] / best[b] for i, b in enumerate(sizes)])
    weights = {"gguf": "in their GGUF Q4_1/Q8_0 blocks", "none": "dense",
               "gguf-a8": "in their GGUF blocks times int8 activations (--engine quantization=gguf-a8)"}[model.quantization]
    rep = Report("decode", "Decode step time (ms) by batch size: paged backends vs HF generate",
                 [f"SmolLM2-135M, {dt}, weights {weights}, {context}-token context per sequence, median of {steps} "
                  f"steps, {torch.get_num_threads()} torch threads"])
    rep.tables.append(Table(["system"] + [f"batch {b}" for b in sizes], rows, digits=1))
    rep.result = result
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    for name, ms in result["ms"].items():
        ax.plot(result["batch_sizes"], ms, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Decode step time, {result['context']}-token context, {result['dtype']}")
    ax.legend(fontsize=8)
