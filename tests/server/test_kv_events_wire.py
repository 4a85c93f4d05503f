"""KV events on the wire are vLLM's bytes: data/kv_events_vllm.msgpack was written by vLLM 0.32's own msgspec
encoder (scripts/kv_events_golden.py, run in vLLM's venv: CI has no vLLM). Our publisher, given the same
events through the prefix cache's callback, sends the same bytes, and our decoder reads vLLM's."""

from __future__ import annotations

from pathlib import Path

import zmq

from pagedllm.kv import kv_events
from pagedllm.kv.kv_events import KVEventPublisher, KVEventsConfig, decode_batch

GOLDEN = Path(__file__).parent / "data" / "kv_events_vllm.msgpack"
TS, BS = 1764100000.25, 4  # as in scripts/kv_events_golden.py
H = [int.from_bytes(bytes([i]) * 16, "big") for i in range(1, 5)]  # its hashes, as the prefix cache's ints


def record_golden_events(pub: KVEventPublisher) -> None:
    """The golden batch's events, as the prefix cache reports them (the publisher opens with AllBlocksCleared)."""
    pub.record("stored", H[0], None, (0, 1, 2, 3))
    pub.record("stored", H[1], H[0], (4, 5, 6, 7))  # extends the run: one event for both blocks
    pub.record("stored", H[2], H[0], (70000, 3, 200, 65535))  # a branch: a new event
    pub.record("removed", H[0])
    pub.record("removed", H[3])


def test_publisher_sends_vllm_bytes(tmp_path, monkeypatch):
    """Read through the replay socket (vLLM's frames), which resends the very payload the PUB socket sent."""
    monkeypatch.setattr(kv_events.time, "time", lambda: TS)
    replay = f"ipc://{tmp_path}/replay"
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                          endpoint=f"ipc://{tmp_path}/kv", replay_endpoint=replay, topic="kv"),
                           block_size=BS)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        record_golden_events(pub)
        pub.flush()
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(10_000), "no replay answer"
        assert dealer.recv_multipart() == [b"", b"kv", (0).to_bytes(8, "big"), GOLDEN.read_bytes()]
        assert dealer.poll(10_000)
        assert dealer.recv_multipart() == [b"", b"", kv_events.END_SEQ, b""]
    finally:
        pub.close()
        ctx.destroy(linger=0)


def test_decoder_reads_vllm_bytes():
    ts, events, rank = decode_batch(GOLDEN.read_bytes())
    assert (ts, rank) == (TS, 0)
    h = [x.to_bytes(16, "big") for x in H]
    assert events == [
        kv_events.all_blocks_cleared(),
        kv_events.block_stored(h[:2], None, list(range(8)), BS),
        kv_events.block_stored(h[2:3], h[0], [70000, 3, 200, 65535], BS),
        kv_events.block_removed([h[0], h[3]]),
    ]
