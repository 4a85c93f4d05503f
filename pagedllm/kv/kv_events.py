"""KV cache events for external KV-aware routers (llm-d, Dynamo, Ray's router), in vLLM's schema and wire format.

The prefix cache reports every hash it registers or forgets through its ``on_event`` callback; the publisher
gathers one engine step's events into a batch and sends it on a ZeroMQ PUB socket as vLLM does: the frames
``[topic, sequence number (8 bytes, big-endian), msgpack payload]``. The payload is what vLLM 0.32's msgspec
encoder writes for its ``KVEventBatch`` (array-like): ``[ts, [event, ...], data_parallel_rank]``, each event a
map tagged by ``type`` with its struct's fields in order (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``; see ``block_stored``). tests/server/test_kv_events_wire.py holds bytes made by vLLM's own
encoder (scripts/kv_events_golden.py) and checks ours are the same.
Sequence numbers count batches from 0 per engine (replica); a ROUTER socket on ``replay_endpoint`` resends the
last ``buffer_steps`` batches from a sequence number on, so a subscriber that joined late or missed some catches
up. Block hashes go out as 16 bytes, big-endian (vLLM's ``ExternalBlockHash`` is bytes or int). A new publisher
starts with ``AllBlocksCleared``: a restarted engine's cache is empty.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

log = logging.getLogger("pagedllm.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` JSON (its ``KVEventsConfig``)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" to publish
    endpoint: str = "tcp://*:5557"  # a wildcard or ipc/inproc address is bound, any other is connected to
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ send high-water mark
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """ValueError naming a bad or unknown key."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_events_config: not JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config: must be a JSON object")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}")
        cfg = cls(**raw)
        if cfg.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        if cfg.buffer_steps < 1 or cfg.hwm < 0:
            raise ValueError("kv_events_config: buffer_steps must be >= 1 and hwm >= 0")
        return cfg

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def hash_bytes(block_hash: int) -> bytes:
    """A block hash as sent: 16 bytes, big-endian."""
    return block_hash.to_bytes(16, "big")


MEDIUM = "GPU"  # vLLM's name for the engine's own KV pool (its CPU build says "GPU" too; "CPU" is an offload tier)


def block_stored(hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int,
                 lora_id: int | None = None, lora_name: str | None = None, keys: tuple | None = None) -> dict:
    """vLLM's ``BlockStored`` as its block pool fills it for a text request: one KV cache group (0), the
    adapter (``lora_id`` / ``lora_name``, None for the base model) and each block's extra hash keys (``keys``,
    the same for every block of the run; None without adapter or salt). The keys keep its struct's field
    order, so the bytes are the same as its."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
            "block_size": block_size, "lora_id": lora_id, "medium": MEDIUM, "lora_name": lora_name,
            "extra_keys": [keys] * len(hashes), "group_idx": 0}


def event_keys(extra_keys: tuple, lora_names: dict[int, str]) -> tuple[int | None, str | None, tuple | None]:
    """``(lora_id, lora_name, keys)`` of a block stored with our hash's ``extra_keys`` (``prefix_cache.
    extra_keys_for``): vLLM's extra keys are values in its order, the adapter's name then the ``cache_salt``."""
    named = dict(extra_keys)
    lora_id = named.get("lora") or None
    lora_name = lora_names.get(lora_id) if lora_id else None
    keys = tuple(v for v in (lora_name, named.get("cache_salt")) if v is not None)
    return lora_id, lora_name, keys or None


def block_removed(hashes: list[bytes]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM, "group_idx": 0}


def all_blocks_cleared() -> dict:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[dict], data_parallel_rank: int = 0) -> bytes:
    """vLLM's ``KVEventBatch`` bytes (msgpack; floats as float64, hashes as bin)."""
    import msgpack

    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict], int | None]:
    """(ts, events, data parallel rank) of a batch, ours or vLLM's (its rank may be omitted)."""
    import msgpack

    ts, events, *rank = msgpack.unpackb(payload)
    return ts, events, rank[0] if rank else None


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One engine's event stream. ``record`` is the prefix cache's ``on_event``; ``flush`` (once per engine
    step) sends what was recorded as one batch."""

    def __init__(self, cfg: KVEventsConfig, block_size: int) -> None:
        import zmq

        self.cfg = cfg
        self.block_size = block_size
        self.lora_names: dict[int, str] = {}  # adapter id -> name, for BlockStored's lora_name (the engine core fills it)
        self.seq = 0
        self._pending: list[dict] = [all_blocks_cleared()]
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if _binds(cfg.endpoint) else self._pub.connect)(cfg.endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread = None
        if cfg.replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(cfg.replay_endpoint)
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(replay,), daemon=True,
                                                   name="pagedllm-kv-events-replay")
            self._replay_thread.start()

    def record(self, kind: str, block_hash: int, parent_hash: int | None = None,
               token_ids: tuple[int, ...] | None = None, extra_keys: tuple = ()) -> None:
        """A hash was registered ("stored", with its parent, tokens and the extra keys its hash covers) or
        forgotten ("removed"). A stored block whose parent is the last stored block extends that event, as
        vLLM's events cover a run."""
        last = self._pending[-1] if self._pending else None
        if kind == "stored":
            lora_id, lora_name, keys = event_keys(extra_keys, self.lora_names)
            if last is not None and last["type"] == "BlockStored" and parent_hash is not None and \
                    last["block_hashes"][-1] == hash_bytes(parent_hash):  # a chain's blocks share its keys
                last["block_hashes"].append(hash_bytes(block_hash))
                last["token_ids"].extend(token_ids)
                last["extra_keys"].append(keys)
                return
            self._pending.append(block_stored([hash_bytes(block_hash)],
                                              None if parent_hash is None else hash_bytes(parent_hash),
                                              list(token_ids), self.block_size, lora_id, lora_name, keys))
        elif kind == "removed":
            if last is not None and last["type"] == "BlockRemoved":
                last["block_hashes"].append(hash_bytes(block_hash))
                return
            self._pending.append(block_removed([hash_bytes(block_hash)]))
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")

    def flush(self) -> None:
        """Send the recorded events as one batch (nothing when there are none)."""
        if not self._pending:
            return
        payload = encode_batch(time.time(), self._pending)
        self._pending = []
        seq = self.seq.to_bytes(8, "big")
        with self._lock:
            self._buffer.append((self.seq, payload))
        self._pub.send_multipart([self.cfg.topic.encode(), seq, payload])
        self.seq += 1

    def _serve_replay(self, sock) -> None:
        """Answer ``[b"", start seq]`` with every kept batch from ``start`` on as ``[b"", topic, seq, payload]``,
        then the end marker ``[b"", b"", END_SEQ, b""]``, vLLM's frames."""
        import zmq

        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 3:  # a malformed request is dropped, as vLLM does; the thread keeps serving
                log.warning("KV events replay: request of %d frames ignored (want [b'', start seq])", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                batches = [b for b in self._buffer if b[0] >= first]
            topic = self.cfg.topic.encode()
            for seq, payload in batches:
                sock.send_multipart([client, b"", topic, seq.to_bytes(8, "big"), payload])
            sock.send_multipart([client, b"", b"", END_SEQ, b""])
        sock.close()

    def close(self) -> None:
        self.flush()
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        self._pub.close()
        self._ctx.term()


def make_publisher(config_json: str | None, block_size: int) -> KVEventPublisher | None:
    """The publisher ``--kv-events-config`` asks for, or None (not set, disabled, or the null publisher)."""
    if config_json is None:
        return None
    cfg = KVEventsConfig.from_json(config_json)
    return KVEventPublisher(cfg, block_size) if cfg.publishes else None
