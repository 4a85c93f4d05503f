"""Disaggregated prefill/decode: a prefill replica computes the prompt's KV, its full blocks (with
their chain hashes) travel through Ray's object store to a decode replica, which generates.

The decode replica receives the whole prompt and finds the imported blocks in its prefix cache,
so it computes only the prompt's last partial block (at least one token, as every prefix hit
does) before decoding: outputs equal a colocated engine's. The handoff never waits in the front
end: the decode replica's ``add`` takes the prefill's result as an ``ObjectRef``, which Ray
resolves on the decode side once the prefill is done.
"""

from __future__ import annotations

import dataclasses

from pagedllm.protocol.core_io import EngineCoreRequest
from pagedllm.protocol.sampling_params import SamplingParams


def prefill_request(req: EngineCoreRequest) -> EngineCoreRequest:
    """The prefill replica's copy of ``req``: the same prompt, one greedy token (discarded)."""
    return dataclasses.replace(req, params=SamplingParams(max_tokens=1, temperature=0.0))


def needs_prefill(req: EngineCoreRequest, block_size: int) -> bool:
    """Worth a prefill replica: at least one full block to hand over, and no prompt logprobs (those
    need every prompt position computed where the request runs)."""
    return len(req.prompt_token_ids) > block_size and req.params.prompt_logprobs is None


def dispatch(prefill_replica, decode_replica, req: EngineCoreRequest):
    """Start ``req`` on the pair; returns (the prefill's ObjectRef, the decode add's ObjectRef)."""
    kv = prefill_replica.prefill.remote(prefill_request(req))
    return kv, decode_replica.add.remote(req, kv)
