"""The shard plan (which heads, features and vocab rows rank r of N keeps) and slicing GGUF block matrices;
no processes here (test_tp_generate.py runs the shards)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.models.sharding import ShardPlan, kv_heads_per_rank, take_cols, take_rows
from pagedllm.models.config import ModelConfig
from pagedllm.models.quant import QuantizedWeight, kernel_available

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="the AVX2 C++ kernel could not be built here")


def config(heads: int, kv_heads: int, inter: int = 96, vocab: int = 10) -> ModelConfig:
    return ModelConfig("Qwen2ForCausalLM", vocab, 16 * heads, inter, 1, heads, kv_heads, 16)


@pytest.mark.parametrize("heads, kv_heads, world, want_kv", [
    (4, 2, 2, [[0], [1]]),  # sharded: one KV head each
    (4, 2, 4, [[0], [0], [1], [1]]),  # replicated: each KV head on the two ranks whose q heads use it
    (9, 3, 3, [[0], [1], [2]]),  # SmolLM2
    (14, 2, 2, [[0], [1]]),  # Qwen2.5-0.5B
    (8, 4, 2, [[0, 1], [2, 3]]),
])
def test_each_rank_keeps_its_q_heads_and_the_kv_heads_they_attend(heads, kv_heads, world, want_kv):
    plans = [ShardPlan.of(config(heads, kv_heads), r, world) for r in range(world)]
    assert [list(p.kv_heads) for p in plans] == want_kv
    assert all(len(p.kv_heads) == kv_heads_per_rank(kv_heads, world) for p in plans)
    group = heads // kv_heads  # q head h attends KV head h // group
    for p in plans:
        assert sorted({h // group for h in p.q_heads}) == list(p.kv_heads)
    assert [h for p in plans for h in p.q_heads] == list(range(heads))
    assert [i for p in plans for i in p.inter] == list(range(96))


def test_vocab_rows_cover_the_vocab_once():
    plans = [ShardPlan.of(config(6, 3), r, 3) for r in range(3)]
    assert [(p.vocab.start, p.vocab.stop) for p in plans] == [(0, 4), (4, 8), (8, 10)]  # ceil(10 / 3) = 4 each


@pytest.mark.parametrize("cfg, world, field", [
    (config(4, 2), 3, "num_heads"),
    (config(6, 2), 3, "num_kv_heads"),
    (config(4, 4, inter=98), 4, "intermediate_size"),
    (config(4, 2), 0, "rank"),
])
def test_unshardable_configs_name_the_field(cfg, world, field):
    with pytest.raises(ValueError, match=field):
        ShardPlan.of(cfg, 0, world)


def blocks(qtype: gguf.GGMLQuantizationType, n: int, k: int) -> QuantizedWeight:
    w = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32)
    return QuantizedWeight(torch.from_numpy(gguf.quants.quantize(w, qtype)), int(qtype), (n, k))


@needs_kernel
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0], ids=str)
def test_block_matrices_shard_in_blocks_or_fall_back_to_dense(qtype):
    qw = blocks(qtype, 6, 128)
    dense = qw.dequantize()
    rows = torch.tensor([4, 0, 5])
    by_rows = take_rows(qw, rows)
    assert isinstance(by_rows, QuantizedWeight) and torch.equal(by_rows.dequantize(), dense[rows])
    aligned = take_cols(qw, range(32, 96))  # on block boundaries: still blocks, same values
    assert isinstance(aligned, QuantizedWeight) and torch.equal(aligned.dequantize(), dense[:, 32:96])
    unaligned = take_cols(qw, range(16, 80))  # inside blocks: dense fp32 of the same values
    assert not isinstance(unaligned, QuantizedWeight) and torch.equal(unaligned, dense[:, 16:80])
    with pytest.raises(ValueError, match="32-column block boundaries"):
        qw.take_cols(16, 80)
