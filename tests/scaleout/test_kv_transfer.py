"""A prefix's KV blocks moved between two engine cores (what replicas do over Ray), in one process."""

from __future__ import annotations

import pytest
import torch

from pagedllm.scaleout.kv_transfer import export_prefix, import_prefix
from tests.scaleout.conftest import prompts, run_core


def test_imported_prefix_is_hit_and_generates_the_same(cores):
    a, b = cores
    p, q = prompts(2, prefix_len=40)
    expected = run_core(a, "a0", q)  # a computes q alone: the reference
    assert run_core(a, "a1", p)
    blocks = export_prefix(a, q)
    assert blocks is not None and len(blocks.hashes) == 2  # 40 shared tokens + tail: 2 full blocks of 16
    assert blocks.data["kv"].shape[3] == 2 and blocks.num_bytes == blocks.data["kv"].numel() * 4
    before = b.kv.stats()["hit_tokens"]
    stats = import_prefix(b, blocks)
    assert stats.blocks == 2 and b.kv.stats()["cached_free"] == 2 and b.kv.stats()["used"] == 0
    assert run_core(b, "b0", q) == expected
    assert b.kv.stats()["hit_tokens"] - before == 32
    assert import_prefix(b, blocks).blocks == 0  # already cached: nothing written twice
    src = a.kv.match_prefix(q, record=False).blocks
    dst = b.kv.match_prefix(q, record=False).blocks
    ka, kb = a.executor.worker.kv_cache, b.executor.worker.kv_cache
    assert torch.equal(ka.export_blocks(src)["kv"], kb.export_blocks(dst)["kv"])
    for c in cores:
        c.check_integrity()
        assert c.kv.stats()["used"] == 0


def test_import_refuses_other_hashes_and_shapes(cores):
    a, b = cores
    q = prompts(1, prefix_len=40, seed=3)[0]
    run_core(a, "s0", q, salt="tenant-a")
    blocks = export_prefix(a, q, "tenant-a")
    blocks.cache_salt = "tenant-b"  # another tenant's hashes: the chain does not match
    with pytest.raises(ValueError, match="hashes"):
        import_prefix(b, blocks)
    blocks.cache_salt = "tenant-a"
    blocks.data = {"kv": blocks.data["kv"][:1]}
    with pytest.raises(ValueError, match="kv"):
        import_prefix(b, blocks)
    assert b.kv.match_prefix(q, "tenant-a", record=False).num_tokens == 0  # nothing half-imported
    b.check_integrity()
    assert export_prefix(a, [1, 2, 3]) is None


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_blocks_move_with_their_scales(tiny_args, kv_dtype):
    import dataclasses

    from pagedllm.core.engine_core import EngineCore

    args = dataclasses.replace(tiny_args, kv_cache_dtype=kv_dtype)
    a, b = EngineCore(args), EngineCore(args)
    try:
        q, p = prompts(2, prefix_len=40, seed=5)
        expected = run_core(a, "q", q)
        run_core(b, "p", p[:17])  # b already holds the first block: only the second is written
        blocks = export_prefix(a, q)
        assert "scales" in blocks.data
        assert import_prefix(b, blocks).blocks == 1
        assert run_core(b, "q", q) == expected
        for c in (a, b):
            c.check_integrity()
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_peer_fetch_finds_blocks_in_the_peers_tiers(tiny_args, tmp_path, monkeypatch, tier):
    """The exporting peer's pool lost the prefix; its L2 (host RAM) or L3 (disk) tier still holds it, so the
    export promotes it and the importing core hits it and generates the same tokens."""
    import dataclasses

    from pagedllm.core.engine_core import EngineCore
    from pagedllm.kv.prefix_cache import HASH_KEY_ENV

    monkeypatch.setenv(HASH_KEY_ENV, "replicas-share-it")  # as scale-out sets it: the disk tier keeps the process key

    tiers = {"kv_offload_memory": 4 << 20} if tier == "host" else {"kv_disk_path": str(tmp_path)}
    a = EngineCore(dataclasses.replace(tiny_args, num_blocks=8, kv_eviction="lru", **tiers))  # q's blocks all go
    b = EngineCore(dataclasses.replace(tiny_args, num_blocks=16))
    try:
        q = prompts(1, prefix_len=40, seed=11)[0]
        expected = run_core(a, "q", q)
        for i, other in enumerate(prompts(4, prefix_len=60, seed=12)):
            run_core(a, f"o{i}", other)  # fills a's pool of 8 blocks: q's blocks are demoted
        assert a.kv.match_prefix(q, record=False).num_tokens == 0
        blocks = export_prefix(a, q)
        assert blocks is not None and len(blocks.hashes) == 2
        assert a.kv.stats()[f"{tier}_tier_promoted_blocks"] >= 2
        assert import_prefix(b, blocks).blocks == 2
        assert run_core(b, "q", q) == expected
        assert b.kv.stats()["hit_tokens"] == 32
        for c in (a, b):
            c.check_integrity()
            assert c.kv.stats()["used"] == 0
    finally:
        a.shutdown()
        b.shutdown()


def test_adapter_blocks_move_under_the_adapters_hashes(cores):
    """Blocks computed with a LoRA adapter hash with its id: the export names it, the import checks it, and
    only a request with the same adapter hits them."""
    from pagedllm.kv.prefix_cache import extra_keys_for, hash_block_chain

    a, b = cores
    q = prompts(1, prefix_len=40, seed=21)[0]
    run_core(a, "l0", q)
    blocks = export_prefix(a, q)
    ids = blocks.token_ids
    blocks.hashes = hash_block_chain(None, ids, 16, extra_keys_for(None, 7), a.kv.prefix_cache.key)
    blocks.lora_id = 7  # as if a had computed them with adapter 7 (same hash key in one process)
    assert import_prefix(b, blocks).blocks == 2
    assert b.kv.match_prefix(q, record=False, lora_id=7).num_tokens == 32
    assert b.kv.match_prefix(q, record=False).num_tokens == 0  # the base model never hits them
    blocks.lora_id = 0
    with pytest.raises(ValueError, match="hashes"):
        import_prefix(b, blocks)  # an adapter's hashes under the base model's id: refused
    b.reset_prefix_cache()
    b.check_integrity()
