"""TP=N against TP=1 on a real checkpoint: greedy tokens and fp32 logits of every rank, for the tests and
for checks by hand on models too big for CI (``python -m pagedllm.bench.tp_equivalence --model
qwen2.5-coder-0.5b --tp 2``)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from pagedllm.attention import BACKENDS, get_backend
from pagedllm.distributed.launcher import run_tensor_parallel
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.models.sharding import kv_heads_per_rank, load_shard
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models.forward_pass import ForwardPass, greedy_generate
from pagedllm.models.llama import LlamaForCausalLM

BLOCK_SIZE = 16
Result = tuple[list[list[int]], list[torch.Tensor]]  # greedy ids and float32 logits of each prompt


def greedy(model: LlamaForCausalLM, prompts: list[list[int]], n_new: int, backend: str) -> Result:
    """Greedy decode of all prompts in one batch, on this rank's KV heads (``model.tp`` None: TP=1)."""
    cfg = model.config
    world = 1 if model.tp is None else model.tp.world_size
    blocks = sum(-(-(len(p) + n_new) // BLOCK_SIZE) for p in prompts)
    kv = KVCache(cfg.num_layers, kv_heads_per_rank(cfg.num_kv_heads, world), cfg.head_dim, blocks, BLOCK_SIZE)
    return greedy_generate(ForwardPass(model, kv, get_backend(backend)), prompts, n_new, return_logits=True)


def checkpoint_rank(tp: TPGroup | None, model_path: str | None, prompts: list[list[int]], n_new: int,
                    backend: str, quantization: str = "auto") -> Result:
    """A real checkpoint (``load_checkpoint`` path) loaded, and sharded on this rank (``tp`` None: whole)."""
    from pagedllm.models.loader import load_checkpoint

    ckpt = load_checkpoint(model_path)
    model = (LlamaForCausalLM.from_checkpoint(ckpt, quantization=quantization) if tp is None
             else load_shard(ckpt, tp, quantization=quantization))
    return greedy(model, prompts, n_new, backend)


def max_differences(results: list[Result], reference: Result) -> list[tuple[bool, float]]:
    """Per rank: (greedy ids equal the reference's, largest absolute logit difference)."""
    return [(ids == reference[0], max((a - b).abs().max().item() for a, b in zip(logits, reference[1])))
            for ids, logits in results]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="load_checkpoint path or alias (default: embedded SmolLM2)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--backend", default="cpu" if "cpu" in BACKENDS else "reference")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    a = ap.parse_args(argv)
    from pagedllm.bench.workloads import wiki_articles
    from pagedllm.models.loader import load_checkpoint

    tok = load_checkpoint(a.model).tokenizer
    texts = [t for _, t in wiki_articles()[20:24]]
    prompts = [tok.encode(t)[:n] for t, n in zip(texts, (4, 17, 33, 60))]
    args = (a.model, prompts, a.new_tokens, a.backend, a.quantization)
    t0 = time.perf_counter()
    reference = checkpoint_rank(None, *args)
    t1 = time.perf_counter()
    ranks = run_tensor_parallel(checkpoint_rank, a.tp, args, timeout_s=600)
    t2 = time.perf_counter()
    ok = True
    for rank, (same, err) in enumerate(max_differences(ranks, reference)):
        ok &= same and err < a.tolerance
        print(f"rank {rank}/{a.tp}: greedy tokens equal TP=1: {same}; max |logit difference| {err:.2e}")
    print(f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens, {a.new_tokens} new each; "
          f"TP=1 {t1 - t0:.1f} s, TP={a.tp} {t2 - t1:.1f} s (load included); {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
