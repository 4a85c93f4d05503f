"""Moving a prompt's cached KV blocks from one engine core to another, with their chain hashes.

The exporting core finds the prompt's longest cached prefix (full blocks only) and copies its K/V
to CPU tensors; the payload crosses processes (or nodes) through Ray's object store; the importing
core indexes the blocks under the same hashes in its prefix cache and writes their K/V, so the
request it runs next hits them like any cached prefix. Hashes are checked on arrival: engines that
share KV must share the hash key (``PAGEDLLM_HASH_KEY``), the block size and the tenant's salt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch

from pagedllm.core.engine_core import EngineCore


@dataclass
class KVBlocks:
    """Full blocks of a prompt prefix leaving one engine: what a peer needs to hit them."""

    hashes: list[int]  # chain hashes, one per block
    token_ids: list[int]  # len(hashes) * block_size
    cache_salt: str | None
    data: dict[str, torch.Tensor]  # KVCache.export_blocks: "kv" [L, 2, Hkv, n, bs, D] (+ "scales")
    export_s: float  # time the exporting core spent (lookup + copy to CPU)
    sent_at: float  # wall clock (time.time) when the payload left, to time its transit
    lora_id: int = 0  # the LoRA adapter the K/V was computed with (0: the base model), part of the hashes

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values())


@dataclass
class TransferStats:
    """Sums over the imports a core received: what moving KV costs (seconds, bytes)."""

    imports: int = 0
    blocks: int = 0  # blocks written (already cached ones are skipped)
    bytes: int = 0  # bytes received
    export_s: float = 0.0
    transit_s: float = 0.0  # export finished -> the importing replica received it (object store, Ray)
    queue_s: float = 0.0  # received -> import started (the importing core finishing its step)
    import_s: float = 0.0

    def add(self, other: TransferStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, float]:
        return {f"kv_transfer_{f.name}": getattr(self, f.name) for f in fields(self)}


def export_prefix(core: EngineCore, token_ids: list[int], cache_salt: str | None = None,
                  lora_id: int = 0) -> KVBlocks | None:
    """The prompt's cached full blocks on ``core`` (None: none cached), looked up in its pool and, with KV
    tiers, in its host RAM (L2) and disk (L3) tiers, whose blocks are promoted first. Run between steps."""
    t0 = time.perf_counter()
    core.kv.prefetch(token_ids, cache_salt, wait=True, lora_id=lora_id)
    m = core.kv.match_prefix(token_ids, cache_salt, record=False, lora_id=lora_id)
    if not m.blocks:
        return None
    data = core.export_kv_blocks(m.blocks)
    return KVBlocks(list(m.hashes), list(token_ids[:len(m.blocks) * core.kv.block_size]), cache_salt, data,
                    time.perf_counter() - t0, time.time(), lora_id)


def import_prefix(core: EngineCore, blocks: KVBlocks, received_at: float | None = None) -> TransferStats:
    """Index ``blocks`` in ``core``'s prefix cache and write the K/V of those it lacked. Run between
    steps; ``received_at`` (time.time) splits the wait into transit and queueing."""
    t0, now = time.perf_counter(), time.time()
    received = now if received_at is None else received_at
    transit, queued = max(received - blocks.sent_at, 0.0), max(now - received, 0.0)
    writes = core.kv.import_blocks(blocks.hashes, blocks.token_ids, blocks.cache_salt, blocks.lora_id)
    if writes:
        positions = [i for i, _ in writes]
        data = blocks.data
        if len(positions) < len(blocks.hashes):
            data = {k: _select_blocks(t, positions, len(blocks.hashes)) for k, t in data.items()}
        try:
            core.import_kv_blocks([b for _, b in writes], data)
        except Exception:
            for _, b in writes:  # indexed but never written: no request may hit them
                core.kv.prefix_cache.remove(b)
            raise
    return TransferStats(1, len(writes), blocks.num_bytes, blocks.export_s, transit, queued,
                         time.perf_counter() - t0)


def _select_blocks(t: torch.Tensor, positions: list[int], num_blocks: int) -> torch.Tensor:
    """Per-block tensors (dim 3 counts blocks) keep the chosen blocks; per-pool ones (a quantized
    pool's per-head scales) are kept whole."""
    if t.dim() > 3 and t.shape[3] == num_blocks:
        return t.index_select(3, torch.tensor(positions, dtype=torch.int64))
    return t
