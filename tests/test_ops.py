"""The C++ kernels as torch custom ops (``torch.ops.pagedllm``): every op passes ``torch.library.opcheck`` (its
schema declares what it mutates, its fake implementation gives the real outputs' shapes, dtypes and strides, it
traces under AOT autograd with dynamic shapes), and ``torch.compile(fullgraph=True)`` runs a decoder layer's worth
of them as one graph with the eager results, the pool writes included."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from pagedllm import ops
from pagedllm.bench.attention import make_random_batch

pytestmark = pytest.mark.skipif(not all(ops.load(k) for k in ops.KERNELS), reason="no C++ compiler / AVX2 here")

Q4_1, Q8_0 = int(gguf.GGMLQuantizationType.Q4_1), int(gguf.GGMLQuantizationType.Q8_0)


def _blocks(qtype: int, n: int, k: int) -> torch.Tensor:
    w = np.random.default_rng(n + k).standard_normal((n, k), dtype=np.float32)
    return torch.from_numpy(quantize(w, gguf.GGMLQuantizationType(qtype)))


def _attention_args(cache_dtype: torch.dtype = torch.float32) -> dict:
    """A mixed batch (two decodes, one prefill chunk) over scattered blocks, GQA 2 -> 4 heads; an int8 pool
    carries its [Hkv, num_blocks] scales."""
    b = make_random_batch([1, 1, 5], [9, 20, 12], num_kv_heads=2, group=2, head_dim=16, spare_blocks=2)
    kc, vc, scales = b.k_cache, b.v_cache, {}
    if cache_dtype == torch.int8:
        kc, vc = (torch.randint(-127, 128, c.shape, dtype=torch.int8) for c in (kc, vc))
        nb = kc.shape[1] // b.meta.block_size
        scales = {"k_scale": torch.rand(2, nb) / 50, "v_scale": torch.rand(2, nb) / 50}
    return {"b": b, "k_cache": kc, "v_cache": vc, "scales": scales}


def _cases() -> list[tuple[str, tuple, dict]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for cache_dtype in (torch.float32, torch.int8):
        a = _attention_args(cache_dtype)
        b, m = a["b"], a["b"].meta
        T, H, D = b.q.shape
        qkv = torch.cat([b.q.reshape(T, -1), b.k.reshape(T, -1), b.v.reshape(T, -1)], 1)
        pool = (a["k_cache"], a["v_cache"])
        out += [
            ("write_kv", (b.k, b.v, *pool, m.slot_mapping), {**a["scales"], "block_size": m.block_size}),
            ("paged_attention_out", (torch.empty_like(b.q), b.q, *pool, m.block_tables, m.seq_lens,
                                     m.query_start_loc, m.block_size, b.scale, 0, m.num_seqs, 4), a["scales"]),
            ("attend_qkv", (qkv, H, *pool, m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc,
                            m.block_size, b.scale, 4), a["scales"]),
            ("attend_qkv_part", (qkv, H, *pool, m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc,
                                 m.block_size, b.scale, 4, a["scales"].get("k_scale"), a["scales"].get("v_scale"),
                                 torch.empty(T, H * D), 1, 2), {}),
        ]
    x, w, bias = torch.randn(3, 64, generator=g), torch.randn(5, 64, generator=g), torch.randn(5, generator=g)
    q4, q8 = _blocks(Q4_1, 9, 64), _blocks(Q8_0, 9, 64)
    out += [
        ("linear", (x, w, bias), {}),
        ("linear", (x, w.bfloat16(), None), {}),
        ("quant_linear", (x, q4, Q4_1, None), {}),
        ("quant_linear", (x, q8, Q8_0, torch.randn(9, generator=g)), {}),
        ("dequantize", (q8, Q8_0, 64), {}),
        ("quant_gemv", (x[:1], q4, Q4_1, torch.randn(9, generator=g)), {}),
        ("quant_gemv", (x[:1], q8, Q8_0, None), {}),
        ("quant_gemv_part", (x[:1], q4, Q4_1, torch.empty(1, 9), 1, 2), {}),
        ("add_rms_norm", (torch.randn(3, 24, generator=g), torch.randn(3, 24, generator=g), torch.randn(24), 1e-5), {}),
        ("add_rms_norm", (torch.randn(3, 24, generator=g), None, torch.randn(24), 1e-5), {}),
        ("rope", (torch.randn(3, 4, 16, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)),
         {}),
        ("rope", (torch.randn(3, 6 * 16, generator=g), torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g),
                  4), {}),
        ("rope_widen", (torch.randn(3, 6 * 16 + 5, generator=g).bfloat16(), torch.randn(3, 8, generator=g),
                        torch.randn(3, 8, generator=g), 4), {}),
        ("add_rms_norm", (torch.randn(3, 24, generator=g), torch.randn(3, 24, generator=g).bfloat16(),
                          torch.randn(24), 1e-5, True), {}),
        ("silu_mul", (torch.randn(3, 40, generator=g),), {}),
        ("silu_mul", (torch.randn(3, 40, generator=g).bfloat16(), True), {}),
        ("argmax_logsumexp", (torch.randn(3, 50, generator=g),), {}),
        ("exponential_race", (torch.randn(3, 50, generator=g), torch.rand(3) + 0.5, torch.arange(3),
                              torch.arange(3) + 7), {}),
        ("filtered_race", (torch.randn(3, 50, generator=g), torch.rand(3) + 0.5, torch.tensor([0, 5, 60]),
                           torch.tensor([0.9, 1.0, 0.5]), torch.tensor([0.0, 0.1, 0.0]), torch.arange(3),
                           torch.arange(3) + 7), {}),
        ("linear_a8", (x, q4, Q4_1, None), {}),
        ("quantize_a8", (x,), {}),
        ("pack_a8", (q8, Q8_0), {}),
        ("linear_a8_packed", (x, torch.ops.pagedllm.pack_a8(q4, Q4_1), Q4_1, 9, torch.randn(9, generator=g)), {}),
        ("linear_a8_packed_part", (x, torch.ops.pagedllm.pack_a8(q8, Q8_0), Q8_0, 9, torch.empty(3, 9), 0, 2), {}),
        ("amx_pack_bf16", (torch.randn(40, 70, generator=g).bfloat16(),), {}),
        ("amx_linear_bf16", (torch.randn(3, 70, generator=g).bfloat16(),
                             torch.ops.pagedllm.amx_pack_bf16(torch.randn(40, 70, generator=g).bfloat16()), 40), {}),
        ("amx_linear_silu_bf16", (torch.randn(20, 70, generator=g).bfloat16(),
                                  torch.ops.pagedllm.amx_pack_bf16(torch.randn(64, 70, generator=g).bfloat16()), 64), {}),
        ("amx_blocks_linear_bf16", (torch.randn(3, 64, generator=g).bfloat16(), q4, 9), {}),
        ("amx_blocks_linear_silu_bf16", (torch.randn(3, 64, generator=g).bfloat16(), _blocks(Q4_1, 32, 64), 32), {}),
        ("lora_bgmv", (torch.randn(3, 20, generator=g), torch.randn(3, 12, generator=g),
                       torch.randn(2, 2, 4, 12, generator=g), [torch.randn(2, 4, 8), torch.randn(2, 4, 5)], [0, 9],
                       torch.tensor([1, -1, 0])), {}),
        ("instruction_peak", (torch.zeros(1, dtype=torch.float64), "fp32_fma", 10), {}),
        ("step_inputs", (torch.randint(0, 50, (3, 12), generator=g), torch.randperm(9, generator=g).int().view(3, 3),
                         torch.tensor([2, 3, 1]), torch.tensor([0, 2, 0]), [1, 0], [1, 4], [6, 0], 4), {}),
    ]
    pf = make_random_batch([5, 40], [9, 40], num_kv_heads=2, group=2, head_dim=64, block_size=32,
                           cache_dtype=torch.bfloat16, spare_blocks=2)  # prefill chunks, one after a cached prefix
    pm = pf.meta
    out.append(("prefill_attention_amx", (torch.empty_like(pf.q), pf.q, pf.k_cache, pf.v_cache, pm.block_tables,
                                          pm.seq_lens, pm.query_start_loc, 32, pf.scale, 0, 2), {}))
    d = make_random_batch([1], [9], num_kv_heads=2, group=2, head_dim=16, spare_blocks=2)  # one decode token
    dm = d.meta
    d2 = make_random_batch([1], [9], num_kv_heads=2, group=2, head_dim=16, spare_blocks=2)  # a second layer's pool
    out.append(("decode_layer", (torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g),
                                 [torch.rand(64), torch.rand(64)], [torch.rand(64), torch.rand(64)], 1e-5,
                                 *([_blocks(qt, n, k)] * 2 for qt, n, k in
                                   ((Q4_1, 128, 64), (Q8_0, 64, 64), (Q4_1, 256, 64), (Q4_1, 64, 128))),
                                 [Q4_1, Q8_0, Q4_1, Q4_1] * 2, [128, 64, 256, 64], False,
                                 torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g), 4,
                                 [d.k_cache, d2.k_cache], [d.v_cache, d2.v_cache], dm.slot_mapping, dm.block_tables,
                                 dm.seq_lens, dm.query_start_loc, dm.block_size, d.scale, 4, [], []), {}))
    r = make_random_batch([1, 1, 1], [9, 20, 12], num_kv_heads=2, group=2, head_dim=16, spare_blocks=2)  # 3 decodes
    rm = r.meta
    r2 = make_random_batch([1, 1, 1], [9, 20, 12], num_kv_heads=2, group=2, head_dim=16, spare_blocks=2)

    def packed(n: int, k: int) -> list[torch.Tensor]:  # two layers' packed copies of an [n, k] matrix
        return [torch.ops.pagedllm.amx_pack_bf16(torch.randn(n, k, generator=g).bfloat16()) for _ in range(2)]

    out.append(("bf16_layers", (torch.randn(3, 64, generator=g), None, [torch.rand(64), torch.rand(64)],
                                [torch.rand(64), torch.rand(64)], 1e-5, packed(128, 64), packed(64, 64),
                                packed(128, 64), packed(64, 64), [128, 64, 128, 64], [], 16,
                                torch.randn(3, 8, generator=g),
                                torch.randn(3, 8, generator=g), 4, [r.k_cache, r2.k_cache], [r.v_cache, r2.v_cache],
                                rm.slot_mapping, rm.block_tables, rm.seq_lens, rm.query_start_loc, rm.block_size,
                                r.scale, 4, [], []), {}))
    return out


CASES = _cases() if all(ops.load(k) for k in ops.KERNELS) else []


def test_every_op_has_a_fake_and_is_checked():
    for kernel in ops.KERNELS:
        defined = set(re.findall(r'm\.def\("(\w+)\(', ops.source(kernel).read_text()))
        assert defined == {op for op, _ in ops.fake._FAKES[kernel]}, kernel
    assert {op for k in ops.KERNELS for op, _ in ops.fake._FAKES[k]} == {name for name, _, _ in CASES}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)])
def test_opcheck(case):
    name, args, kwargs = CASES[case]
    torch.library.opcheck(getattr(torch.ops.pagedllm, name).default, args, kwargs)


def test_mutations_are_declared_in_the_schemas():
    """The ops that write into their arguments say so (torch.compile keeps the writes), the others don't."""
    writes = {op: [a.name for a in getattr(torch.ops.pagedllm, op).default._schema.arguments
                   if a.alias_info is not None and a.alias_info.is_write]
              for op, _, _ in CASES}
    assert writes["write_kv"] == writes["attend_qkv"] == ["k_cache", "v_cache", "k_scale", "v_scale"]
    assert writes["attend_qkv_part"] == ["k_cache", "v_cache", "k_scale", "v_scale", "out"]
    assert writes["paged_attention_out"] == writes["prefill_attention_amx"] == ["out"]
    assert writes["add_rms_norm"] == ["h"] and writes["rope"] == ["x"] and writes["lora_bgmv"] == ["y"]
    assert writes["decode_layer"] == writes["bf16_layers"] == ["h", "k_caches", "v_caches", "k_scales", "v_scales"]
    assert writes["quant_gemv_part"] == writes["linear_a8_packed_part"] == ["y"]
    assert writes["instruction_peak"] == ["flops"]
    assert not any(writes[op] for op in writes if op not in ("write_kv", "attend_qkv", "attend_qkv_part",
                                                              "paged_attention_out",
                                                              "prefill_attention_amx",
                                                              "add_rms_norm", "rope", "lora_bgmv", "decode_layer", "bf16_layers",
                                                              "quant_gemv_part", "linear_a8_packed_part",
                                                              "instruction_peak"))


def _layer(h, delta, norm_w, qkv_w, cos, sin, k_cache, v_cache, slots, tables, seq_lens, qsl, num_heads: int,
           num_kv_heads: int, scale: float):
    """A decoder layer's attention half and MLP activation, as the model calls the ops."""
    x = torch.ops.pagedllm.add_rms_norm.default(h, delta, norm_w, 1e-5)
    qkv = torch.ops.pagedllm.linear.default(x, qkv_w, None)
    torch.ops.pagedllm.rope.default(qkv, cos, sin, num_heads + num_kv_heads)
    attn = torch.ops.pagedllm.attend_qkv.default(qkv, num_heads, k_cache, v_cache, slots, tables, seq_lens, qsl, 16,
                                                 scale, 16)
    return torch.ops.pagedllm.silu_mul.default(torch.cat([attn, x], 1))


def test_torch_compile_fullgraph_runs_the_ops_with_the_eager_results():
    a = _attention_args()
    b, m = a["b"], a["b"].meta
    T, H, D = b.q.shape
    Hkv = b.k.shape[1]
    g = torch.Generator().manual_seed(1)
    h, delta = torch.randn(T, H * D, generator=g), torch.randn(T, H * D, generator=g)
    norm_w, qkv_w = torch.randn(H * D, generator=g), torch.randn((H + 2 * Hkv) * D, H * D, generator=g) / 8
    cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)

    def run(fn):
        hh, kc, vc = h.clone(), a["k_cache"].clone(), a["v_cache"].clone()
        y = fn(hh, delta, norm_w, qkv_w, cos, sin, kc, vc, m.slot_mapping, m.block_tables, m.seq_lens,
               m.query_start_loc, H, Hkv, b.scale)
        return y, hh, kc, vc

    want = run(_layer)
    torch._dynamo.reset()
    got = run(torch.compile(_layer, fullgraph=True, backend="inductor"))
    for w, x in zip(want, got):  # the output, and the residual and the pool written in place
        torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want[2], a["k_cache"]), "the step's keys were not written: the test would prove nothing"
