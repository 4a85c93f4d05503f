"""A decoder layer's batch-1 step in one C++ call (``ops/csrc/decode_layer.cpp``, ``models/decode_layer.py``): the
same ops as the per-op forward, so the same bits, on the embedded model's GGUF blocks; used only where it applies."""

import pytest
import torch

from pagedllm import ops
from pagedllm.attention import get_backend
from pagedllm.kv import KVCache
from pagedllm.models import decode_layer as fused
from pagedllm.models import llama
from pagedllm.models.forward_pass import ForwardPass, SeqChunk

KERNELS = ("decode_layer", "fused_ops", "paged_attention", "gemv")
needs_kernels = pytest.mark.skipif(not all(ops.load(k) for k in KERNELS),
                                   reason="the AVX2 C++ kernels could not be built on this machine")


@pytest.fixture(scope="module")
def ckpt():
    from pagedllm.models.loader import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture(scope="module")
def smol(ckpt):
    return ckpt, llama.LlamaForCausalLM.from_checkpoint(ckpt)  # auto: the GGUF blocks


def run_steps(model, backend_name: str, decode_steps: int) -> tuple[list[torch.Tensor], KVCache]:
    """A 40-token prefill (the per-op path: 40 rows) then batch-1 decode steps; the logits of each and the pool."""
    cfg = model.config
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, 16)
    runner = ForwardPass(model, kv, get_backend(backend_name))
    table = list(range(4))
    out = [runner.execute([SeqChunk(list(range(300, 340)), 0, table)])]
    out += [runner.execute([SeqChunk([500 + s], 40 + s, table)]) for s in range(decode_steps)]
    return out, kv


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["gguf", "gguf-a8"])
def test_fused_decode_steps_equal_the_per_op_path_bit_for_bit(ckpt, quantization, monkeypatch):
    model = llama.LlamaForCausalLM.from_checkpoint(ckpt, quantization=quantization)
    calls = []
    real = llama.decode_layer
    monkeypatch.setattr(llama, "decode_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    got, kv_got = run_steps(model, "cpu", 4)
    assert len(calls) == 4 * model.config.num_layers  # every layer of every decode step, no prefill row
    monkeypatch.setattr(fused, "FUSED", False)
    want, kv_want = run_steps(model, "cpu", 4)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for i in range(model.config.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(kv_got.layer(i), kv_want.layer(i)))


@needs_kernels
def test_fused_layer_applies_only_where_the_per_op_path_calls_the_same_ops(smol, monkeypatch):
    _, model = smol
    layer, cpu = model.layers[0], get_backend("cpu")
    one, two = torch.zeros(1, 576), torch.zeros(2, 576)
    assert fused.fused_layer_applies(layer, one, cpu)
    assert not fused.fused_layer_applies(layer, two, cpu)  # more than one token: the per-op path
    assert not fused.fused_layer_applies(layer, one.double(), cpu)
    assert not fused.fused_layer_applies(layer, one, get_backend("reference"))
    monkeypatch.setattr(layer, "qkv_bias", torch.zeros(960))
    assert not fused.fused_layer_applies(layer, one, cpu)
    monkeypatch.undo()
    monkeypatch.setattr(model.layers[0], "down_weight", layer.down_weight.pack_a8())  # mixed gguf and gguf-a8
    assert not fused.fused_layer_applies(layer, one, cpu)
    monkeypatch.undo()
    monkeypatch.setattr(fused, "FUSED", False)  # PAGEDLLM_UNFUSED_DECODE=1
    assert not fused.fused_layer_applies(layer, one, cpu)
    monkeypatch.undo()
    monkeypatch.setattr(fused.quant, "FACTORED_GEMV", False)  # the bit-exact GEMVs: the per-op path
    assert not fused.fused_layer_applies(layer, one, cpu)


FRESH_A8 = """
from pagedllm import LLM, SamplingParams
from pagedllm.ops import build
from pagedllm.models import decode_layer
calls = []
real = decode_layer.decode_layer
import pagedllm.models.llama as llama
llama.decode_layer = lambda *a, **k: calls.append(1) or real(*a, **k)
llm = LLM(quantization="gguf-a8", dtype="float32", num_blocks=16)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                   use_tqdm=False)[0].outputs[0]
layers = llm.engine.forward_pass.model.config.num_layers
assert len(out.token_ids) == 3 and len(calls) == 2 * layers, (out, len(calls))  # every layer of both decode steps
assert "pagedllm_gemv" not in build._built, sorted(build._built)
"""


@needs_kernels
@pytest.mark.slow
def test_gguf_a8_alone_runs_the_fused_layer_without_the_gemv_library():
    """A process that only ever runs gguf-a8 never loads gemv.cpp's library: the fused layer must not need it (it
    looked every GEMV op up at its first call and failed there)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", FRESH_A8], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
