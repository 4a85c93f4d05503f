"""The fused call of a gguf-bf16 step of several rows (``models/bf16_layers.py``, ``ops/csrc/bf16_layers.cpp``): the
same bits as the per-op layers, on every step it takes, and the per-op path wherever it does not apply. On a CPU
without native bf16 (CI's may be AVX2 only) the matrices get their packed copies anyway, which ``amx_linear_bf16``
then runs through ATen: the same ops in either path, so every assertion holds on either."""

from __future__ import annotations

import pytest
import torch

from pagedllm import ops
from pagedllm.attention import AttentionMetadata, get_backend
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models import bf16_gemm, bf16_layers
from pagedllm.models.bf16_layers import FusedBF16Layers
from pagedllm.models.forward_pass import ForwardPass
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import load_checkpoint
from pagedllm.models.quant import BF16_MIN_ROWS, kernel_available

pytestmark = pytest.mark.skipif(not kernel_available(), reason="needs the GGUF block kernel")
BS = 16


@pytest.fixture(scope="module")
def model():
    assert ops.load("amx_gemm")
    mp = pytest.MonkeyPatch()
    mp.setattr(bf16_gemm, "packed_copy_available", lambda: True)  # the packed copies on any CPU
    try:
        m = LlamaForCausalLM.from_checkpoint(load_checkpoint(None), torch.float32, "gguf-bf16")
    finally:
        mp.undo()
    assert m.layers[0].qkv_weight.bf16.amx is not None
    return m


def _steps(model, prompts: list[list[int]], decode_steps: int, kv_dtype, fused: bool) -> list[torch.Tensor]:
    """Each step's logits with the fused call on or off: the prompts (of one length) one token a sequence a step,
    then ``decode_steps`` greedy steps; every step has len(prompts) rows, every sequence on the paged kernel."""
    cfg, n, length = model.config, len(prompts), len(prompts[0])
    per_seq = -(-(length + decode_steps) // BS)
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, n * per_seq, BS, dtype=kv_dtype)
    runner = ForwardPass(model, kv, get_backend("cpu"))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
    tokens, out = [p[0] for p in prompts], []
    bf16_layers.FUSED = fused
    try:
        for pos in range(length + decode_steps):
            meta = AttentionMetadata.build([1] * n, [pos + 1] * n, tables, BS)
            logits = model.compute_logits(model(torch.tensor(tokens), meta.positions, kv, meta, runner.backend))
            out.append(logits)
            tokens = [p[pos + 1] for p in prompts] if pos + 1 < length else logits.argmax(-1).tolist()
    finally:
        bf16_layers.FUSED = True
    return out


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_fused_rows_give_the_per_op_layers_bits(model, kv_dtype, monkeypatch):
    """Steps of BF16_MIN_ROWS + 2 rows (one token a sequence: every sequence on the paged kernel) through the fused
    call give the per-op layers' logits bit for bit, over a bf16, fp32 or int8 pool."""
    calls: list[int] = []
    real = FusedBF16Layers.__call__

    def spy(self, h, *a):
        calls.append(h.shape[0])
        return real(self, h, *a)

    monkeypatch.setattr(FusedBF16Layers, "__call__", spy)
    tok = load_checkpoint(None).tokenizer
    prompts = [tok(f"Item {i}: paged attention keeps the cache in blocks")["input_ids"][:10]
               for i in range(BF16_MIN_ROWS + 2)]
    assert {len(p) for p in prompts} == {10}
    fused = _steps(model, prompts, 4, kv_dtype, True)
    assert calls == [len(prompts)] * len(fused)  # every step went through the call
    calls.clear()
    per_op = _steps(model, prompts, 4, kv_dtype, False)
    assert calls == []
    assert len(fused) == len(per_op) == 14
    for a, b in zip(fused, per_op):
        assert torch.equal(a, b)


def test_the_call_applies_only_where_the_per_op_path_runs_its_ops(model):
    """Not below BF16_MIN_ROWS (the exact blocks), not above the packed copies' rows, not with a prefill chunk the
    backend sends elsewhere, not on a backend other than the CPU one, not when turned off."""
    cfg = model.config
    fused = model.fused_layers
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, 16, dtype=torch.bfloat16)
    backend = get_backend("cpu")
    n = BF16_MIN_ROWS
    decode = AttentionMetadata.build([1] * n, [5] * n, [[i] for i in range(n)], 16)
    h = torch.zeros(n, cfg.hidden_size)
    assert fused.applies(h, backend, kv, decode)
    few = AttentionMetadata.build([1] * (n - 1), [5] * (n - 1), [[i] for i in range(n - 1)], 16)
    assert not fused.applies(h[: n - 1], backend, kv, few)
    assert not fused.applies(h.bfloat16(), backend, kv, decode)
    assert not fused.applies(h, get_backend("reference"), kv, decode)
    bf16_layers.FUSED = False
    try:
        assert not fused.applies(h, backend, kv, decode)
    finally:
        bf16_layers.FUSED = True
    backend.kernel_only = lambda k_cache, meta: False  # a step with a prefill chunk for SDPA or the AMX kernel
    assert not fused.applies(h, backend, kv, decode)
