"""The batch-1 GEMV on GGUF blocks (``ops/csrc/gemv.cpp``): block scales factored out of the dot products, so the
same weights and fp32 arithmetic as gemm.cpp's bit-exact path in another summation order. Checked against a
float64 reference and against gemm.cpp, routed only where it applies, and greedy token-identical to HF on the
embedded model at batch 1."""

import gguf
import pytest
import torch

from pagedllm import ops
from pagedllm.models import layers, quant
from pagedllm.models.quant import QuantizedWeight

from tests.models.test_quant import QTYPES, make_weight

needs_kernels = pytest.mark.skipif(not (ops.load("gemv") and ops.load("gemm")),
                                   reason="the AVX2 C++ kernels could not be built on this machine")
Q4_1 = gguf.GGMLQuantizationType.Q4_1


def reference(x: torch.Tensor, dense: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ dense.double().T
    return y if b is None else y + b.double()


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (192, 576), (13, 1536), (3072, 576)])  # tiles of 4, tail, 1
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_is_as_close_to_float64_as_the_bit_exact_kernel(qtype, n, k, bias):
    qw, dense = make_weight(qtype, n, k, seed=n + k)
    g = torch.Generator().manual_seed(n * k)
    x, b = torch.randn(1, k, generator=g), (torch.randn(n, generator=g) if bias else None)
    ref = reference(x, dense, b)
    got = torch.ops.pagedllm.quant_gemv(x, qw.data, qw.qtype, b).double()
    exact = torch.ops.pagedllm.quant_linear(x, qw.data, qw.qtype, b).double()
    # fp32 rounding of a k-term sum: both kernels within a few ulps of the sum's scale, and of each other
    scale = (x.double().abs() @ dense.double().abs().T).max().item()
    tol = 4 * k**0.5 * 2**-24 * scale
    assert (got - ref).abs().max().item() <= tol
    assert (got - exact).abs().max().item() <= 2 * tol
    assert not torch.equal(got, ref) or n == 1  # really fp32 (a float64 kernel would equal the reference)


@needs_kernels
def test_gemv_refuses_what_it_cannot_run():
    qw, _ = make_weight(Q4_1, 8, 64, seed=1)
    with pytest.raises(RuntimeError, match="one contiguous float32 row"):
        torch.ops.pagedllm.quant_gemv(torch.randn(2, 64), qw.data, qw.qtype)
    with pytest.raises(RuntimeError, match="K / 32"):
        torch.ops.pagedllm.quant_gemv(torch.randn(1, 96), qw.data, qw.qtype)
    with pytest.raises(RuntimeError, match="qtype"):
        torch.ops.pagedllm.quant_gemv(torch.randn(1, 64), qw.data, 2)


@needs_kernels
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(7, 64), (192, 576), (13, 1536), (3072, 576)])
def test_gemv_parts_give_the_whole_calls_bits(qtype, n, k):
    """decode_layer's team computes a GEMV as parts, one per thread: any split must give quant_gemv's bits."""
    qw, _ = make_weight(qtype, n, k, seed=n + k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(n))
    want = torch.ops.pagedllm.quant_gemv(x, qw.data, qw.qtype)
    for parts in (1, 2, 3, 5):
        y = torch.full((1, n), float("nan"))
        for p in range(parts):
            torch.ops.pagedllm.quant_gemv_part(x, qw.data, qw.qtype, y, p, parts)
        assert torch.equal(y, want), parts


@needs_kernels
def test_gemv_part_refuses_a_bad_part_or_output():
    qw, _ = make_weight(Q4_1, 8, 64, seed=1)
    x, y = torch.randn(1, 64), torch.empty(1, 8)
    for part, parts in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(RuntimeError, match="part must be in"):
            torch.ops.pagedllm.quant_gemv_part(x, qw.data, qw.qtype, y, part, parts)
    for bad in (torch.empty(1, 7), torch.empty(1, 8, dtype=torch.float64), torch.empty(2, 8)):
        with pytest.raises(RuntimeError, match="y must be"):
            torch.ops.pagedllm.quant_gemv_part(x, qw.data, qw.qtype, bad, 0, 1)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_linear_routes_only_one_row_q4_1_to_the_gemv(monkeypatch, m, qtype):
    """One row: gemv.cpp; more rows: gemm.cpp, bit-identical to the dense kernel; PAGEDLLM_BITWISE_GEMV=1
    (FACTORED_GEMV off) or no gemv build: gemm.cpp at one row too."""
    qw, dense = make_weight(qtype, 40, 576, seed=m)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
    bitwise = torch.ops.pagedllm.linear(x, dense, None)
    expect_gemv = m == 1
    y = layers.linear(x, qw)
    assert torch.equal(y, torch.ops.pagedllm.quant_gemv(x, qw.data, qw.qtype) if expect_gemv else bitwise)
    monkeypatch.setattr(quant, "FACTORED_GEMV", False)
    assert torch.equal(layers.linear(x, qw), bitwise)
    monkeypatch.setattr(quant, "FACTORED_GEMV", True)
    monkeypatch.setattr(quant.ops, "load", lambda kernel: kernel != "gemv")  # no gemv build: the fallback
    assert torch.equal(layers.linear(x, qw), bitwise)


@needs_kernels
@pytest.mark.slow
def test_smollm2_gguf_batch1_greedy_matches_hf(smollm2_dir):
    """Batch-1 decode on the embedded model's Q4_1 / Q8_0 blocks (every GEMV through gemv.cpp): HF's greedy tokens on
    the dequantized weights, logits within 1e-4, over 24 steps of real text."""
    from transformers import AutoModelForCausalLM

    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.models.loader import load_checkpoint
    from tests.models.test_llama import assert_matches_hf, make_runner, wiki_text

    assert quant.FACTORED_GEMV
    ckpt = load_checkpoint(None)
    model = LlamaForCausalLM.from_checkpoint(ckpt)
    assert model.quantization == "gguf" and isinstance(model.layers[0].down_weight, QuantizedWeight)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = ckpt.tokenizer(wiki_text(4_000))["input_ids"]
    assert_matches_hf(hf, make_runner(model, "cpu", num_blocks=16), [ids[100:140]], n_new=24)
