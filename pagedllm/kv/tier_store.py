"""The tiers below the pool: L2 (host RAM) and L3 (disk), and the thread that moves blocks.

The KV manager calls it with batches of blocks. ``demote``: blocks the pool just evicted are
gathered from the device in one index copy (before the step's forward can overwrite them; on CUDA
the device-to-host copy runs on a side stream into pinned memory) and stored in L2 by the copy thread.
L3 is write-back: the thread writes to disk only what leaves L2 (evicted, or refused by its policy),
and ``close`` saves what L2 still holds, so a restart finds every block. (Write-through, the first
design, serialised, checksummed and wrote every demoted block while the model ran on the same cores:
L2 + L3 answered returning turns 19% slower than L2 alone; bench/README.md, tiers.) Without L2 every
demoted block goes to disk. A crash loses what only L2 held; nothing wrong is ever served. ``locate`` says which tier holds each
block of a chain (a block whose store is still queued is waited for, not missed); ``load_host`` returns an L2 run
at once; ``load_disk`` reads an L3 run on a read thread and returns a future, so a request waiting for its blocks
does not stall the step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from pagedllm.kv.disk_tier import DiskTier
from pagedllm.kv.host_tier import BlockData, HostTier
from pagedllm.kv.kv_quant import raw

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    """Counters since start (bytes and blocks per tier), for metrics and the dashboard."""

    demoted_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    demoted_bytes: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    promoted_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    promoted_bytes: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    promotion_seconds: list[float] = field(default_factory=list)  # per promoted run, bounded
    lookup_blocks: int = 0  # blocks past a pool miss looked up in the tiers
    located_blocks: int = 0  # of those, found in L2 or L3


class TierStore:
    """L2 and/or L3 below a pool whose blocks have ``block_shape`` ``[L, 2, Hkv, block_size, D]``."""

    def __init__(self, block_shape: Sequence[int], dtype: torch.dtype, bytes_per_block: int,
                 host: HostTier | None, disk: DiskTier | None, device: torch.device | str = "cpu") -> None:
        if host is None and disk is None:
            raise ValueError("a tier store needs a host or a disk tier")
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.bytes_per_block = bytes_per_block
        self.host = host
        self.disk = disk
        self.device = torch.device(device)
        self.stats = TierStats()
        self._count_lock = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-store")
        # promotions read on their own threads: a request waiting for its blocks never queues behind demotions
        self._reads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-tier-read")
        self._writes: list[Future] = []
        # hash -> the store still on the copy thread: a lookup of a block the pool just evicted waits for it instead
        # of missing it (a busy machine's copy thread lags; a miss recomputes the block)
        self._storing: dict[int, Future] = {}
        self._storing_lock = threading.Lock()
        self.read_seconds_per_block: float | None = None  # moving average over disk reads (read thread)
        self._closed = False
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- demotion ------------------------------------------------------------------------

    def demote(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]], depths: Sequence[int],
               hits: Sequence[int], data: BlockData) -> None:
        """Store gathered blocks (``KVCache.gather_blocks`` of the evicted ids) in L2 and L3 on the copy
        thread: the caller only pays for the gather (and on CUDA not even for the copy to the host)."""
        if self._closed:
            return
        data, ready = self._to_host(data)
        self._writes = [f for f in self._writes if not f.done()]
        fut = self._io.submit(self._store, list(hashes), list(tokens), list(depths), list(hits), data, ready)
        self._writes.append(fut)
        with self._storing_lock:
            self._storing.update((h, fut) for h in hashes)
        fut.add_done_callback(lambda f, hs=list(hashes): self._stored(hs, f))

    def _stored(self, hashes: list[int], fut: Future) -> None:
        with self._storing_lock:
            for h in hashes:
                if self._storing.get(h) is fut:  # (a later demotion of the same block keeps its own)
                    del self._storing[h]

    def _to_host(self, data: BlockData) -> tuple[BlockData, torch.cuda.Event | None]:
        """Device tensors to host memory: on CUDA a pinned copy on the side stream, after the gather the
        caller's stream ordered before the forward, with an event the copy thread waits on."""
        if self._stream is None:
            return data, None
        out = {}
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for k, t in data.items():
                out[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                out[k].copy_(t, non_blocking=True)
                t.record_stream(self._stream)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return out, ready

    def _store(self, hashes: list[int], tokens: list[tuple[int, ...]], depths: list[int], hits: list[int],
               data: BlockData, ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            ready.synchronize()
        if self.host is not None:
            spill = self.host.put(hashes, tokens, depths, hits, data)
            self._count("demoted", "host", len(hashes) - len(spill))
            if spill.data is not None:
                hashes, tokens, depths, data = spill.hashes, spill.tokens, spill.depths, spill.data
                hits = [1] * len(hashes)
            else:
                return
        if self.disk is not None and not self.disk.full:
            self._write_disk(hashes, tokens, depths, hits, data)

    def _write_disk(self, hashes: list[int], tokens: list[tuple[int, ...]], depths: list[int], hits: list[int],
                    data: BlockData) -> None:
        assert self.disk is not None
        for i, h in enumerate(hashes):
            if self.disk.full:
                return
            if self.disk.write(h, tokens[i], self._payload(data, i), depths[i], hits[i]):
                self._count("demoted", "disk", 1)

    # ---- lookup and promotion ------------------------------------------------------------

    def locate(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]]) -> list[str]:
        """Where each leading block of ``hashes`` is held ("host" first, else "disk"), up to the first miss."""
        where = []
        for h, t in zip(hashes, tokens):
            if (tier := self.find(h, t)) is None:
                break
            where.append(tier)
        self.stats.lookup_blocks += len(hashes)
        self.stats.located_blocks += len(where)
        return where

    def find(self, block_hash: int, tokens: tuple[int, ...]) -> str | None:
        """Which tier holds one block ("host" first, else "disk"), or None; not counted in the lookup stats
        (``locate`` counts blocks of a chain; a tail is probed at up to ``block_size - 1`` lengths). A block still
        on its way down (its store queued on the copy thread) is waited for."""
        with self._storing_lock:
            storing = self._storing.get(block_hash)
        if storing is not None:
            wait([storing])  # (a store that failed raises at flush; the lookup answers from what the tiers hold)
        if self.host is not None and self.host.contains(block_hash, tokens):
            return "host"
        return "disk" if self.disk is not None and self.disk.contains(block_hash) else None

    def load_host(self, hashes: Sequence[int]) -> tuple[BlockData | None, int]:
        """An L2 run as one batch, and its length: the leading blocks still in L2 (``locate`` found them all,
        but the store thread may have evicted some since)."""
        assert self.host is not None
        data, n = self.host.get_leading(hashes)
        self._count("promoted", "host", n)
        return data, n

    def load_disk(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]],
                  where: Sequence[str], now: bool = False) -> Future:
        """Read a run on a read thread (its L2 blocks are copied now), or in the caller (``now``: a short read,
        no thread hand-over): a future of ``(data, n)``, the first ``n`` blocks loaded (a missing or corrupt
        file ends the run there)."""
        host = {i: h for i, (h, w) in enumerate(zip(hashes, where)) if w == "host"}
        host_data = None
        if host:
            host_data, n = self.host.get_leading(list(host.values()))
            if n < len(host):  # an L2 block evicted since it was located (the store thread): the run ends there
                cut = list(host)[n]
                hashes, tokens, where = hashes[:cut], tokens[:cut], where[:cut]
                host = dict(list(host.items())[:n])
        run = (list(hashes), list(tokens), list(where), list(host), host_data)
        if not now:
            return self._reads.submit(self._read_run, *run)
        done: Future = Future()
        done.set_result(self._read_run(*run))
        return done

    def _read_run(self, hashes: list[int], tokens: list[tuple[int, ...]], where: list[str], host_pos: list[int],
                  host_data: BlockData | None) -> tuple[BlockData | None, int]:
        assert self.disk is not None
        blocks: list[BlockData] = []
        t0 = time.perf_counter()
        for i, (h, t, w) in enumerate(zip(hashes, tokens, where)):
            if w == "host":
                blocks.append(self._block_of(host_data, host_pos.index(i)))
                continue
            payload = self.disk.read(h, t)
            if payload is None:
                break
            blocks.append(self._unpayload(payload))
        if not blocks:
            return None, 0
        n_disk = sum(w == "disk" for w in where[:len(blocks)])
        if n_disk:
            per = (time.perf_counter() - t0) / n_disk
            avg = self.read_seconds_per_block
            self.read_seconds_per_block = per if avg is None else 0.7 * avg + 0.3 * per
        self._count("promoted", "disk", n_disk)
        self._count("promoted", "host", len(blocks) - n_disk)
        return self._stack(blocks), len(blocks)

    # ---- (de)serialisation of one block ------------------------------------------------------

    def _block_of(self, data: BlockData, i: int) -> BlockData:
        """Block ``i`` of a batch: ``kv`` ``[L, 2, Hkv, block_size, D]``, ``scales`` ``[L, 2, Hkv]``."""
        out = {"kv": data["kv"][:, :, :, i]}
        if "scales" in data:
            out["scales"] = data["scales"][:, :, :, i if self.dtype == torch.int8 else 0]
        return out

    def _payload(self, data: BlockData, i: int) -> bytes:
        block = self._block_of(data, i)
        parts = [raw(block["kv"]).contiguous().view(torch.uint8).numpy().tobytes()]
        if "scales" in block:
            parts.append(block["scales"].contiguous().numpy().tobytes())
        return b"".join(parts)

    def _unpayload(self, payload: bytes) -> BlockData:
        L, two, H, bs, D = self.block_shape
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        n_kv = L * two * H * bs * D * torch.empty((), dtype=self.dtype).element_size()
        kv = buf[:n_kv].view(self.dtype).reshape(L, two, H, bs, D)
        out = {"kv": kv}
        if len(payload) > n_kv:
            out["scales"] = buf[n_kv:].view(torch.float32).reshape(L, two, H)
        return out

    def _stack(self, blocks: list[BlockData]) -> BlockData:
        out = {"kv": torch.stack([raw(b["kv"]) for b in blocks], dim=3).view(self.dtype)}
        if "scales" in blocks[0]:
            if self.dtype == torch.int8:
                out["scales"] = torch.stack([b["scales"] for b in blocks], dim=3)
            else:  # fp8: the per-head scales, one copy
                out["scales"] = blocks[0]["scales"].unsqueeze(3)
        return out

    # ---- bookkeeping ------------------------------------------------------------------------

    def _count(self, what: str, tier: str, n: int) -> None:
        with self._count_lock:  # both threads count
            getattr(self.stats, f"{what}_blocks")[tier] += n
            getattr(self.stats, f"{what}_bytes")[tier] += n * self.bytes_per_block

    def record_promotion(self, seconds: float) -> None:
        lat = self.stats.promotion_seconds
        lat.append(seconds)
        if len(lat) > 4096:
            del lat[:2048]

    def flush(self) -> None:
        """Wait for the queued disk writes (shutdown, tests)."""
        for f in self._writes:
            f.result()
        self._writes.clear()

    def close(self) -> None:
        """Finish the queued writes, save what L2 holds to L3 and stop the copy thread; later demotions are
        dropped."""
        self.flush()
        if self.host is not None and self.disk is not None and not self.disk.full:
            held = self.host.entries()
            if held.data is not None:
                self._write_disk(held.hashes, held.tokens, held.depths, [1] * len(held), held.data)
        self._closed = True
        self._io.shutdown(wait=True)
        self._reads.shutdown(wait=True)

    def describe(self) -> dict[str, float]:
        """Occupancy and counters per tier, flat, for ``KVCacheManager.stats``."""
        s = self.stats
        out: dict[str, float] = {}
        if self.host is not None:
            out.update(host_tier_blocks=self.host.num_slots, host_tier_used=len(self.host))
        if self.disk is not None:
            out.update(disk_tier_bytes=self.disk.capacity_bytes, disk_tier_used_bytes=self.disk.used_bytes,
                       disk_tier_full=int(self.disk.full), disk_tier_corrupt=self.disk.num_corrupt)
        for tier in ("host", "disk"):
            out[f"{tier}_tier_demoted_blocks"] = s.demoted_blocks[tier]
            out[f"{tier}_tier_demoted_bytes"] = s.demoted_bytes[tier]
            out[f"{tier}_tier_promoted_blocks"] = s.promoted_blocks[tier]
            out[f"{tier}_tier_promoted_bytes"] = s.promoted_bytes[tier]
        bs = self.block_shape[3]
        out["tier_query_tokens"] = s.lookup_blocks * bs
        out["tier_hit_tokens"] = s.located_blocks * bs
        lat = s.promotion_seconds
        out["promotions"] = len(lat)
        out["promotion_seconds_mean"] = sum(lat) / len(lat) if lat else 0.0
        return out

    def check_integrity(self) -> None:
        if self.host is not None:
            self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()

