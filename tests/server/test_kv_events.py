"""KV cache events in vLLM's schema over ZeroMQ: a subscriber rebuilds the engine's set of cached blocks from the
events alone, exactly, through stores, evictions, copy-on-write and a prefix-cache reset."""

from __future__ import annotations

import json
import time

import pytest
import zmq
from tests.engine.test_scheduler_no_model import BS, make_core

from pagedllm.kv.kv_events import END_SEQ, KVEventsConfig, decode_batch, hash_bytes
from pagedllm.protocol.core_io import EngineCoreRequest
from pagedllm.protocol.sampling_params import SamplingParams


class Subscriber:
    """What a router does: SUB on the event stream, DEALER on the replay socket, a cached-block set per replica."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)

    def live(self, timeout_ms: int = 0) -> list[tuple[int, bytes]]:
        out = []
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"kv"
            out.append((int.from_bytes(seq, "big"), payload))
            timeout_ms = 0
        return out

    def replay_from(self, start: int) -> list[tuple[int, bytes]]:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert self.replay.poll(10_000), "no replay answer"
            _, topic, seq, payload = self.replay.recv_multipart()  # vLLM's replay frames
            if seq == END_SEQ:
                assert topic == payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))


def rebuild(batches: list[tuple[int, bytes]]) -> set[bytes]:
    """The cached set from events alone, checking vLLM's shapes and that each stored run's parent is cached."""
    cached: set[bytes] = set()
    for _, payload in batches:
        ts, events, rank = decode_batch(payload)
        assert isinstance(ts, float) and rank == 0
        for ev in events:
            if ev["type"] == "BlockStored":
                hashes, parent = ev["block_hashes"], ev["parent_block_hash"]
                assert ev["block_size"] == BS and len(ev["token_ids"]) == BS * len(hashes)
                assert ev["lora_id"] is None and ev["extra_keys"] == [None] * len(hashes)
                assert parent is None or parent in cached
                assert not cached & set(hashes)
                cached |= set(hashes)
            elif ev["type"] == "BlockRemoved":
                assert set(ev["block_hashes"]) <= cached
                cached -= set(ev["block_hashes"])
            else:
                assert ev == {"type": "AllBlocksCleared"}
                cached.clear()
    return cached


def engine_cached(core) -> set[bytes]:
    """The pool's cached full blocks (a finished sequence's tail is cached too, but it is not a vLLM block: no
    event announces it)."""
    return {hash_bytes(b.block_hash) for b in core.kv.pool.blocks
            if b.block_hash is not None and len(b.token_ids) == BS}


def test_subscriber_rebuilds_the_cached_set_exactly(tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay,
           "topic": "kv"}
    core, _ = make_core(num_blocks=12, kv_events_config=json.dumps(cfg))
    ctx = zmq.Context()
    sub = Subscriber(ctx, endpoint, replay)
    live: list[tuple[int, bytes]] = []
    prefix = list(range(100, 100 + 2 * BS))
    deadline = time.monotonic() + 30
    for i in range(12):  # shared prefixes (hits), then prompts that evict them from the 12-block pool
        prompt = prefix + [i] * (BS + 3) if i < 6 else list(range(200 + 60 * i, 200 + 60 * i + 3 * BS))
        params = SamplingParams(ignore_eos=True, max_tokens=BS, n=1 + i % 2)
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        while core.has_unfinished():
            core.step()
        live += sub.live()
        assert time.monotonic() < deadline
    core.reset_prefix_cache()
    core.add_request(EngineCoreRequest("last", prefix + [7] * BS, SamplingParams(ignore_eos=True, max_tokens=2)))
    while core.has_unfinished():
        core.step()
    core.check_integrity()

    batches = sub.replay_from(0)
    assert [s for s, _ in batches] == list(range(core.kv_events.seq))  # ids from 0, one per step with news
    assert decode_batch(batches[0][1])[1][0] == {"type": "AllBlocksCleared"}
    kinds = {ev["type"] for _, p in batches for ev in decode_batch(p)[1]}
    assert kinds == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}
    assert rebuild(batches) == engine_cached(core) != set()
    # the live stream carries the same batches (a late joiner misses a head, which replay fills)
    live += sub.live(2000)
    assert live and live == batches[len(batches) - len(live):]
    core.shutdown()
    ctx.destroy(linger=0)


@pytest.mark.parametrize("text, why", [
    ("{", "not JSON"), ('{"publisher": "kafka"}', "publisher"), ('{"endpont": "x"}', "unknown keys"),
    ('{"buffer_steps": 0}', "buffer_steps"),
])
def test_bad_config_names_the_problem(text, why):
    with pytest.raises(ValueError, match=why):
        KVEventsConfig.from_json(text)


def test_no_publisher_unless_enabled():
    core, _ = make_core(kv_events_config=json.dumps({"publisher": "zmq"}))  # enable_kv_cache_events false
    assert core.kv_events is None and core.kv.prefix_cache.on_event is None


@pytest.mark.slow
def test_served_engine_publishes_from_its_core_process(tmp_path):
    """Through the real server (the core in its own process): a request's blocks arrive as BlockStored events."""
    import httpx
    from tests.server.conftest import live_server

    replay = f"ipc://{tmp_path}/replay"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/kv",
           "replay_endpoint": replay}
    with live_server({"kv_events_config": json.dumps(cfg)}) as srv:
        prompt = "A prompt long enough to fill a few KV blocks of sixteen tokens each, " * 3
        r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=120,
                       json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200
        ctx = zmq.Context()
        sub = Subscriber(ctx, f"ipc://{tmp_path}/kv", replay)
        stored = rebuild(sub.replay_from(0))
        ctx.destroy(linger=0)
    n_prompt = len(srv.engine.tokenizer.encode(prompt))
    assert len(stored) == (n_prompt + 2 - 1) // BS  # every full block of prompt and output, hashed once
