"""The kernels built for the AVX2 + FMA level (``PAGEDLLM_MARCH=x86-64-v3``: what a Zen 3 runs) against this CPU's own
build: the embedded model's exact fp32 logits to fp32 rounding, its greedy tokens, and gguf-a8's int8 GEMMs to the
bit. The machines CI runs on change between runs; on an AVX-512 one the rest of the suite tests only the AVX-512
paths, and this keeps the AVX2 ones tested there too. The AVX2 build runs in a subprocess (a process loads one build
of a kernel library)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.cpu_env import cpu_flags

pytestmark = [
    pytest.mark.skipif("avx512f" not in cpu_flags().split(),
                       reason="this CPU's own build is the AVX2 one, which the rest of the suite tests"),
    pytest.mark.slow,
]

PROMPT = "The quick brown fox jumps over the lazy dog because it was in a hurry to get"


def outputs() -> dict[str, torch.Tensor]:
    """What is compared: the exact model's logits over a prefill chunk and three decode steps, its greedy tokens,
    and gguf-a8's GEMMs of a Q4_1 and a Q8_0 matrix at 1, 8 and 37 rows."""
    from pagedllm.attention import get_backend
    from pagedllm.kv import KVCache
    from pagedllm.models.forward_pass import ForwardPass, SeqChunk
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.models.loader import load_checkpoint
    from pagedllm.models.quant import quantized_linear

    ckpt = load_checkpoint(None)
    cfg = ckpt.config
    exact = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, quantization="gguf")
    run = ForwardPass(exact, KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 16), get_backend("cpu"))
    ids = ckpt.tokenizer.encode(PROMPT, add_special_tokens=False)
    out, tokens = {}, []
    logits = run.execute([SeqChunk(ids, 0, list(range(8)))])
    for step in range(4):
        out[f"logits {step}"] = logits
        tokens.append(int(logits[-1].argmax()))
        if step < 3:
            logits = run.execute([SeqChunk([tokens[-1]], len(ids) + step, list(range(8)))])
    out["tokens"] = torch.tensor(tokens)
    a8 = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, quantization="gguf-a8")
    gen = torch.Generator().manual_seed(0)
    for name, w in (("Q4_1 down", a8.layers[0].down_weight), ("Q8_0 head", a8.lm_head)):
        for rows in (1, 8, 37):
            out[f"a8 {name} {rows}"] = quantized_linear(torch.randn(rows, w.shape[1], generator=gen), w, None)
    return out


def test_the_avx2_build_computes_what_this_cpus_build_does(tmp_path):
    saved = tmp_path / "avx2.pt"
    env = {**os.environ, "PAGEDLLM_MARCH": "x86-64-v3", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(Path(__file__)), str(saved)], env=env, check=True, timeout=1200)
    avx2, here = torch.load(saved), outputs()
    assert avx2.keys() == here.keys()
    assert torch.equal(avx2["tokens"], here["tokens"])
    for key in here:
        if key.startswith("logits"):  # the same fp32 arithmetic summed in another order
            torch.testing.assert_close(avx2[key], here[key], rtol=1e-4, atol=1e-4)
        elif key.startswith("a8"):  # the same integer products (VPMADDUBSW pairs or VPDPBUSD) and scales
            assert torch.equal(avx2[key], here[key]), key


if __name__ == "__main__":
    from pagedllm.ops.build import builds_native

    assert not builds_native(), "run with PAGEDLLM_MARCH set"
    torch.save(outputs(), sys.argv[1])
