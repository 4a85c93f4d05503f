"""Tensor parallelism end to end (gloo on CPU, spawned ranks): greedy tokens with TP equal TP=1 token for token
on the oracle prompts (real text), and the fp32 logits agree within 1e-4, on every rank."""

from __future__ import annotations

import gguf
import pytest
import torch
from tp_programs import TinySpec, tiny_rank

from pagedllm.attention import BACKENDS
from pagedllm.bench.tp_equivalence import checkpoint_rank
from pagedllm.distributed.launcher import run_tensor_parallel
from pagedllm.models.quant import QuantizedWeight, kernel_available, save_blocks
from pagedllm.models.tiny import tiny_hf_model

N_NEW = 8
TINY_VOCAB = 49152  # SmolLM2's: the oracle prompts' ids fit


@pytest.fixture(scope="module")
def oracle_prompts(smollm2_dir, wiki_texts) -> list[list[int]]:
    """Four prompts of 4 to 60 tokens cut from real text (the engine tests' oracle prompts)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tok.encode(t)[:n] for t, n in zip(wiki_texts[20:24], (4, 17, 33, 60))]


def assert_same(results, reference) -> None:
    """Every rank's (ids, logits) equal the reference's ids, logits within 1e-4."""
    for rank, (ids, logits) in enumerate(results):
        assert ids == reference[0], f"rank {rank}: greedy ids differ from TP=1"
        for got, want in zip(logits, reference[1]):
            assert got.shape == want.shape and (got - want).abs().max().item() < 1e-4, f"rank {rank}"


def gguf_blocks(state_dict: dict[str, torch.Tensor], path: str) -> None:
    """Save the weight matrices of an HF state dict as Q4_1 blocks (``save_blocks``), for ``use_gguf_blocks``."""
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    blocks = {name: QuantizedWeight(torch.from_numpy(gguf.quants.quantize(w.numpy(), q4_1)), int(q4_1), tuple(w.shape))
              for name, w in state_dict.items() if w.dim() == 2}
    save_blocks(blocks, path)


def test_tiny_qwen2_tp2_equals_tp1(tmp_path, oracle_prompts):
    """TP=2 on tiny random Qwen2 configs (qkv bias, untied head), each equal to its TP=1 run:
    - 2 KV heads (one per rank) and 1 KV head (replicated on both ranks), on the reference and the C++ attention
      backends (flex's compile per rank costs minutes here and adds nothing: a backend sees one rank's heads
      like any smaller model's);
    - its matrices as Q4_1 blocks, sharded in blocks, with exact fp32 activations (gguf) and with int8-rounded
      ones (gguf-a8, packed after sharding).

    gguf-a8's rounding turns the all-reduce's summation order (1e-7 relative) into rare rounding flips; two
    layers leave them below 1e-4, but through SmolLM2's 30 layers they grow to ~1 logit, the size of gguf-a8's
    own error against the exact model (it moves as much under any 1e-6 perturbation at TP=1)."""
    backends = tuple(b for b in BACKENDS if b in ("reference", "cpu"))
    specs = []
    for kv_heads in (2, 1):
        hf, cfg = tiny_hf_model("qwen2", vocab=TINY_VOCAB, kv_heads=kv_heads)
        torch.save(hf.state_dict(), weights := str(tmp_path / f"kv{kv_heads}.pt"))
        specs.append(TinySpec(cfg, weights, backends))
    if kernel_available(int8_activations=True):
        gguf_blocks(hf.state_dict(), blocks := str(tmp_path / "blocks.safetensors"))
        specs += [TinySpec(cfg, weights, ("cpu",), blocks), TinySpec(cfg, weights, ("cpu",), blocks, True)]
    args = (specs, oracle_prompts, N_NEW)
    reference = tiny_rank(None, *args)
    ranks = run_tensor_parallel(tiny_rank, 2, args, timeout_s=60)
    for i, want in enumerate(reference):
        assert_same([r[i] for r in ranks], want)


def test_smollm2_gguf_tp3_equals_tp1(smollm2_dir, oracle_prompts):
    """TP=3 on SmolLM2 (9 heads, 3 KV heads: one per rank) with its Q4_1 / Q8_0 blocks sharded in place."""
    args = (smollm2_dir, oracle_prompts, N_NEW, "cpu" if "cpu" in BACKENDS else "reference", "gguf")
    assert_same(run_tensor_parallel(checkpoint_rank, 3, args, timeout_s=60), checkpoint_rank(None, *args))
