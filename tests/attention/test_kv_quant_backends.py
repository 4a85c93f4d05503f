"""Every backend over int8 / fp8 pools (scattered blocks, GQA, decodes + prefill chunks) against the reference
on the same quantized pool (which dequantizes what it gathers), and the writes of every path bit-identical."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import BACKENDS, get_backend
from pagedllm.attention.metadata import AttentionMetadata, write_kv
from pagedllm.attention.reference import ReferenceBackend
from pagedllm.kv.kv_cache import KVCache
from pagedllm.kv.kv_quant import raw
from tests.conftest import TRITON_DEVICE

QUANT = ["int8", "fp8_e4m3", "fp8_e5m2"]
# decodes first, then prefill chunks (one with a cached prefix)
MIXED = ([1, 1, 1, 20, 33, 5], [5, 64, 300, 84, 33, 48])


def make_step(kv_dtype: str, query_lens, seq_lens, block_size=16, num_kv_heads=2, group=3, head_dim=64, seed=0):
    """A quantized pool whose cached context was written through ``write_kv`` (so it holds real codes and
    scales), shuffled block tables, and the step's new q/k/v."""
    g = torch.Generator().manual_seed(seed)
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(need) + 5
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    cache = KVCache(1, num_kv_heads, head_dim, num_blocks, block_size, dtype=kv_dtype)
    k_cache, v_cache = cache.layer(0)
    cached = [s - q for q, s in zip(query_lens, seq_lens)]
    if any(cached):  # the context before this step, written as one prefill per sequence
        pre = AttentionMetadata.build([c for c in cached if c], [c for c in cached if c],
                                      [t for t, c in zip(tables, cached) if c], block_size)
        n = pre.num_tokens
        write_kv(torch.randn(n, num_kv_heads, head_dim, generator=g) * 2,
                 torch.randn(n, num_kv_heads, head_dim, generator=g), k_cache, v_cache, pre.slot_mapping)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    T = meta.num_tokens
    q = torch.randn(T, num_kv_heads * group, head_dim, generator=g)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g) * 2
    v = torch.randn(T, num_kv_heads, head_dim, generator=g)
    return cache, q, k, v, meta


def run(backend, cache, q, k, v, meta):
    k_cache, v_cache = cache.layer(0)
    backend.prepare(meta)
    return backend.forward(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5)


def same_pool(a: KVCache, b: KVCache) -> bool:
    """Rows and scales of every block bit-identical."""
    blocks = list(range(a.num_blocks))
    ea, eb = a.export_blocks(blocks), b.export_blocks(blocks)
    return ea.keys() == eb.keys() and all(torch.equal(raw(ea[k]).cpu(), raw(eb[k]).cpu()) for k in ea)


def clone(cache: KVCache, device: str = "cpu") -> KVCache:
    c = KVCache(cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.num_blocks, cache.block_size,
                dtype=cache.dtype, device=device)
    c.import_blocks(list(range(cache.num_blocks)), cache.export_blocks(list(range(cache.num_blocks))))
    return c


def check_backend(name: str, kv_dtype: str, steps=MIXED, backend_kw: dict | None = None, **kw) -> None:
    cache, q, k, v, meta = make_step(kv_dtype, *steps, **kw)
    ref_cache = clone(cache)
    expected = run(ReferenceBackend(), ref_cache, q, k, v, meta)
    dev = TRITON_DEVICE if name == "triton" else "cpu"
    cache = clone(cache, dev)
    got = run(get_backend(name, **(backend_kw or {})), cache, q.to(dev), k.to(dev), v.to(dev), meta.to(torch.device(dev)))
    assert same_pool(cache, ref_cache), "the backend's write differs from the Python write path"
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler")
@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("group, block_size", [(1, 16), (3, 16), (7, 4)])
def test_cpu_on_quantized_pool(kv_dtype, group, block_size):
    check_backend("cpu", kv_dtype, group=group, block_size=block_size)


TRITON_CASES = {  # (query_lens, seq_lens), split-K from this context length
    "prefill": (([37, 20], [37, 52]), 1024),  # the second chunk has a 32-token cached prefix
    "mixed": (MIXED, 1024),  # decodes through the single-pass kernel, then prefill chunks
    "splitk": (MIXED, 64),  # decodes through split-K (the 300-token one in 2 splits), then prefill chunks
}


@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_on_quantized_pool(case, kv_dtype, monkeypatch):
    """Triton's decode, split-K and prefill kernels dequantize the scattered blocks as they load them (GQA
    group 3); on a machine without a GPU they run in triton's interpreter (tests/conftest.py)."""
    pytest.importorskip("triton", reason="the test set-up installs triton")  # never skipped in CI
    import pagedllm.attention.triton_decode as td

    splits = []
    real = td.splitk_decode
    monkeypatch.setattr(td, "splitk_decode", lambda *a, **kw: splits.append(a[-3]) or real(*a, **kw))
    steps, splitk_min_len = TRITON_CASES[case]
    check_backend("triton", kv_dtype, steps, {"splitk_min_len": splitk_min_len})
    assert splits == ([300] if case == "splitk" else [])  # split-K ran over the longest decode's context


def test_triton_on_int8_pool_small_blocks_no_gqa():
    pytest.importorskip("triton", reason="the test set-up installs triton")
    check_backend("triton", "int8", group=1, block_size=4)


@pytest.mark.parametrize("kv_dtype, tol", [("int8", 0.01), ("fp8_e4m3", 0.03), ("fp8_e5m2", 0.06)])
def test_quantized_attention_is_close_to_fp32(kv_dtype, tol):
    """The same writes into an fp32 pool and a quantized one attend alike (mean error within the format's:
    int8 keeps 7 bits, e4m3 3 mantissa bits, e5m2 2)."""
    exact = run(ReferenceBackend(), *make_step("float32", *MIXED))
    got = run(ReferenceBackend(), *make_step(kv_dtype, *MIXED))
    err = float((got - exact).abs().mean())
    assert 0 < err < tol


@pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler")
@pytest.mark.parametrize("kv_dtype", QUANT)
def test_cpu_forward_qkv_quantized(kv_dtype):
    """The one-call path writes the same codes and scales and returns the same attention as forward."""
    cache, q, k, v, meta = make_step(kv_dtype, *MIXED, group=1, num_kv_heads=3)
    other = clone(cache)
    backend = get_backend("cpu")
    want = run(backend, cache, q, k, v, meta)
    qkv = torch.cat([q, k, v], 1).reshape(q.shape[0], -1)
    got = backend.forward_qkv(qkv, q.shape[1], *other.layer(0), meta, q.shape[-1] ** -0.5)
    assert torch.equal(got, want.reshape(got.shape))
    assert same_pool(cache, other)


def test_int8_block_scale_grows_and_rerounds_earlier_rows():
    """A louder token landing in a partly filled block raises its scale; the earlier rows stay close."""
    cache = KVCache(1, 1, 8, 2, 4, dtype="int8")
    kc, vc = cache.layer(0)
    x = torch.randn(3, 1, 8)
    write_kv(x[:2], x[:2], kc, vc, torch.tensor([4, 5]))
    s_before = float(cache.scales[0, 0, 0, 1])
    write_kv(x[2:] * 10, x[2:], kc, vc, torch.tensor([6]))
    assert float(cache.scales[0, 0, 0, 1]) > s_before
    got = kc.rows(torch.tensor([4, 5, 6]), torch.float32)[0]
    want = torch.cat([x[:2, 0], x[2:, 0] * 10])
    assert (got - want).abs().max() <= float(cache.scales[0, 0, 0, 1]) * 1.01
    write_kv(x[:1], x[:1], kc, vc, torch.tensor([4]))  # offset 0: the block starts afresh
    assert float(cache.scales[0, 0, 0, 1]) == pytest.approx(float(x[0].abs().max()) / 127)


def test_flex_refuses_quantized_pools_by_name():
    cache, q, k, v, meta = make_step("int8", [1], [20])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        run(get_backend("flex"), cache, q, k, v, meta)
