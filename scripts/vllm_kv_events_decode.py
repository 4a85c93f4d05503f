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
from kv_replay import replay_all
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def main(replay: str) -> None:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    kinds: Counter[str] = Counter()
    cached: set[bytes] = set()
    payloads = replay_all(replay)
    for payload in payloads:
        for ev in decoder.decode(payload).events:
            kinds[type(ev).__name__] += 1
            if isinstance(ev, BlockStored):
                cached |= set(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                cached -= set(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                cached.clear()
    print(json.dumps({"batches": len(payloads), "events": dict(kinds), "cached": sorted(h.hex() for h in cached)}))


if __name__ == "__main__":
    main(sys.argv[1])
