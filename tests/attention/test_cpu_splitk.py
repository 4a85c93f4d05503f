"""The C++ kernel splits decodes over long contexts into parts (split-K) that it combines itself: the outputs
match the reference on every cache dtype, and a sequence's output is bit-identical whatever else is in the batch
and however many threads run (the parts depend on the sequence alone)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import BACKENDS, get_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import ReferenceBackend
from tests.attention.test_kv_quant_backends import clone, make_step, run

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler")

# decodes over 2 parts (513: the second holds one key), 4 parts (3000) and 3 parts (1400); an 8-query chunk at
# 1028 (3 parts: its first 4 queries see none of the last part's keys); a short prefill chunk (not split)
STEPS = ([1, 1, 1, 8, 20], [513, 3000, 1400, 1028, 40])


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_long_decodes_split_over_the_context_match_the_reference(kv_dtype):
    cache, q, k, v, meta = make_step(kv_dtype, *STEPS)
    expected = run(ReferenceBackend(), clone(cache), q, k, v, meta)
    got = run(get_backend("cpu"), cache, q, k, v, meta)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_bf16_queries_over_a_bf16_pool_match_the_reference():
    """A bf16 model's decode: its queries hold bf16 values exactly, so the kernel multiplies them with the keys in
    bf16 pairs (VDPBF16PS where the CPU has it: exact products, the sum in another order)."""
    cache, q, k, v, meta = make_step("bfloat16", *STEPS)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    expected = run(ReferenceBackend(), clone(cache), q.float(), k.float(), v.float(), meta)
    got = run(get_backend("cpu"), cache, q, k, v, meta)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=8e-3)  # the output's bf16 rounding


@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "bfloat16"])
def test_a_sequence_output_does_not_change_with_its_batch_or_the_thread_count(kv_dtype):
    cache, q, k, v, meta = make_step(kv_dtype, *STEPS)
    if kv_dtype == "bfloat16":  # a bf16 model's step: bf16 queries, the pair products
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    backend = get_backend("cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = run(backend, clone(cache), q, k, v, meta)
        torch.set_num_threads(1)
        one_thread = run(backend, clone(cache), q, k, v, meta)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one_thread)
    i = 1  # the 3000-token decode, alone in its batch
    table = meta.block_tables[i, : -(-STEPS[1][i] // meta.block_size)].tolist()
    alone = AttentionMetadata.build([1], [STEPS[1][i]], [table], meta.block_size)
    t = slice(i, i + 1)
    got = run(backend, clone(cache), q[t], k[t], v[t], alone)
    assert torch.equal(got, batch[t])
