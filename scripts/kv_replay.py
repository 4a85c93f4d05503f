"""Every KV event batch a publisher still holds, through its replay socket (vLLM's frames). Plain pyzmq, so
both our python (scripts/vllm_clients_check.py) and vLLM's venv (scripts/vllm_kv_events_decode.py) use it."""

from __future__ import annotations

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replay_all(endpoint: str, timeout_ms: int = 30_000) -> list[bytes]:
    """The payloads of every kept batch, from sequence number 0, in order."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    payloads = []
    try:
        while True:
            if not sock.poll(timeout_ms):
                raise SystemExit("no replay answer")
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return payloads
            payloads.append(payload)
    finally:
        ctx.destroy(linger=0)
