"""The Triton paged kernels (decode, split-K and varlen prefill over scattered blocks) on float pools against the
reference backend (quantized pools: test_kv_quant_backends.py); on a machine without a GPU they run in Triton's
interpreter (TRITON_INTERPRET=1, set in tests/conftest.py), else on the GPU. Also the whole engine with the triton backend, token
for token the reference's, on a float and an int8 KV cache."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention import get_backend
from pagedllm.attention.reference import ReferenceBackend
from pagedllm.bench.attention import make_random_batch
from tests.conftest import TRITON_DEVICE

pytest.importorskip("triton", reason="the test set-up installs triton")  # never skipped in CI: setup installs it

CASES = {
    "decode": ([1] * 4, [1, 16, 17, 70]),
    "prefill": ([37, 20], [37, 52]),  # the second chunk has a 32-token cached prefix
    "mixed": ([1, 1, 20, 9, 5], [5, 64, 84, 9, 48]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [*CASES, "long-decode-splitk"])
def test_triton_matches_reference(case, dtype):
    query_lens, seq_lens = CASES.get(case, ([1, 1, 3], [700, 40, 3]))
    b = make_random_batch(query_lens, seq_lens, head_dim=32, dtype=dtype)
    kc_r, vc_r = b.k_cache.clone(), b.v_cache.clone()
    want = ReferenceBackend().forward(b.q, b.k, b.v, kc_r, vc_r, b.meta, b.scale)
    g = b.to(TRITON_DEVICE)
    kc, vc = g.k_cache.clone(), g.v_cache.clone()
    backend = get_backend("triton", splitk_min_len=512)  # split-K for the 700-token decode (3 splits)
    backend.prepare(g.meta)
    got = backend.forward(g.q, g.k, g.v, kc, vc, g.meta, g.scale).cpu()
    assert torch.equal(kc.cpu(), kc_r) and torch.equal(vc.cpu(), vc_r), "new K/V not written to the pool"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_splitk_caps_its_splits_and_sizes_its_grid_from_the_bound():
    """Split-K sized by an upper bound on the lengths (what a decode graph passes: max_model_len) computes the
    same attention; past MAX_SPLITS splits the split length doubles (bounded partials, few kernel variants)."""
    from pagedllm.attention.triton_splitk import MAX_SPLITS, split_len, splitk_decode

    assert split_len(1000) == 256 and split_len(MAX_SPLITS * 256) == 256 and split_len(MAX_SPLITS * 256 + 1) == 512
    b = make_random_batch([1, 1], [100, 45], num_kv_heads=1, group=2, head_dim=16)
    want = ReferenceBackend().forward(b.q, b.k, b.v, b.k_cache.clone(), b.v_cache.clone(), b.meta, b.scale)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    ReferenceBackend().forward(b.q, b.k, b.v, kc, vc, b.meta, b.scale)  # the step's K/V in the pool
    d = TRITON_DEVICE
    got = torch.empty_like(b.q, device=d)
    bound = 4 * MAX_SPLITS  # split 2 would need 2 * MAX_SPLITS splits: doubled to 4
    splitk_decode(b.q.to(d), kc.to(d), vc.to(d), got, b.meta.block_tables.to(d), b.meta.seq_lens.to(d), 2, bound,
                  b.meta.block_size, b.scale, split=2)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_with_triton_equals_reference(tiny_model_dir, kv_cache_dtype):
    """Greedy tokens identical to the reference backend's, on a float pool and on an int8 one (both backends
    reading the same quantized codes and scales)."""
    prompts = [[5, 17, 300, 42] * 9, [7, 8, 9]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("reference", "triton"):
        llm = LLM(tiny_model_dir, attention_backend=backend, kv_cache_memory=8 << 20, max_num_batched_tokens=16,
                  kv_cache_dtype=kv_cache_dtype, check_integrity=True)  # a 16-token budget: chunked prefill, mixed
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs["triton"] == outs["reference"]


@pytest.mark.parametrize("kv", ["float", "bf16", "int8"])
@pytest.mark.parametrize("case", list(CASES))
def test_rope_and_kv_write_in_one_launch_equal_rope_then_forward(case, kv):
    """``forward_qkv_rope`` (rotary on the q/k heads and the K/V write fused into one launch) writes the pool
    rows and returns the attention that torch's rotary followed by ``forward`` on the q/k/v views does; an int8
    pool takes the rotary launch and the quantizing write."""
    from pagedllm.kv.kv_cache import KVCache
    from pagedllm.models.layers import apply_rope_heads_, rope_cos_sin

    cache_dtype = {"float": None, "bf16": torch.bfloat16, "int8": None}[kv]
    b = make_random_batch(*CASES[case], head_dim=32, cache_dtype=cache_dtype, seed=7).to(TRITON_DEVICE)
    T, H, D = b.q.shape
    Hkv = b.k.shape[1]
    qkv = torch.cat([b.q.reshape(T, -1), b.k.reshape(T, -1), b.v.reshape(T, -1)], 1)
    cos, sin = (t.to(TRITON_DEVICE) for t in rope_cos_sin(D, 10000.0, None, 2048, torch.float32))
    cos, sin = cos.index_select(0, b.meta.positions), sin.index_select(0, b.meta.positions)
    if kv == "int8":
        pools = [KVCache(1, Hkv, D, b.k_cache.shape[1] // b.meta.block_size, b.meta.block_size, dtype=torch.int8,
                         device=TRITON_DEVICE) for _ in range(2)]
        caches = [pool.layer(0) for pool in pools]
    else:
        caches = [(b.k_cache.clone(), b.v_cache.clone()) for _ in range(2)]
    backend = get_backend("triton")
    rotated = qkv.clone()
    apply_rope_heads_(rotated, H + Hkv, cos, sin)
    views = [rotated[:, a * D:c * D].view(T, c - a, D) for a, c in ((0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv))]
    want = backend.forward(*views, *caches[0], b.meta, b.scale).reshape(T, H * D)
    got = backend.forward_qkv_rope(qkv.clone(), H, cos, sin, *caches[1], b.meta, b.scale)
    for w, g in zip(caches[0], caches[1]):
        if kv == "int8":
            assert torch.equal(g.data, w.data) and torch.equal(g.scale, w.scale) and g.data.any()
        else:
            assert torch.equal(g, w)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
