"""KV cache events for external KV-aware routers (llm-d, Dynamo, Ray's router), in vLLM's schema and wire format.

The prefix cache reports every hash it registers or forgets through its ``on_event`` callback; the publisher
gathers one engine step's events into a batch and sends it on a ZeroMQ PUB socket as vLLM does: the frames
``[topic, sequence number (8 bytes, big-endian), msgpack payload]``, the payload a msgspec ``array_like`` tagged
``KVEventBatch``: ``[ts, [event, ...]]`` with events ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]`` and ``["AllBlocksCleared"]``.
Sequence numbers count batches from 0 per engine (replica); a ROUTER socket on ``replay_endpoint`` resends the
last ``buffer_steps`` batches from a sequence number on, so a subscriber that joined late or missed some catches
up. Block hashes go out as 16 bytes, big-endian (vLLM's ``ExternalBlockHash`` is bytes or int). A new publisher
starts with ``AllBlocksCleared``: a restarted engine's cache is empty.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

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


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One engine's event stream. ``record`` is the prefix cache's ``on_event``; ``flush`` (once per engine
    step) sends what was recorded as one batch."""

    def __init__(self, cfg: KVEventsConfig, block_size: int) -> None:
        import msgpack
        import zmq

        self._pack = msgpack.Packer(use_bin_type=True).pack
        self.cfg = cfg
        self.block_size = block_size
        self.seq = 0
        self._pending: list[list] = [["AllBlocksCleared"]]
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
               token_ids: tuple[int, ...] | None = None) -> None:
        """A hash was registered ("stored", with its parent and tokens) or forgotten ("removed"). A stored
        block whose parent is the last stored block extends that event, as vLLM's events cover a run."""
        last = self._pending[-1] if self._pending else None
        if kind == "stored":
            if last is not None and last[0] == "BlockStored" and parent_hash is not None and \
                    last[1][-1] == hash_bytes(parent_hash):
                last[1].append(hash_bytes(block_hash))
                last[3].extend(token_ids)
                return
            self._pending.append(["BlockStored", [hash_bytes(block_hash)],
                                  None if parent_hash is None else hash_bytes(parent_hash), list(token_ids),
                                  self.block_size, None, None])
        elif kind == "removed":
            if last is not None and last[0] == "BlockRemoved":
                last[1].append(hash_bytes(block_hash))
                return
            self._pending.append(["BlockRemoved", [hash_bytes(block_hash)], None])
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")

    def flush(self) -> None:
        """Send the recorded events as one batch (nothing when there are none)."""
        if not self._pending:
            return
        payload = self._pack([time.time(), self._pending])
        self._pending = []
        seq = self.seq.to_bytes(8, "big")
        with self._lock:
            self._buffer.append((self.seq, payload))
        self._pub.send_multipart([self.cfg.topic.encode(), seq, payload])
        self.seq += 1

    def _serve_replay(self, sock) -> None:
        """Answer ``[b"", start seq]`` with every kept batch from ``start`` on, then the end marker."""
        import zmq

        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            client, _, start = sock.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                batches = [b for b in self._buffer if b[0] >= first]
            for seq, payload in batches:
                sock.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            sock.send_multipart([client, b"", END_SEQ, b""])
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
