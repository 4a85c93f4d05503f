"""``RankBlocks``: the KV tiers' view of a pool split over ranks. A gather concatenates every rank's kv heads
in rank order and a scatter hands each rank its own heads back, through ``BlockCopy`` messages, as the
``mp`` and tensor-parallel executors carry them (here: each rank's pool in this process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.executor.tier_copies import RankBlocks
from pagedllm.kv import KVCache
from pagedllm.worker.tier_copy import BlockCopy


class FakeRanks:
    """An executor's ``copy_blocks`` over in-process pools, one per rank."""

    def __init__(self, pools: list[KVCache]) -> None:
        self.pools = pools
        self.spec = SimpleNamespace(num_blocks=pools[0].num_blocks)
        self.messages = 0

    def copy_blocks(self, msgs: list[BlockCopy]) -> list:
        assert len(msgs) == len(self.pools)  # one message per rank, always
        self.messages += 1
        return [m.apply(p) for m, p in zip(msgs, self.pools)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_gather_concatenates_ranks_and_scatter_splits_them(dtype):
    pools = [KVCache(2, 1, 4, 6, 4, dtype=dtype) for _ in range(2)]
    for r, p in enumerate(pools):
        p.data.copy_(torch.randn(p.data.shape).mul(20).to(dtype) if dtype != torch.int8 else
                     torch.randint(-100, 100, p.data.shape, dtype=dtype))
        if p.scales is not None:
            p.scales.copy_(torch.rand(p.scales.shape) + r)
    ex = FakeRanks(pools)
    blocks = RankBlocks(ex, 2)
    assert (blocks.num_kv_heads, blocks.num_blocks, blocks.dtype) == (2, 6, dtype)
    got = blocks.gather_blocks([1, 3])
    for r, p in enumerate(pools):
        own = p.export_blocks([1, 3])
        for k in own:
            assert torch.equal(got[k][:, :, r:r + 1], own[k])
    blocks.import_blocks([4, 5], got)  # each rank gets its own heads back, into other blocks
    for p in pools:
        assert all(torch.equal(p.export_blocks([4, 5])[k], p.export_blocks([1, 3])[k]) for k in got)
    assert ex.messages == 3  # layout, gather, scatter: one round each, whatever the number of blocks


def test_bad_input_names_the_field():
    pools = [KVCache(2, 1, 4, 6, 4) for _ in range(2)]
    blocks = RankBlocks(FakeRanks(pools), 2)
    with pytest.raises(ValueError, match="kv"):
        blocks.import_blocks([0], {"kv": torch.zeros(2, 2, 1, 1, 4, 4)})  # one rank's heads, not both
    with pytest.raises(ValueError, match="op"):
        BlockCopy("move").apply(pools[0])
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        RankBlocks(FakeRanks([pools[0], KVCache(2, 2, 4, 6, 4)]), 2)  # ranks whose pools differ
