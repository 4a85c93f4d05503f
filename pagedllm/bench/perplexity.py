"""Perplexity through the paged path (chunked prefill with the cache) vs Hugging Face on the same
weights: seed 000's "perplexity equal to the contiguous baseline" check (7.32 vs 7.31 there).

Text: the first N tokens of the Wikipedia summaries (file order), cut into windows; each window is
prefilled in chunks through the paged KV pool, so every chunk after the first attends to K/V it
reads back from scattered blocks.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from pagedllm.attention import AttentionMetadata
from pagedllm.bench.report import Report, Table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=20_000, help="tokens of text scored (default 20,000)")
    p.add_argument("--window", type=int, default=1024, help="context window per scored segment")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size through the cache")
    p.add_argument("--backend", default="auto", help="attention backend of the paged path")


def wiki_token_ids(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of the Wikipedia summaries, in file order."""
    from pagedllm.bench.workloads import wiki_articles

    ids: list[int] = []
    for _title, text in wiki_articles():
        ids.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
        if len(ids) >= n:
            break
    return ids[:n]


@torch.inference_mode()
def paged_nll(model, kv_cache, backend, ids: list[int], window: int, chunk: int) -> tuple[float, int]:
    """Summed next-token NLL and count over non-overlapping windows, each prefilled chunk by chunk."""
    bs = kv_cache.block_size
    table = list(range(-(-window // bs)))
    total, count = 0.0, 0
    for w0 in range(0, len(ids), window):
        win = ids[w0 : w0 + window]
        for start in range(0, len(win), chunk):
            toks = win[start : start + chunk]
            meta = AttentionMetadata.build([len(toks)], [start + len(toks)], [table], bs)
            hidden = model(torch.tensor(toks), meta.positions, kv_cache, meta, backend)
            targets = torch.tensor(win[start + 1 : start + len(toks) + 1])
            logits = model.compute_logits(hidden[: len(targets)])
            total += float(F.cross_entropy(logits, targets, reduction="sum"))
            count += len(targets)
    return total, count


@torch.inference_mode()
def hf_nll(hf_model, ids: list[int], window: int) -> tuple[float, int]:
    total, count = 0.0, 0
    for w0 in range(0, len(ids), window):
        win = torch.tensor([ids[w0 : w0 + window]])
        logits = hf_model(input_ids=win).logits[0, :-1].float()
        total += float(F.cross_entropy(logits, win[0, 1:], reduction="sum"))
        count += win.shape[1] - 1
    return total, count


def compare(model_path: str | None, tokens: int, window: int, chunk: int, dtype: str = "float32",
            backend_name: str = "auto", quantization: str = "auto") -> dict:
    """Perplexity of the paged path and of HF transformers on the same weights and text."""
    from transformers import AutoModelForCausalLM

    from pagedllm.attention import default_backend, get_backend
    from pagedllm.config.device import resolve_dtype
    from pagedllm.kv import KVCache
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.models.loader import load_checkpoint

    ckpt = load_checkpoint(model_path)
    dt = resolve_dtype(dtype)
    cfg = ckpt.config
    model = LlamaForCausalLM.from_checkpoint(ckpt, dt, quantization)
    if backend_name == "auto":
        backend_name = default_backend()
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, -(-window // 16), 16, dtype=dt)
    ids = wiki_token_ids(ckpt.tokenizer, tokens)
    t0 = time.monotonic()
    ours = paged_nll(model, kv, get_backend(backend_name), ids, window, chunk)
    t_ours = time.monotonic() - t0
    hf = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=dt).eval()
    t0 = time.monotonic()
    ref = hf_nll(hf, ids, window)
    t_hf = time.monotonic() - t0
    ppl_ours, ppl_hf = math.exp(ours[0] / ours[1]), math.exp(ref[0] / ref[1])
    return {"tokens": len(ids), "scored": ours[1], "window": window, "chunk": chunk, "backend": backend_name,
            "dtype": str(dt), "quantization": model.quantization, "ppl_paged": ppl_ours, "ppl_hf": ppl_hf,
            "rel_diff": abs(ppl_ours / ppl_hf - 1),
            "seconds_paged": t_ours, "seconds_hf": t_hf}


def run(args) -> Report:
    tokens, window, chunk = (2048, 512, 128) if args.quick else (args.tokens, args.window, args.chunk)
    dtype = "float32" if args.dtype == "auto" else args.dtype
    r = compare(None, tokens, window, chunk, dtype, getattr(args, "backend", "auto"),
                args.engine_args.get("quantization", "auto"))  # --engine quantization=gguf-a8: what it costs
    rep = Report("perplexity", "Perplexity: paged path (chunked prefill through the cache) vs HF transformers",
                 [f"SmolLM2-135M-Instruct, first {r['tokens']} tokens of the Wikipedia summaries, windows of "
                  f"{window}, chunks of {chunk}, backend {r['backend']}, {r['dtype']}, weights "
                  f"{r['quantization']}"])
    rep.tables.append(Table(["system", "perplexity", "seconds"],
                            [["pagedllm (paged)", r["ppl_paged"], r["seconds_paged"]],
                             ["HF transformers", r["ppl_hf"], r["seconds_hf"]]], digits=4))
    rep.notes.append(f"relative difference {100 * r['rel_diff']:.4f}% (target < 0.5%)")
    rep.result = r
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    ax.bar(["pagedllm (paged)", "HF transformers"], [result["ppl_paged"], result["ppl_hf"]], color=["#4c72b0", "#999"])
    ax.set_ylabel("perplexity")
    ax.set_title(f"Perplexity on {result['tokens']} Wikipedia tokens (rel. diff {100 * result['rel_diff']:.3f}%)")
