"""Golden KV event bytes from vLLM's own encoder, for tests/server/test_kv_events_wire.py (CI has no vLLM).

Run with vLLM's python (scripts/setup_baselines.sh installs it):

    /opt/vllm-venv/bin/python scripts/kv_events_golden.py tests/server/data/kv_events_vllm.msgpack

It encodes one fixed ``KVEventBatch`` with ``msgspec.msgpack.Encoder``, as vLLM's ZmqEventPublisher does, with
the field values vLLM's block pool gives a plain text request (one KV cache group, medium "GPU", no LoRA, no
extra keys) and the data-parallel rank its publisher fills in. The events are the ones listed in the test
(``GOLDEN_EVENTS``); the test checks that our encoder writes the same bytes and reads these back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import vllm
from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

TS = 1764100000.25
BS = 4
H = [bytes([i]) * 16 for i in range(1, 5)]  # 16-byte hashes, as ours


def main(out: str) -> None:
    events = [
        AllBlocksCleared(),
        BlockStored(block_hashes=H[:2], parent_block_hash=None, token_ids=list(range(2 * BS)), block_size=BS,
                    lora_id=None, medium=MEDIUM_GPU, lora_name=None, extra_keys=[None, None], group_idx=0),
        # a branch: another prompt that shares only the first block
        BlockStored(block_hashes=H[2:3], parent_block_hash=H[0], token_ids=[70000, 3, 200, 65535], block_size=BS,
                    lora_id=None, medium=MEDIUM_GPU, lora_name=None, extra_keys=[None], group_idx=0),
        BlockRemoved(block_hashes=[H[0], H[3]], medium=MEDIUM_GPU, group_idx=0),
    ]
    batch = KVEventBatch(ts=TS, events=events, data_parallel_rank=0)
    Path(out).write_bytes(msgspec.msgpack.Encoder().encode(batch))
    print(f"wrote {out} with vLLM {vllm.__version__}'s encoder")


if __name__ == "__main__":
    main(sys.argv[1])
