"""KV events name what a block's hash covers besides its tokens: BlockStored carries the LoRA adapter
(``lora_id``, ``lora_name``) and each block's extra keys (vLLM's order: the adapter's name, then the
``cache_salt``); a base-model block without salt keeps None in all three (vLLM's bytes, tests/server)."""

from __future__ import annotations

import zmq

from pagedllm.kv import KVCacheManager
from pagedllm.kv.kv_events import KVEventPublisher, KVEventsConfig, decode_batch

BS = 4


def _stored_events(tmp_path, runs: list[tuple[str | None, int]]) -> list[dict]:
    """The BlockStored events of caching a 2-block sequence once per ``(cache_salt, lora_id)``."""
    replay = f"ipc://{tmp_path}/replay"
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                          endpoint=f"ipc://{tmp_path}/kv", replay_endpoint=replay, topic="kv"), BS)
    pub.lora_names[7] = "sql-adapter"
    m = KVCacheManager(16, BS)
    m.prefix_cache.on_event = pub.record
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        tokens = list(range(2 * BS + 1))
        for i, (salt, lora) in enumerate(runs):
            assert m.allocate_slots(i, 0, len(tokens))
            m.cache_full_blocks(i, tokens, salt, lora_id=lora)
        pub.flush()
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(10_000), "no replay answer"
        _, _, _, payload = dealer.recv_multipart()
    finally:
        pub.close()
        ctx.destroy(linger=0)
    return [e for e in decode_batch(payload)[1] if e["type"] == "BlockStored"]


def test_block_stored_names_adapter_and_salt(tmp_path):
    base, salted, adapter, both = _stored_events(tmp_path, [(None, 0), ("tenant-a", 0), (None, 7), ("tenant-b", 7)])
    assert (base["lora_id"], base["lora_name"], base["extra_keys"]) == (None, None, [None, None])
    assert (salted["lora_id"], salted["lora_name"], salted["extra_keys"]) == (None, None, [["tenant-a"]] * 2)
    assert (adapter["lora_id"], adapter["lora_name"], adapter["extra_keys"]) == (7, "sql-adapter", [["sql-adapter"]] * 2)
    assert both["extra_keys"] == [["sql-adapter", "tenant-b"]] * 2 and both["lora_id"] == 7
    assert len({bytes(h) for e in (base, salted, adapter, both) for h in e["block_hashes"]}) == 8
