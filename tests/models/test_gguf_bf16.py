"""``quantization="gguf-bf16"``: the weight format chosen per GEMM size (decode rows from the exact GGUF blocks, larger
GEMMs and the LM head from bf16 copies prepacked for oneDNN), what ``auto`` resolves to on a CPU with native bf16,
and dense bf16 weights prepacked the same way. On a CPU without native bf16 (CI's may be AVX2 only) the bf16 copies
are plain bf16 matrices run by ``F.linear``: the same arithmetic, so every assertion here holds on either."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention import AttentionMetadata, get_backend
from pagedllm.config.args import EngineArgs
from pagedllm.config.device import DeviceConfig
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models import bf16_gemm, llama
from pagedllm.models.bf16_gemm import PackedBF16, amx_bf16_available, bf16_linear
from pagedllm.models.forward_pass import ForwardPass, SeqChunk
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.quant import BF16_MIN_ROWS, QuantizedWeight, kernel_available, quantized_linear

pytestmark = pytest.mark.skipif(not kernel_available(), reason="needs the GGUF block kernel")


@pytest.fixture(scope="module")
def ckpt():
    from pagedllm.models.loader import load_checkpoint

    return load_checkpoint(None)


def test_bf16_linear_is_a_bf16_gemm_in_the_activations_dtype():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    p = PackedBF16.of(w)
    assert p.shape == (96, 64)
    y = bf16_linear(x, p, b)
    assert y.dtype == torch.float32
    ref = F.linear(x.bfloat16(), w.bfloat16()).float() + b
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    yb = bf16_linear(x.bfloat16(), p)  # bf16 activations stay bf16
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, F.linear(x.bfloat16(), w.bfloat16()), rtol=0, atol=0)


def test_bf16_min_rows_per_cpu_class(monkeypatch):
    """The copy from 2 rows where bf16 is native (VDPBF16PS, or AMX tiles reading the blocks, beat the exact blocks
    there), from 8 where it is emulated; PAGEDLLM_BF16_MIN_ROWS wins over both."""
    from pagedllm.models import quant

    for native, rows in ((True, 2), (False, 8)):
        monkeypatch.setattr(quant, "cpu_has_native_bf16", lambda n=native: n)
        assert quant.default_bf16_min_rows() == rows
    code = "from pagedllm.models.quant import BF16_MIN_ROWS; print(BF16_MIN_ROWS)"
    env = {**os.environ, "PAGEDLLM_BF16_MIN_ROWS": "5"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "5"


def test_block_matrix_takes_its_bf16_copy_from_min_rows(ckpt):
    from pagedllm.models.quant import load_blocks

    w = load_blocks(ckpt.blocks_path)["model.layers.0.mlp.down_proj.weight"]
    wb = w.with_bf16(min_rows=4)
    assert wb.bf16 is not None and wb.bf16.min_rows == 4 and w.bf16 is None
    dense = w.dequantize()
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3):  # below min_rows: the exact block kernel, bit for bit
        x = torch.randn(rows, w.shape[1], generator=gen)
        assert torch.equal(quantized_linear(x, wb, None), quantized_linear(x, w, None))
    for rows in (4, 33):  # from min_rows: the bf16 product (oneDNN's or the AMX tiles'), rounded once
        x = torch.randn(rows, w.shape[1], generator=gen)
        ref = x.bfloat16().double() @ dense.bfloat16().double().T
        torch.testing.assert_close(quantized_linear(x, wb, None).double(), ref, rtol=2 ** -8,
                                   atol=1e-4 * w.shape[1] ** 0.5)
        exact = F.linear(x, dense)
        assert ((quantized_linear(x, wb, None) - exact).norm() / exact.norm()).item() < 1e-2
    # a slice or a fusion is another matrix: it never keeps the copy of the whole
    assert wb.take_rows(torch.arange(8)).bf16 is None and wb.take_cols(0, 32).bf16 is None
    assert QuantizedWeight.cat([wb, wb]).bf16 is None
    with pytest.raises(ValueError, match="gguf-a8"):
        w.pack_a8().with_bf16()


def _forward(model, ids: list[list[int]], kv_dtype=torch.float32) -> torch.Tensor:
    """Logits of every position of each prompt (packed as one prefill)."""
    cfg = model.config
    blocks = sum(-(-len(p) // 16) for p in ids)
    runner = ForwardPass(model, KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, blocks, 16, dtype=kv_dtype),
                         get_backend("cpu"))
    tables, start = [], 0
    for p in ids:
        n = -(-len(p) // 16)
        tables.append(list(range(start, start + n)))
        start += n
    lens = [len(p) for p in ids]
    meta = AttentionMetadata.build(lens, lens, tables, 16)
    h = model(torch.tensor(sum(ids, [])), meta.positions, runner.kv_cache, meta, runner.backend)
    return model.compute_logits(h)


@pytest.mark.slow
def test_gguf_bf16_top1_agrees_with_fp32_hf_as_well_as_hf_bf16(ckpt, wiki_texts):
    """Prefill through the bf16 copies (fp32 activations, bf16 KV): top-1 against fp32 HF on the same weights must
    be at least as close as HF's own bf16 forward (less is rounded: only the large GEMMs' inputs)."""
    from transformers import AutoModelForCausalLM

    ids = ckpt.tokenizer(" ".join(wiki_texts[:40]))["input_ids"]
    windows = [ids[:256], ids[256:512]]
    hf = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(windows)).logits.argmax(-1).flatten()
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
        hf_agree = (hf_bf16(torch.tensor(windows)).logits.argmax(-1).flatten() == ref).float().mean().item()
    model = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, "gguf-bf16")
    assert model.quantization == "gguf-bf16" and model.act_dtype == torch.float32
    assert model.layers[0].gate_up_weight.bf16.min_rows == BF16_MIN_ROWS == model.lm_head.bf16.min_rows
    assert model.embed.bf16 is None  # lookups read the blocks
    agree = (_forward(model, windows, torch.bfloat16).argmax(-1) == ref).float().mean().item()
    assert agree >= hf_agree, f"gguf-bf16 top-1 agrees with fp32 HF on {agree:.2%}, HF bf16 on {hf_agree:.2%}"
    assert agree >= 0.96  # 0.969 on a Zen 3 (bf16 emulated: F.linear on the plain copy), 0.97+ with native bf16


def test_gguf_bf16_decode_rows_read_the_exact_blocks(ckpt):
    """Below BF16_MIN_ROWS every GEMM runs exactly the ``gguf`` model's kernels (the fused batch-1 layer and the LM
    head included): one token a step gives the same bits."""
    exact = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, "gguf")
    mixed = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, "gguf-bf16")
    cfg = exact.config
    prompt = ckpt.tokenizer("The capital of France is")["input_ids"]
    logits = []
    for model in (exact, mixed):
        runner = ForwardPass(model, KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 16), get_backend("cpu"))
        steps = []
        for pos, tok in enumerate(prompt):  # one token a step: every GEMM has one row
            meta = AttentionMetadata.build([1], [pos + 1], [[0, 1]], 16)
            h = model(torch.tensor([tok]), meta.positions, runner.kv_cache, meta, runner.backend)
            steps.append(model.compute_logits(h))
        logits.append(torch.cat(steps))
    assert torch.equal(logits[0], logits[1])
    rows = torch.randn(BF16_MIN_ROWS, cfg.hidden_size)  # from BF16_MIN_ROWS rows the head takes its bf16 copy
    head = PackedBF16.of(exact.lm_head.dequantize())
    assert torch.equal(mixed.compute_logits(rows), bf16_linear(rows, head, out_dtype=torch.float32))


def test_lm_head_writes_a_reused_buffer_with_the_same_logits(ckpt):
    """``compute_logits(h, out)`` widens the bf16 head's result into the caller's buffer (no fresh float32 tensor a
    step): the same values, in its first rows. Below BF16_MIN_ROWS (the exact fp32 blocks) the buffer is not
    needed and fresh logits come back."""
    model = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, "gguf-bf16")
    buf = torch.full((64, model.config.vocab_size), float("nan"))
    rows = torch.randn(BF16_MIN_ROWS + 3, model.config.hidden_size)
    got = model.compute_logits(rows, buf)
    assert got.data_ptr() == buf.data_ptr() and got.dtype == torch.float32
    assert torch.equal(got, model.compute_logits(rows)) and torch.isnan(buf[len(rows):]).all()
    one = torch.randn(1, model.config.hidden_size)
    assert torch.equal(model.compute_logits(one, buf), model.compute_logits(one))
    assert model.compute_logits(one, buf).data_ptr() != buf.data_ptr()


def test_model_runner_keeps_one_logits_buffer_across_steps(monkeypatch):
    """The engine's steps write their logits into one buffer, grown only when a step has more rows, and generate
    what they generated with fresh logits every step."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker import model_runner

    sp = SamplingParams(max_tokens=6, temperature=0)
    prompts = [f"Item {i}: the history of paged memory" for i in range(BF16_MIN_ROWS + 2)]
    llm = LLM(quantization="gguf-bf16", num_blocks=64, block_size=16)
    runner = llm.engine.core.executor.worker.model_runner
    ptrs = set()
    make = runner._logits_buffer
    monkeypatch.setattr(runner, "_logits_buffer", lambda n, dev: ptrs.add(make(n, dev).data_ptr()) or make(n, dev))
    reused = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert len(ptrs) == 1
    monkeypatch.setattr(runner, "_logits_buffer", lambda n, dev: None)
    llm.reset_prefix_cache()  # the same steps as the first run (cached prefixes would change the GEMMs' row counts)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == reused


def test_gguf_bf16_layers_hand_bf16_between_gemms_with_the_same_bits(ckpt, monkeypatch):
    """From BF16_MIN_ROWS rows the norms and the activation write bf16 for the bf16 GEMMs and the GEMMs' bf16 results
    are read as they are (``LlamaDecoderLayer._bf16_inputs``): the logits equal those of casting at every GEMM."""
    model = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, "gguf-bf16")
    prompts = [ckpt.tokenizer("Paged attention keeps the cache in blocks of sixteen tokens")["input_ids"],
               ckpt.tokenizer("The capital of France is")["input_ids"]]
    layer = model.layers[0]
    assert layer._bf16_inputs(torch.zeros(sum(map(len, prompts)), 1), None) == torch.bfloat16
    assert layer._bf16_inputs(torch.zeros(BF16_MIN_ROWS - 1, 1), None) is None
    fused = _forward(model, prompts, torch.bfloat16)
    monkeypatch.setattr(llama.LlamaDecoderLayer, "_bf16_inputs", lambda self, h, lora: None)
    assert torch.equal(fused, _forward(model, prompts, torch.bfloat16))


def test_dense_bf16_prepacked_computes_what_f_linear_does(ckpt, monkeypatch):
    """bf16 activations on a native-bf16 CPU: the matrices prepacked once give the logits ``F.linear`` gave."""
    monkeypatch.setattr(llama, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(llama, "onednn_bf16_available", lambda: True)  # on AVX2: plain bf16 copies, same meaning
    if not amx_bf16_available():  # VDPBF16PS sums in another order than oneDNN (its test: tests/ops/test_amx_gemm.py)
        monkeypatch.setattr(bf16_gemm, "packed_copy_available", lambda: False)
    model = LlamaForCausalLM.from_checkpoint(ckpt, torch.bfloat16, "none")
    assert model.act_dtype == torch.bfloat16
    prompt = [ckpt.tokenizer("Paged attention keeps the cache in blocks")["input_ids"]]
    before = _forward(model, prompt, torch.bfloat16)
    assert model.prepack_bf16()
    assert isinstance(model.layers[3].qkv_weight, PackedBF16) and isinstance(model.lm_head, PackedBF16)
    assert isinstance(model.embed, torch.Tensor)  # the tied embedding keeps its rows for lookups
    torch.testing.assert_close(_forward(model, prompt, torch.bfloat16), before, rtol=0, atol=0)


def test_fp32_model_is_never_prepacked(ckpt, monkeypatch):
    monkeypatch.setattr(llama, "onednn_bf16_available", lambda: True)
    model = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, "none")
    assert not model.prepack_bf16() and isinstance(model.layers[0].qkv_weight, torch.Tensor)


@pytest.mark.parametrize("native", [True, False])
def test_auto_resolves_to_gguf_bf16_on_native_bf16_cpus(monkeypatch, native):
    from pagedllm.config import device

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: native)
    auto = DeviceConfig.from_args(EngineArgs(), gguf_blocks=lambda: True)
    if native:
        assert (auto.dtype, auto.kv_dtype, auto.quantization) == (torch.float32, torch.bfloat16, "gguf-bf16")
    else:
        assert (auto.dtype, auto.kv_dtype, auto.quantization) == (torch.float32, torch.float32, "auto")
    # no blocks: dense, as before; an explicit dtype or quantization is kept
    dense = DeviceConfig.from_args(EngineArgs(), gguf_blocks=lambda: False)
    assert dense.quantization == "auto" and dense.dtype == (torch.bfloat16 if native else torch.float32)
    exact = DeviceConfig.from_args(EngineArgs(dtype="float32"), gguf_blocks=lambda: True)
    assert (exact.dtype, exact.quantization) == (torch.float32, "auto")
    kv = DeviceConfig.from_args(EngineArgs(kv_cache_dtype="int8"), gguf_blocks=lambda: True)
    assert kv.kv_dtype == torch.int8
    asked = DeviceConfig.from_args(EngineArgs(quantization="gguf-bf16"))
    assert (asked.dtype, asked.kv_dtype, asked.quantization) == (torch.float32, torch.bfloat16, "gguf-bf16")
    # gguf-a8 under dtype auto: fp32 activations (the fused batch-1 layer), a bf16 pool where bf16 is native
    a8 = DeviceConfig.from_args(EngineArgs(quantization="gguf-a8"), gguf_blocks=lambda: True)
    assert (a8.dtype, a8.kv_dtype, a8.quantization) == (torch.float32, torch.bfloat16 if native else torch.float32,
                                                        "gguf-a8")
    a8_bf16 = DeviceConfig.from_args(EngineArgs(quantization="gguf-a8", dtype="bfloat16"), gguf_blocks=lambda: True)
    assert a8_bf16.dtype == torch.bfloat16  # asked for: still allowed


@pytest.mark.slow
def test_engine_auto_on_native_bf16_generates_like_gguf_bf16(monkeypatch):
    """The whole engine with dtype and quantization auto on a (patched) native-bf16 CPU runs gguf-bf16 with a bf16
    pool; its greedy tokens equal an explicit gguf-bf16 engine's."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.config import device

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    sp = SamplingParams(max_tokens=12, temperature=0)
    prompts = ["The history of paged memory", "A short poem about the sea:\n" * 3]
    outs = []
    for kwargs in ({}, {"quantization": "gguf-bf16", "kv_cache_dtype": "bfloat16"}):
        llm = LLM(num_blocks=64, **kwargs)
        spec = llm.engine.core.spec
        assert (spec.quantization, spec.dtype, spec.kv_dtype) == ("gguf-bf16", "float32", "bfloat16")
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
        del llm
    assert outs[0] == outs[1] and all(len(t) == 12 for t in outs[0])
