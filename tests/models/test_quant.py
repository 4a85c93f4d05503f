"""GGUF block weights (``quantization="gguf"``): the kernel reads Q4_1/Q8_0 blocks and must give exactly
what the fp32 path gives on the dequantized matrix, from one GEMM up to the whole engine."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from pagedllm import ops
from pagedllm.models import layers, quant
from pagedllm.models.quant import QuantizedWeight, kernel_available

kernel = torch.ops.pagedllm if ops.load("gemm") else None
needs_kernel = pytest.mark.skipif(kernel is None, reason="the AVX2 C++ kernel could not be built on this machine")
needs_a8 = pytest.mark.skipif(not kernel_available(int8_activations=True),
                              reason="the int8 (AVX2) kernel could not be built on this machine")
QTYPES = [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0]


def make_weight(qtype, n: int, k: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random matrix quantized by gguf-py, and gguf-py's own dequantization of it (the reference)."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    blocks = quantize(w, qtype)
    dense = torch.from_numpy(np.require(dequantize(blocks, qtype), np.float32, ["C", "W"]))
    return QuantizedWeight(torch.from_numpy(blocks), int(qtype), (n, k)), dense


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(1, 32), (13, 64), (192, 576), (9, 1536)])
def test_dequantize_matches_gguf_exactly(qtype, n, k):
    qw, dense = make_weight(qtype, n, k, seed=n + k)
    assert torch.equal(qw.dequantize(), dense)
    rows = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(qw.dequantize(rows), dense[rows])


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 12, 16, 19, 23, 64, 200])  # dot-product tiles below 16 rows, panels above
@pytest.mark.parametrize("n,k", [(7, 64), (192, 576), (13, 1536), (33, 96)])  # 96: an odd number of blocks per row
def test_quant_linear_is_bit_identical_to_the_fp32_kernel(monkeypatch, qtype, m, n, k):
    """Same register tiles over exactly dequantized weights: equal bits, with and without bias (one row
    goes to gemv.cpp unless PAGEDLLM_BITWISE_GEMV=1: tests/models/test_gemv.py)."""
    monkeypatch.setattr(quant, "FACTORED_GEMV", False)
    qw, dense = make_weight(qtype, n, k, seed=m * 7 + n)
    g = torch.Generator().manual_seed(m + n + k)
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    assert torch.equal(layers.linear(x, qw, b), kernel.linear(x, dense, b))
    torch.testing.assert_close(layers.linear(x, qw), F.linear(x, dense), rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_panels_match_the_kernel_before_issue_32_at_any_thread_count(monkeypatch, qtype):
    """Q4_1 panels packed from their bytes, the balanced row tiles and the groups of panels give the bits of the
    old panels (PAGEDLLM_GEMM_V1=1: dequantize, transpose, tiles of 6), with one thread or two."""
    qw, _ = make_weight(qtype, 50, 160, seed=3)
    g = torch.Generator().manual_seed(4)
    b = torch.randn(50, generator=g)
    threads = torch.get_num_threads()
    try:
        for m in (16, 19, 22, 37, 150):  # 150: groups of panels per tile of x
            x = torch.randn(m, 160, generator=g)
            outs = []
            for v1, t in (("1", 1), ("0", 1), ("0", 2)):
                monkeypatch.setenv("PAGEDLLM_GEMM_V1", v1)
                torch.set_num_threads(t)
                outs.append(kernel.quant_linear(x, qw.data, qw.qtype, b))
            assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    finally:
        torch.set_num_threads(threads)


def test_bad_block_data_raises():
    with pytest.raises(ValueError, match="no kernel"):
        QuantizedWeight(torch.zeros(2, 20, dtype=torch.uint8), 2, (2, 32))  # Q4_0
    with pytest.raises(ValueError, match="does not hold"):
        QuantizedWeight(torch.zeros(2, 21, dtype=torch.uint8), 3, (2, 32))
    a = QuantizedWeight(torch.zeros(2, 20, dtype=torch.uint8), 3, (2, 32))
    b = QuantizedWeight(torch.zeros(2, 34, dtype=torch.uint8), 8, (2, 32))
    with pytest.raises(ValueError, match="one block format"):
        QuantizedWeight.cat([a, b])


@pytest.fixture(scope="module")
def smol_pair():
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.models.loader import load_checkpoint

    ckpt = load_checkpoint(None)
    return (ckpt, LlamaForCausalLM.from_checkpoint(ckpt, quantization="none"),
            LlamaForCausalLM.from_checkpoint(ckpt))  # auto: the blocks, here


@needs_kernel
@pytest.mark.slow
def test_smollm2_gguf_blocks_give_the_fp32_models_logits(smol_pair):
    """Every matrix of the embedded model in its Q4_1/Q8_0 blocks; prefill and decode steps give
    bit-identical logits to the fp32 model."""
    from pagedllm.attention import get_backend
    from pagedllm.kv import KVCache
    from pagedllm.models.forward_pass import ForwardPass, SeqChunk

    ckpt, dense, quant = smol_pair
    cfg = ckpt.config
    assert (dense.quantization, quant.quantization) == ("none", "gguf")
    layer = quant.layers[0]
    assert all(isinstance(getattr(layer, a), QuantizedWeight)
               for a in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"))
    assert quant.lm_head is quant.embed and quant.embed.qtype == int(gguf.GGMLQuantizationType.Q8_0)
    runners = [ForwardPass(m, KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32, 16), get_backend("cpu"))
               for m in (dense, quant)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    steps = [[SeqChunk(list(range(200 + 31 * i, 300 + 31 * i)), 0, tables[i]) for i in range(3)]]
    steps += [[SeqChunk([17 + s + i], 100 + s, tables[i]) for i in range(3)] for s in range(3)]
    for chunks in steps:
        a, b = (r.execute(chunks) for r in runners)
        assert torch.equal(a, b)


def test_gguf_quantization_needs_a_gguf_checkpoint(smol_pair, tiny_hf_dir):
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.models.loader import load_checkpoint

    ckpt, _, _ = smol_pair
    with pytest.raises(ValueError, match="unknown quantization"):
        LlamaForCausalLM.from_checkpoint(ckpt, quantization="awq")
    for q in ("gguf", "gguf-a8"):
        with pytest.raises(ValueError, match="needs a GGUF checkpoint"):
            LlamaForCausalLM.from_checkpoint(load_checkpoint(tiny_hf_dir), quantization=q)


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory, smol_pair) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = smol_pair[0].tokenizer
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    d = tmp_path_factory.mktemp("tiny_hf")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@needs_kernel
@pytest.mark.slow
def test_engine_default_reads_the_blocks_and_generates_what_the_dense_model_does():
    from pagedllm import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for q in ("auto", "none"):
        llm = LLM(quantization=q, dtype="float32", num_blocks=32)
        assert llm.engine.forward_pass.model.quantization == ("gguf" if q == "auto" else "none")
        outs[q] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["auto"] == outs["none"]


@pytest.mark.slow
@needs_a8
def test_gguf_a8_costs_under_one_percent_of_perplexity(smollm2_dir):
    """int8 activations are not exact: on real text the paged model stays within 1% of HF's perplexity
    (the exact path is within 1e-3: tests/models/test_perplexity.py), through prefill chunks and the LM head."""
    from pagedllm.bench.perplexity import compare

    r = compare(smollm2_dir, tokens=1024, window=512, chunk=96, dtype="float32", quantization="gguf-a8")
    assert r["quantization"] == "gguf-a8"
    assert 2 < r["ppl_hf"] < 100
    assert 1e-6 < r["rel_diff"] < 1e-2, r  # not exact, but close


@pytest.mark.slow
@needs_a8
def test_gguf_a8_decode_steps_stay_close_to_the_exact_model(smol_pair):
    """Decode steps (one row per sequence, the small-M path) on real text: int8-activation logits within a
    few % of the exact model's (norm of the difference, after 30 layers) and the same greedy choice at
    nearly every step."""
    from pagedllm.attention import get_backend
    from pagedllm.bench.perplexity import wiki_token_ids
    from pagedllm.kv import KVCache
    from pagedllm.models.forward_pass import ForwardPass, SeqChunk
    from pagedllm.models.llama import LlamaForCausalLM

    ckpt, _, exact = smol_pair
    a8 = LlamaForCausalLM.from_checkpoint(ckpt, quantization="gguf-a8")
    assert a8.quantization == "gguf-a8" and a8.layers[0].down_weight.int8_activations
    # layer matrices and the (tied) LM head packed once at load; lookups read the embedding's blocks
    assert a8.layers[0].down_weight.packed and a8.lm_head.packed and not a8.embed.packed
    cfg = ckpt.config
    runners = [ForwardPass(m, KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32, 16), get_backend("cpu"))
               for m in (exact, a8)]
    text = wiki_token_ids(ckpt.tokenizer, 3 * 80 + 3 * 12)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    steps = [[SeqChunk(text[80 * i:80 * i + 64], 0, tables[i]) for i in range(3)]]
    steps += [[SeqChunk([text[80 * i + 64 + s]], 64 + s, tables[i]) for i in range(3)] for s in range(12)]
    errs, agree = [], 0
    for chunks in steps:
        a, b = (r.execute(chunks) for r in runners)
        errs.append(float((a - b).norm() / a.norm()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
    errs.sort()
    assert 0 < errs[len(errs) // 2] < 0.05 and errs[-1] < 0.15, errs  # measured: median 0.028, max 0.072
    assert agree >= 0.9 * 3 * len(steps), agree
