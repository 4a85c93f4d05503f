"""A model's step through its decoder layers in one C++ call (``ops/csrc/decode_layer.cpp``,
``models/decode_layer.py``): the same ops as the per-op forward, so the same bits, on the embedded model's GGUF blocks,
for one row or several; used only where it applies."""

import pytest
import torch

from pagedllm import ops
from pagedllm.attention import get_backend
from pagedllm.attention.cpu import kernel_args
from pagedllm.attention.metadata import AttentionMetadata
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


def run_steps(model, backend, decode_steps: int, kv_dtype: torch.dtype = torch.float32, seqs: int = 1,
              prompt: int = 40) -> tuple[list[torch.Tensor], KVCache]:
    """One prefill step of ``seqs`` prompts (``prompt``, ``prompt`` - 8, ... tokens) then decode steps of all of them
    (``seqs`` rows); the logits of each step and the pool."""
    cfg = model.config
    per_seq = -(-(prompt + decode_steps) // 16)  # blocks of 16 slots
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, per_seq * seqs, 16, dtype=kv_dtype)
    runner = ForwardPass(model, kv, get_backend(backend) if isinstance(backend, str) else backend)
    tables = [list(range(per_seq * s, per_seq * (s + 1))) for s in range(seqs)]
    lens = [prompt - 8 * s for s in range(seqs)]
    out = [runner.execute([SeqChunk(list(range(300 + s, 300 + s + n)), 0, t)
                           for s, (n, t) in enumerate(zip(lens, tables))])]
    out += [runner.execute([SeqChunk([500 + step + s], n + step, t) for s, (n, t) in enumerate(zip(lens, tables))])
            for step in range(decode_steps)]
    return out, kv


def assert_same_steps(got, kv_got, want, kv_want, layers: int) -> None:
    """The two runs' logits and pools (an int8 pool's scales too) bit for bit."""
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for i in range(layers):
        (kg, vg, sg), (kw, vw, sw) = kernel_args(*kv_got.layer(i)), kernel_args(*kv_want.layer(i))
        assert torch.equal(kg, kw) and torch.equal(vg, vw) and sg.keys() == sw.keys()
        assert all(torch.equal(sg[k], sw[k]) for k in sg)


def count_fused_calls(monkeypatch) -> list:
    calls = []
    real = fused.FusedDecode.__call__
    monkeypatch.setattr(fused.FusedDecode, "__call__", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    return calls


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("quantization,kv_dtype,seqs", [("gguf", torch.float32, 1), ("gguf-a8", torch.float32, 1),
                                                        ("gguf", torch.int8, 1), ("none", torch.float32, 1),
                                                        ("gguf", torch.float32, 3), ("gguf-a8", torch.float32, 3),
                                                        ("gguf", torch.int8, 3), ("none", torch.float32, 3)])
def test_fused_steps_equal_the_per_op_path_bit_for_bit(ckpt, quantization, kv_dtype, seqs, monkeypatch):
    """Every layer of a step in one call, for one row or several, on GGUF blocks or dense fp32 matrices
    (``quantization="none"``): the per-op path's logits and pool, bit for bit. On the paged kernel (an fp32 or int8
    pool) the prompts' step is fused too."""
    model = llama.LlamaForCausalLM.from_checkpoint(ckpt, dtype=torch.float32, quantization=quantization)
    calls = count_fused_calls(monkeypatch)
    got, kv_got = run_steps(model, "cpu", 4, kv_dtype, seqs)
    assert calls == [sum(40 - 8 * s for s in range(seqs))] + [seqs] * 4  # every step's rows, all their layers
    monkeypatch.setattr(fused, "FUSED", False)
    want, kv_want = run_steps(model, "cpu", 4, kv_dtype, seqs)
    assert_same_steps(got, kv_got, want, kv_want, model.config.num_layers)


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["gguf", "gguf-a8", "none"])
def test_a_long_prompt_step_takes_its_gate_up_in_row_chunks_with_the_same_bits(ckpt, quantization, monkeypatch):
    """A prompt step of more than ``kActRows`` (1,024) rows runs gate/up and silu * up chunk by chunk (never the
    whole [T, 2I]): the per-op path's logits and pool, bit for bit, on each GEMM format."""
    if quantization == "gguf-a8" and not ops.load("quant_a8"):
        pytest.skip("quant_a8.cpp could not be built here")
    model = llama.LlamaForCausalLM.from_checkpoint(ckpt, dtype=torch.float32, quantization=quantization)
    calls = count_fused_calls(monkeypatch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        got, kv_got = run_steps(model, "cpu", 1, seqs=2, prompt=1100)
    assert calls == [1100 + 1092, 2]
    silu_rows = [e.input_shapes[0][0] for e in prof.events() if e.name == "pagedllm::silu_mul"]
    layers = model.config.num_layers
    assert sorted(silu_rows) == sorted([730, 731, 731] * layers + [2] * layers)  # 2,192 rows in 3 chunks, the decode
    monkeypatch.setattr(fused, "FUSED", False)
    want, kv_want = run_steps(model, "cpu", 1, seqs=2, prompt=1100)
    assert_same_steps(got, kv_got, want, kv_want, model.config.num_layers)


@needs_kernels
@pytest.mark.slow
def test_a_step_with_a_prefill_chunk_for_sdpa_runs_per_op(ckpt, monkeypatch):
    """Prompts long enough for the backend's SDPA prefill take the per-op path (its attention is not the paged
    kernel's), the decode steps after them the fused call; the same bits as per-op throughout."""
    model = llama.LlamaForCausalLM.from_checkpoint(ckpt)
    calls = count_fused_calls(monkeypatch)
    got, kv_got = run_steps(model, get_backend("cpu", sdpa_prefill_min_len=16), 3, seqs=2)
    assert calls == [2, 2, 2]
    monkeypatch.setattr(fused, "FUSED", False)
    want, kv_want = run_steps(model, get_backend("cpu", sdpa_prefill_min_len=16), 3, seqs=2)
    assert_same_steps(got, kv_got, want, kv_want, model.config.num_layers)


@needs_kernels
@pytest.mark.slow
def test_gguf_bf16_rows_on_the_bf16_copies_are_not_fused_here(ckpt, monkeypatch):
    """gguf-bf16 runs a GEMM of its copies' ``min_rows`` rows or more on the bf16 copy, which the fused call does
    not: such steps take another path (``bf16_layers`` or per-op), and the smaller ones the fused call, the same
    bits as per-op."""
    model = llama.LlamaForCausalLM.from_checkpoint(ckpt, quantization="gguf-bf16")
    min_rows = model.layers[0].qkv_weight.bf16.min_rows
    assert model.fused_decode.max_rows == min_rows
    seqs = min(3, min_rows - 1)
    calls = count_fused_calls(monkeypatch)
    got, kv_got = run_steps(model, "cpu", 2, seqs=seqs)
    prompt_rows = sum(40 - 8 * s for s in range(seqs))
    assert calls == ([seqs] * 2 if prompt_rows >= min_rows else [prompt_rows] + [seqs] * 2)
    monkeypatch.setattr(fused, "FUSED", False)
    want, kv_want = run_steps(model, "cpu", 2, seqs=seqs)
    assert_same_steps(got, kv_got, want, kv_want, model.config.num_layers)


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["gguf", "gguf-a8"])
def test_one_region_layer_on_two_threads_gives_the_one_thread_bits(ckpt, quantization, monkeypatch, two_threads):
    """The layer as one parallel region (GEMVs split by rows over the team, attention by kv head, the norms and
    the activation on each thread) computes what one thread computes: the logits and the pool do not depend on the
    thread count."""
    if not ops.load("quant_a8"):
        pytest.skip("quant_a8.cpp could not be built here")
    model = llama.LlamaForCausalLM.from_checkpoint(ckpt, quantization=quantization)
    got, kv_got = run_steps(model, "cpu", 4)
    torch.set_num_threads(1)
    want, kv_want = run_steps(model, "cpu", 4)
    torch.set_num_threads(2)
    monkeypatch.setattr(fused, "ONE_REGION", False)  # PAGEDLLM_DECODE_REGION_PER_OP=1: the same on two threads
    per_op = run_steps(model, "cpu", 4)[0]
    for a, b, c in zip(got, want, per_op):
        assert torch.equal(a, b)
        assert (a - c).abs().max() <= 1e-4 * a.abs().max()  # attention splits over two threads there: fp32 rounding
    for i in range(model.config.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(kv_got.layer(i), kv_want.layer(i)))


@needs_kernels
@pytest.mark.parametrize("bad_layer", [0, 1])
def test_one_region_layers_raise_a_kernels_error_without_hanging_the_team(smol, two_threads, bad_layer):
    """A check that fails inside the team (here: a wrong output size for the o projection, met in the first or the
    second layer) reaches the caller as the kernel's error; the other thread still passes every phase (the call
    returns)."""
    _, model = smol
    layers, cfg = model.layers[:2], model.config
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, 16)
    w = [[getattr(layer, a) for layer in layers] for a in fused.MATRICES]
    h, d = torch.randn(1, cfg.hidden_size), torch.randn(1, cfg.hidden_size)
    cos, sin = torch.ones(1, cfg.head_dim // 2), torch.zeros(1, cfg.head_dim // 2)
    rows = [m[0].shape[0] for m in w]
    qtypes = [getattr(layer, a).qtype for layer in layers for a in fused.MATRICES]
    bad = list(w[1])
    bad[bad_layer] = model.layers[0].qkv_weight  # more rows than rows[1] says
    with pytest.raises(RuntimeError, match="y must be"):
        torch.ops.pagedllm.decode_layer(
            h, d, [layer.input_norm for layer in layers], [layer.post_norm for layer in layers], layers[0].eps,
            [m.data for m in w[0]], [m.data for m in bad], [m.data for m in w[2]], [m.data for m in w[3]],
            qtypes, rows, False, cos, sin, layers[0].num_heads, [kv.layer(i)[0] for i in range(2)],
            [kv.layer(i)[1] for i in range(2)], torch.tensor([0]), torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 8, 0.125, 4, [], [],
            one_region=True)


@needs_kernels
def test_decode_layer_refuses_lists_of_other_lengths(smol):
    _, model = smol
    layer, cfg = model.layers[0], model.config
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, 16)
    w = [getattr(layer, a) for a in fused.MATRICES]
    args = [torch.randn(1, cfg.hidden_size), None, [layer.input_norm], [layer.post_norm, layer.post_norm], layer.eps,
            *([m.data] for m in w), [m.qtype for m in w], [m.shape[0] for m in w], False,
            torch.ones(1, cfg.head_dim // 2), torch.zeros(1, cfg.head_dim // 2), layer.num_heads, [kv.layer(0)[0]],
            [kv.layer(0)[1]], torch.tensor([0]), torch.tensor([[0]], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 8, 0.125, 4, [], []]
    with pytest.raises(RuntimeError, match="one entry a layer"):
        torch.ops.pagedllm.decode_layer(*args)
    args[3] = [layer.post_norm]
    args[9] = args[9] * 2  # formats for two layers
    with pytest.raises(RuntimeError, match="qtypes must give"):
        torch.ops.pagedllm.decode_layer(*args)


def decode_meta(rows: int) -> AttentionMetadata:
    """A decode step of ``rows`` sequences of 5 tokens each in a 16-token block."""
    return AttentionMetadata.build([1] * rows, [5] * rows, [[r] for r in range(rows)], 16)


@needs_kernels
def test_the_fused_call_applies_only_where_the_per_op_path_calls_the_same_ops(smol, monkeypatch):
    _, model = smol
    layer, cpu = model.layers[0], get_backend("cpu")
    kv = KVCache(1, layer.num_kv_heads, layer.head_dim, 4, 16)
    one, three = torch.zeros(1, 576), torch.zeros(3, 576)

    def applies(h, backend=cpu):
        return fused.FusedDecode(torch.nn.ModuleList([layer])).applies(h, backend, kv, decode_meta(h.shape[0]))

    assert applies(one) and applies(three)  # one row (the GEMV) or several (gemm.cpp)
    assert not applies(one.double())
    assert not applies(one, get_backend("reference"))
    prefill = AttentionMetadata.build([3], [3], [[0]], 16)  # a 3-token prompt: the paged kernel's, fused
    assert fused.FusedDecode(torch.nn.ModuleList([layer])).applies(three, cpu, kv, prefill)
    sdpa = get_backend("cpu", sdpa_prefill_min_len=2)  # ... unless the backend sends it to SDPA
    assert not fused.FusedDecode(torch.nn.ModuleList([layer])).applies(three, sdpa, kv, prefill)
    assert applies(three, sdpa)  # its decode steps still on the kernel
    monkeypatch.setattr(layer, "qkv_bias", torch.zeros(960))
    assert not applies(one)
    monkeypatch.undo()
    monkeypatch.setattr(model.layers[0], "down_weight", layer.down_weight.pack_a8())  # mixed gguf and gguf-a8
    assert not applies(one)
    monkeypatch.undo()
    monkeypatch.setattr(fused, "FUSED", False)  # PAGEDLLM_UNFUSED_DECODE=1
    assert not applies(one) and not applies(three)
    monkeypatch.undo()
    monkeypatch.setattr(fused.quant, "FACTORED_GEMV", False)  # the bit-exact GEMVs: the per-op path at one row
    assert not applies(one) and applies(three)  # (several rows are on gemm.cpp either way)


@needs_kernels
def test_dense_layers_take_the_call_only_with_the_matrices_gemm_cpp_takes(ckpt):
    """Dense fp32 matrices run op by op through gemm.cpp's ``linear`` in the call (qtype F32); a layer whose matrix
    the per-op path sends elsewhere (bf16, or not contiguous: ``F.linear``) keeps the per-op path."""

    def fused_first_layer(**replace) -> fused.FusedDecode:  # a fresh model each time: nothing to restore
        layer = llama.LlamaForCausalLM.from_checkpoint(ckpt, dtype=torch.float32, quantization="none").layers[0]
        for name, change in replace.items():
            setattr(layer, name, torch.nn.Parameter(change(getattr(layer, name)), requires_grad=False))
        return fused.FusedDecode(torch.nn.ModuleList([layer]))

    dense = fused_first_layer()
    assert dense.gemv == "gemm" and dense.qtypes == [0] * 4
    assert fused_first_layer(o_weight=lambda w: w.bfloat16()).gemv is None
    assert fused_first_layer(down_weight=lambda w: w.t().contiguous().t()).gemv is None


@needs_kernels
def test_a_model_with_one_unfusable_layer_runs_every_layer_per_op(ckpt, monkeypatch):
    """The fused call takes every layer or none: a model whose last layer carries a bias takes the per-op path."""
    model = llama.LlamaForCausalLM.from_checkpoint(ckpt)
    cfg = model.config
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 16)
    assert model.fused_decode.applies(torch.zeros(1, 576), get_backend("cpu"), kv, decode_meta(1))
    model = llama.LlamaForCausalLM.from_checkpoint(ckpt)
    model.layers[-1].qkv_bias = torch.nn.Parameter(torch.zeros(960), requires_grad=False)
    assert not model.fused_decode.applies(torch.zeros(1, 576), get_backend("cpu"), kv, decode_meta(1))


FRESH_A8 = """
from pagedllm import LLM, SamplingParams
from pagedllm.ops import build
from pagedllm.models import decode_layer
calls = []
real = decode_layer.FusedDecode.__call__
decode_layer.FusedDecode.__call__ = lambda *a, **k: calls.append(1) or real(*a, **k)
llm = LLM(quantization="gguf-a8", dtype="float32", num_blocks=16)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                   use_tqdm=False)[0].outputs[0]
assert len(out.token_ids) == 3 and len(calls) == 3, (out, len(calls))  # every step (the prompt's too), all layers
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
