"""Decode a server's KV event stream with vLLM's own decoder (run with vLLM's python: scripts/setup_baselines.sh).

    /opt/vllm-venv/bin/python scripts/vllm_kv_events_decode.py REPLAY_ENDPOINT

Asks the replay socket for every batch from 0 (vLLM's frames), decodes each payload with
``msgspec.msgpack.Decoder(KVEventBatch)`` (a strict, typed decode: a wrong field or type fails) and prints JSON:
the number of batches, events by type, and the set of cached block hashes the events leave (hex).
scripts/vllm_clients_check.py compares that set with our own decoder's.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def main(replay: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(replay)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    kinds: Counter[str] = Counter()
    cached: set[bytes] = set()
    batches = 0
    while True:
        if not sock.poll(30_000):
            raise SystemExit("no replay answer")
        _, _topic, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            break
        batches += 1
        for ev in decoder.decode(payload).events:
            kinds[type(ev).__name__] += 1
            if isinstance(ev, BlockStored):
                cached |= set(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                cached -= set(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                cached.clear()
    ctx.destroy(linger=0)
    print(json.dumps({"batches": batches, "events": dict(kinds), "cached": sorted(h.hex() for h in cached)}))


if __name__ == "__main__":
    main(sys.argv[1])
