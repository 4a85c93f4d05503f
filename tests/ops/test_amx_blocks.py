"""Small GEMMs from GGUF blocks on AMX tiles (``ops/csrc/amx_blocks.cpp``) and where ``bf16_linear`` takes them:
on an AMX CPU the bits of the packed bf16 copy's GEMM (Q4_1 blocks rounded to bf16 in the kernel), every row count up
to the op's 32 and N at and off the 16- and 32-column edges; elsewhere the op's ATen fallback computes the same
product. Only Q4_1 matrices keep their blocks. An engine generates the same with and without them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from pagedllm import ops
from pagedllm.models import bf16_gemm
from pagedllm.models.bf16_gemm import BLOCKS_MAX_ROWS, PackedBF16, amx_bf16_available, bf16_linear

pytestmark = pytest.mark.skipif(not (ops.load("amx_blocks") and ops.load("amx_gemm") and ops.load("gemm")),
                                reason="no C++ compiler")

Q4_1, Q8_0 = int(gguf.GGMLQuantizationType.Q4_1), int(gguf.GGMLQuantizationType.Q8_0)


def _blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = np.random.default_rng(seed + n + k).standard_normal((n, k), dtype=np.float32) * 0.1
    return torch.from_numpy(quantize(w, gguf.GGMLQuantizationType(qtype)))


def _aten_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T in fp32 rounded to bf16 (the reference where the tiles' bits are not at hand)."""
    return torch.nn.functional.linear(x.float(), w.float()).bfloat16()


@pytest.mark.parametrize("N,K", [(960, 576), (576, 1536), (100, 64), (64, 96), (3072, 576)])
def test_blocks_gemm_is_the_copys_gemm(N, K):
    blocks = _blocks(Q4_1, N, K)
    w = torch.ops.pagedllm.dequantize(blocks, Q4_1, K).to(torch.bfloat16)  # the copy gguf-bf16 makes
    packed = torch.ops.pagedllm.amx_pack_bf16(w)
    gen = torch.Generator().manual_seed(N + K)
    for M in (1, 2, 7, 16, 17, 31, 32):
        x = (torch.randn(M, K, generator=gen) * 2).bfloat16()
        got = [torch.ops.pagedllm.amx_blocks_linear_bf16(x, blocks, N)]
        ref = [torch.ops.pagedllm.amx_linear_bf16(x, packed, N) if amx_bf16_available() else _aten_product(x, w)]
        if N % 32 == 0:
            got.append(torch.ops.pagedllm.amx_blocks_linear_silu_bf16(x, blocks, N))
            y = ref[0].float()
            silu = (torch.nn.functional.silu(y[:, :N // 2]) * y[:, N // 2:]).bfloat16()
            ref.append(torch.ops.pagedllm.amx_linear_silu_bf16(x, packed, N) if amx_bf16_available() else silu)
        for g, r in zip(got, ref):
            assert g.shape == r.shape and g.dtype == torch.bfloat16
            if amx_bf16_available():  # the tiles sum each output's pairs in one order whichever operand is A
                assert torch.equal(g.view(torch.int16), r.view(torch.int16)), (M, N, K)
            else:
                torch.testing.assert_close(g.float(), r.float(), rtol=2 ** -6, atol=1e-3)


def test_blocks_gemm_refuses_what_it_cannot_compute():
    blocks = _blocks(Q4_1, 32, 64)
    x = torch.randn(3, 64).bfloat16()
    with pytest.raises(RuntimeError, match="at most 32 rows"):
        torch.ops.pagedllm.amx_blocks_linear_bf16(torch.randn(33, 64).bfloat16(), blocks, 32)
    with pytest.raises(RuntimeError, match="Q4_1 rows"):
        torch.ops.pagedllm.amx_blocks_linear_bf16(x, _blocks(Q8_0, 32, 64), 32)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.pagedllm.amx_blocks_linear_bf16(x.float(), blocks, 32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.pagedllm.amx_blocks_linear_silu_bf16(x, _blocks(Q4_1, 48, 64), 48)


def test_bf16_linear_takes_the_blocks_up_to_their_rows(monkeypatch):
    """A copy that keeps its blocks runs GEMMs of up to BLOCKS_MAX_ROWS rows from them (gate/up too), larger ones on
    the copy; the blocks are kept only where the tiles read them (or a test says so), of Q4_1 matrices only."""
    from pagedllm.models import layers

    from pagedllm.models.quant import QuantizedWeight

    blocks = _blocks(Q4_1, 64, 64)
    w = torch.ops.pagedllm.dequantize(blocks, Q4_1, 64)
    assert (PackedBF16.of(w, 1, blocks).blocks is not None) == bf16_gemm.amx_blocks_available()
    monkeypatch.setattr(bf16_gemm, "amx_blocks_available", lambda: True)
    monkeypatch.setattr(bf16_gemm, "packed_copy_available", lambda: True)
    p = QuantizedWeight(blocks, Q4_1, (64, 64)).with_bf16(1).bf16
    assert p.blocks is blocks
    assert QuantizedWeight(_blocks(Q8_0, 64, 64), Q8_0, (64, 64)).with_bf16(1).bf16.blocks is None
    calls = []
    for name in ("amx_blocks_linear_bf16", "amx_blocks_linear_silu_bf16"):
        real = getattr(torch.ops.pagedllm, name)
        monkeypatch.setattr(bf16_gemm.torch.ops.pagedllm, name,
                            lambda *a, n=name, r=real: calls.append((n, a[0].shape[0])) or r(*a))
    gen = torch.Generator().manual_seed(5)
    for rows in (1, BLOCKS_MAX_ROWS, BLOCKS_MAX_ROWS + 1):
        x = torch.randn(rows, 64, generator=gen)
        ref = torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).float()
        torch.testing.assert_close(bf16_linear(x, p), ref, rtol=2 ** -7, atol=1e-3)
        y = layers.linear_silu_mul(x.bfloat16(), p, False, torch.bfloat16)
        assert y.shape == (rows, 32)
    assert calls == [("amx_blocks_linear_bf16", 1), ("amx_blocks_linear_silu_bf16", 1),
                     ("amx_blocks_linear_bf16", BLOCKS_MAX_ROWS), ("amx_blocks_linear_silu_bf16", BLOCKS_MAX_ROWS)]


@pytest.mark.skipif(not bf16_gemm.amx_blocks_available(), reason="the blocks are kept on AMX CPUs only")
def test_decode_steps_from_the_blocks_give_the_copys_logits(monkeypatch):
    """An engine on AMX generates the same tokens, with the same logprobs, whether its small decode steps read the
    blocks or the copy (PAGEDLLM_AMX_BLOCKS=0 in the subprocess keeps the copy)."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from pagedllm import LLM, SamplingParams\n"
            "llm = LLM(quantization='gguf-bf16', num_blocks=64, block_size=16)\n"
            "sp = SamplingParams(max_tokens=8, temperature=0, logprobs=1)\n"
            "outs = llm.generate([f'Item {i}: the history of paged memory' for i in range(6)], sp)\n"
            "print(json.dumps([[o.outputs[0].token_ids, o.outputs[0].cumulative_logprob] for o in outs]))\n")
    runs = []
    for flag in ("1", "0"):
        env = {**os.environ, "PAGEDLLM_AMX_BLOCKS": flag}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1]
