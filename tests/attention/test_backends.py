"""Every attention backend against the reference (gather + SDPA) on random paged batches."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from pagedllm.attention import ALL_BACKENDS, BACKENDS, get_backend
from pagedllm.attention.reference import ReferenceBackend
from pagedllm.bench.attention import make_random_batch, run_backend

HAS_CUDA_TRITON = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

# (query_lens, seq_lens): decodes first, then prefill chunks (a chunk with seq_len > query_len
# has a cached prefix)
CASES = {
    "decode": ([1] * 6, [1, 16, 17, 64, 100, 1000]),
    "prefill": ([37, 64], [37, 64]),
    "mixed": ([1, 1, 1, 20, 33, 5], [5, 64, 1000, 84, 33, 48]),
}


def _on(b, device: str):
    """The random batch with its tensors (and metadata) on ``device``."""
    if device == "cpu":
        return b
    return dataclasses.replace(b, q=b.q.to(device), k=b.k.to(device), v=b.v.to(device), k_cache=b.k_cache.to(device),
                               v_cache=b.v_cache.to(device), meta=b.meta.to(torch.device(device)))


def _check(backend, query_lens, seq_lens, atol, rtol=0.0, device="cpu", **kw):
    b = _on(make_random_batch(query_lens, seq_lens, **kw), device)
    ref = ReferenceBackend()
    kc_r, vc_r = b.k_cache.clone(), b.v_cache.clone()
    expected = ref.forward(b.q, b.k, b.v, kc_r, vc_r, b.meta, b.scale)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    backend.prepare(b.meta)
    got = backend.forward(b.q, b.k, b.v, kc, vc, b.meta, b.scale)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(kc, kc_r) and torch.equal(vc, vc_r), "new K/V not written to the pool"
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)
    # a second layer of the same step reuses what prepare() built
    got2 = backend.forward(b.q, b.k, b.v, kc, vc, b.meta, b.scale)
    torch.testing.assert_close(got2.float(), expected.float(), atol=atol, rtol=rtol)


def test_backends_listing():
    assert BACKENDS[0] == "reference"
    assert set(BACKENDS) <= set(ALL_BACKENDS)
    assert ("triton" in BACKENDS) == HAS_CUDA_TRITON
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")


def test_random_batch_helper_shuffles_tables():
    b = make_random_batch([1, 1], [40, 40], block_size=16)
    tables = b.meta.block_tables[:, :3].flatten().tolist()
    assert len(set(tables)) == 6  # distinct blocks per sequence


# ---- cpu (C++ kernel) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_backend():
    if "cpu" not in BACKENDS:
        pytest.skip("no C++ compiler: the cpu backend cannot be built")
    return get_backend("cpu")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 3, 7])  # 7: the kernel's 3-row blocks plus a leftover row (Qwen2.5-0.5B)
def test_cpu_fp32(cpu_backend, case, block_size, group):
    ql, sl = CASES[case]
    _check(cpu_backend, ql, sl, atol=1e-5, block_size=block_size, group=group, num_kv_heads=2)


@pytest.mark.parametrize("group", [5, 7])  # leftover rows of a GQA group: 2-row and 1-row blocks after 3-row ones
def test_cpu_a_querys_rows_have_the_same_bits_in_a_prefill_tile_and_a_decode(cpu_backend, group):
    """A query head's output must not depend on which row block of the kernel computes it: the last query of a
    prefill chunk (its heads spread over 3-row blocks and a leftover block) against the same query as a decode
    (leftover rows in 1- or 2-row blocks), bit for bit. A scalar loop for leftover rows broke this on AVX2."""
    torch.manual_seed(0)
    hkv, d, bs, n = 2, 64, 16, 150
    tables = torch.randperm(12, dtype=torch.int32)[None, :10]
    kc, vc = torch.randn(hkv, 12 * bs, d), torch.randn(hkv, 12 * bs, d)
    q = torch.randn(2, group * hkv, d)  # the chunk's 2 queries, at positions n - 2 and n - 1
    lens = torch.tensor([n], dtype=torch.int32)
    chunk, step = torch.empty_like(q), torch.empty_like(q[1:])
    attend = torch.ops.pagedllm.paged_attention_out.default
    attend(chunk, q, kc, vc, tables, lens, torch.tensor([0, 2], dtype=torch.int32), bs, 0.125, 0, 1, 16)
    attend(step, q[1:].contiguous(), kc, vc, tables, lens, torch.tensor([0, 1], dtype=torch.int32), bs, 0.125, 0, 1, 16)
    assert torch.equal(chunk[1:], step)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_cpu_bf16_cache(cpu_backend, q_dtype):
    ql, sl = CASES["mixed"]
    _check(cpu_backend, ql, sl, atol=2e-2, rtol=2e-2, dtype=q_dtype, cache_dtype=torch.bfloat16)


def test_cpu_head_dim_not_multiple_of_8_and_unshuffled(cpu_backend):
    _check(cpu_backend, [1, 9], [30, 9], atol=1e-5, head_dim=20, shuffle=False, block_size=4)


@pytest.mark.parametrize("head_dim", [80, 128])  # 80: vector scores, scalar P@V tail; 128: two 32-column strips
def test_cpu_other_head_dims(cpu_backend, head_dim):
    ql, sl = CASES["mixed"]
    _check(cpu_backend, ql, sl, atol=1e-5, head_dim=head_dim, group=3)


def test_cpu_q_tiles(cpu_backend):
    from pagedllm.attention.cpu import CpuBackend

    for tile in (1, 7, 64):
        _check(CpuBackend(q_tile=tile), [1, 50], [300, 50], atol=1e-5)
    _check(CpuBackend(sdpa_prefill_min_len=16), [1, 8, 50], [300, 20, 50], atol=1e-5)
    # a short chunk after the long ones: kernel, SDPA, kernel again in one step
    ql, sl = CASES["mixed"]
    backend = CpuBackend(sdpa_prefill_min_len=16)
    assert backend._runs(make_random_batch(ql, sl).meta, "query") == [(0, 3, False), (3, 5, True), (5, 6, False)]
    _check(backend, ql, sl, atol=1e-5)


def _flash_calls(fn) -> int:
    """How many times ``fn`` ran torch's fused CPU flash SDPA kernel."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_dot_product_flash_attention_for_cpu")


def test_cpu_long_prefill_chunks_over_a_bf16_pool_run_flash_sdpa_in_bf16(cpu_backend):
    """Over a bf16 pool long prefill chunks (fresh, and after a cached prefix) go through torch's flash SDPA in
    bf16, decodes and short chunks through the kernel, all in one step; the result is the reference's to bf16
    rounding of the queries. An fp32 pool (the exact path) keeps every chunk in the kernel."""
    from pagedllm.attention import cpu

    backend = cpu.CpuBackend()
    backend.bf16_sdpa = True  # the rule, on any CPU (native bf16 only decides whether it is on by default)
    ql, sl = [1, 1, 40, 300, 256], [700, 30, 40, 300, 512]  # decodes, a short chunk, a fresh prompt, a later chunk
    b = make_random_batch(ql, sl, block_size=16, cache_dtype=torch.bfloat16)
    assert backend._runs(b.meta, backend._sdpa_mode(b.k_cache, b.meta)) == [(0, 3, False), (3, 5, True)]
    _check(backend, ql, sl, atol=2e-2, cache_dtype=torch.bfloat16)
    assert _flash_calls(lambda: run_backend(backend, b)) == 2
    # a step without a long chunk: the one-call fused path, no SDPA
    d = make_random_batch([1, 1, 12], [64, 900, 12], block_size=16, cache_dtype=torch.bfloat16)
    qkv = torch.cat([d.q.flatten(1), d.k.flatten(1), d.v.flatten(1)], 1)
    assert _flash_calls(lambda: backend.forward_qkv(qkv, 9, d.k_cache.clone(), d.v_cache.clone(), d.meta,
                                                    d.scale)) == 0


def test_cpu_amx_mode_takes_every_chunk_of_min_len_queries(cpu_backend):
    """The AMX tile kernel has no gathers to amortize: chunks of BF16_SDPA_MIN_LEN queries go to it whatever their
    (query, key) pairs, decodes and shorter chunks stay on the paged kernel (the rule, on any CPU)."""
    from pagedllm.attention import cpu

    backend = cpu.CpuBackend()
    ql, sl = [1, cpu.BF16_SDPA_MIN_LEN - 1, cpu.BF16_SDPA_MIN_LEN, 40, 300], [700, 40, 32, 300, 300]
    b = make_random_batch(ql, sl, block_size=32, cache_dtype=torch.bfloat16)
    assert backend._runs(b.meta, "amx") == [(0, 2, False), (2, 5, True)]
    assert backend._runs(b.meta, "bf16") == [(0, 4, False), (4, 5, True)]
    f = make_random_batch(ql, sl, block_size=16)
    assert _flash_calls(lambda: run_backend(backend, f)) == 0
    _check(backend, ql, sl, atol=1e-5)


def test_cpu_sdpa_prefill_takes_torch_flash_kernel(cpu_backend):
    """The SDPA path hands torch 4-d inputs: 3-d ones fall back to its unfused math path, ~10x slower."""
    from pagedllm.attention.cpu import CpuBackend

    b = make_random_batch([1, 64, 64], [90, 64, 200], block_size=16)
    assert _flash_calls(lambda: run_backend(CpuBackend(sdpa_prefill_min_len=16), b)) == 2


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cpu_write_kv_takes_qkv_views_and_checks_slots(cpu_backend, cache_dtype):
    """The kernel's K/V scatter reads the k/v heads straight out of a fused qkv output and rounds like
    ``Tensor.to``; a slot outside the pool is an error, not a stray write."""
    from pagedllm.attention.metadata import write_kv

    qkv = torch.randn(5, (4 + 2 + 2) * 16)
    k, v = qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].view(5, 2, 16)
    slots = torch.tensor([7, 0, 31, 12, 3])
    want = [torch.zeros(2, 32, 16, dtype=cache_dtype) for _ in range(2)]
    write_kv(k, v, *want, slots)
    got = [torch.zeros(2, 32, 16, dtype=cache_dtype) for _ in range(2)]
    torch.ops.pagedllm.write_kv(k, v, *got, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.pagedllm.write_kv(k, v, *got, torch.tensor([7, 0, 32, 12, 3]))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cpu_forward_qkv_equals_forward_on_views(cpu_backend, case, cache_dtype):
    """The one-call path from a fused qkv output writes the same pool rows and returns the same attention
    as ``forward`` on the q/k/v views (bit for bit: the same kernel), shaped [T, H * D]."""
    b = make_random_batch(*CASES[case], cache_dtype=cache_dtype, seed=5)
    T, H, D = b.q.shape
    qkv = torch.cat([b.q.reshape(T, -1), b.k.reshape(T, -1), b.v.reshape(T, -1)], 1)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    want = cpu_backend.forward(b.q, b.k, b.v, kc, vc, b.meta, b.scale).reshape(T, H * D)
    kc2, vc2 = b.k_cache.clone(), b.v_cache.clone()
    got = cpu_backend.forward_qkv(qkv, H, kc2, vc2, b.meta, b.scale)
    assert torch.equal(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.pagedllm.attend_qkv(qkv, H + 1, kc2, vc2, b.meta.slot_mapping, b.meta.block_tables,
                                     b.meta.seq_lens, b.meta.query_start_loc, b.meta.block_size, b.scale, 16)



@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cpu_attend_qkv_parts_together_equal_the_whole_call(cpu_backend, case, parts, cache_dtype):
    """decode_layer's team runs attend_qkv by kv head (``attend_qkv_part``, a part a thread): the parts together
    write the same pool rows and the same attention as one call, bit for bit, in any order (the cases reaching
    1,000 keys split a head's keys into parts inside one part's call)."""
    b = make_random_batch(*CASES[case], cache_dtype=cache_dtype, seed=6)
    T, H, D = b.q.shape
    qkv = torch.cat([b.q.reshape(T, -1), b.k.reshape(T, -1), b.v.reshape(T, -1)], 1)
    m = b.meta
    args = (m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc, m.block_size, b.scale, 16)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    want = torch.ops.pagedllm.attend_qkv(qkv, H, kc, vc, *args)
    kc2, vc2, got = b.k_cache.clone(), b.v_cache.clone(), torch.full((T, H * D), float("nan"))
    for p in reversed(range(parts)):
        torch.ops.pagedllm.attend_qkv_part(qkv, H, kc2, vc2, *args, None, None, got, p, parts)
    assert torch.equal(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
    with pytest.raises(RuntimeError, match="part must be in"):
        torch.ops.pagedllm.attend_qkv_part(qkv, H, kc2, vc2, *args, None, None, got, parts, parts)

def test_cpu_shared_blocks(cpu_backend):
    """Two sequences reading the same physical prefix blocks (prefix cache / fork)."""
    b = make_random_batch([1, 1], [40, 40], block_size=16)
    t = b.meta.block_tables.clone()
    t[1, :2] = t[0, :2]
    from pagedllm.attention.metadata import AttentionMetadata

    meta = AttentionMetadata.build([1, 1], [40, 40], t.tolist(), 16)
    ref = ReferenceBackend().forward(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), meta, b.scale)
    got = cpu_backend.forward(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), meta, b.scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


# ---- flex (compiled FlexAttention) --------------------------------------------------------
# Each (block size, GQA group, dtype, Q block size) is one inductor compile (tens of seconds on
# a cold cache), so flex runs a smaller matrix; the compiled function is shared process-wide.


@pytest.fixture(scope="module")
def flex_backend():
    return get_backend("flex")


@pytest.mark.parametrize("case", list(CASES))
def test_flex_fp32(flex_backend, case, device):
    ql, sl = CASES[case]
    _check(flex_backend, ql, sl, atol=1e-5, block_size=16, group=3, device=device)


def test_flex_varying_batches_and_pool(flex_backend):
    for ql, sl in [([1] * 3, [5, 16, 200]), ([1] * 9 + [40], [3] * 9 + [90]), ([70], [70])]:
        _check(flex_backend, ql, sl, atol=1e-5, block_size=16, group=3)


@pytest.mark.parametrize("block_size", [1, 64])
def test_flex_block_sizes(flex_backend, block_size):
    ql, sl = CASES["mixed"]
    _check(flex_backend, ql, sl, atol=1e-5, block_size=block_size, group=3)


def test_flex_shared_blocks(flex_backend):
    from pagedllm.attention.metadata import AttentionMetadata

    b = make_random_batch([1, 1], [40, 40], block_size=16)
    t = b.meta.block_tables.clone()
    t[1, :2] = t[0, :2]
    meta = AttentionMetadata.build([1, 1], [40, 40], t.tolist(), 16)
    ref = ReferenceBackend().forward(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), meta, b.scale)
    flex_backend.prepare(meta)
    got = flex_backend.forward(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), meta, b.scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


# ---- triton (CUDA) ------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="triton backend needs a CUDA GPU and the triton package")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 3])
def test_triton(case, block_size, group):
    ql, sl = CASES[case]
    backend = get_backend("triton")
    b = make_random_batch(ql, sl, block_size=block_size, group=group, num_kv_heads=2)
    ref = ReferenceBackend().forward(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.meta, b.scale)
    g = b.to("cuda")
    backend.prepare(g.meta)
    got = backend.forward(g.q, g.k, g.v, g.k_cache, g.v_cache, g.meta, g.scale)
    torch.testing.assert_close(got.cpu(), ref, atol=2e-5, rtol=0)
