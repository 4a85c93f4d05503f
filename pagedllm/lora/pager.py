"""Adapters paged in the KV pool (S-LoRA's unified paging), on the engine core's side of the boundary.

A resident adapter's packed weights (``lora.pages``) are *stored in* KV blocks taken from the same
``BlockPool`` as the KV cache: the pages' memory holds them, so adapters and KV compete for one budget and
the pool's invariants (free + used = total, refcount = holders) count them (``KVCacheManager.allocate_pages``).
The worker copies a step's adapters from their pages into its few compute slots (``lora.manager``): the
CPU's batched GEMMs want them stacked; a kernel reading pages in place would drop that copy.

An adapter no request has asked for lives on disk. The first request for it starts a background read and
convert (a thread, so no step waits on the disk); until it is done the request waits in the queue while the
others run. Once read, the adapter takes pages (evicting least recently used adapters that no running or
swapped request uses, if the pool is short) and its weights travel to the worker with the step that first
needs them. Read adapters stay packed in host memory, ``max_cpu_loras`` at most (least recently used
dropped), so a re-admitted adapter is not read again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.lora.adapter import LoRALoadError, LoRAShapes, load_adapter
from pagedllm.lora.pages import pack, packed_bytes, page_dtype
from pagedllm.lora.registry import shapes_for_model
from pagedllm.protocol.lora_request import AdapterPages, LoRARequest

log = logging.getLogger("pagedllm.lora")


def _owner(lora_id: int) -> tuple[str, int]:
    return ("lora", lora_id)


class AdapterPager:
    """Which adapters hold pages, which are being read, and what the worker must store next step."""

    def __init__(self, kv: KVCacheManager, shapes: LoRAShapes, max_rank: int, page_bytes: int,
                 max_cpu_loras: int = 1, dtype: torch.dtype = torch.float32,
                 page_shapes: LoRAShapes | None = None) -> None:
        """``page_shapes``: what each worker pages of an adapter of ``shapes`` (one tensor-parallel rank's shard,
        ``lora.sharding``; default all of it): the core packs adapters whole and counts pages of those."""
        self.page_shapes = page_shapes or shapes
        self.kv, self.shapes, self.max_rank, self.page_bytes = kv, shapes, max_rank, page_bytes
        self.dtype = dtype  # adapters are packed in it (``lora.pages.page_dtype`` of the model's dtype)
        self.max_cpu_loras = max(max_cpu_loras, 1)
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> rank, least recently used first
        self.host: OrderedDict[int, tuple[int, torch.Tensor]] = OrderedDict()  # id -> (rank, packed), LRU first
        self.loading: dict[int, Future] = {}
        self.pending: list[AdapterPages] = []  # for the next SchedulerOutput
        self.num_loads = 0  # adapters read from disk (tests and stats)
        self.num_evictions = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-lora-load")

    @classmethod
    def for_engine(cls, args, spec, kv: KVCacheManager) -> "AdapterPager | None":
        """The pager of an engine's ``EngineArgs`` and worker ``KVCacheSpec``; None without enable_lora."""
        if not args.enable_lora:
            return None
        return cls(kv, shapes_for_model(args.model), args.max_lora_rank, spec.kv_pool["page_bytes"],
                   args.max_cpu_loras or args.max_loras, page_dtype(spec.dtype),
                   shapes_for_model(args.model, args.tensor_parallel_size))

    def read(self, lora: LoRARequest) -> tuple[int, torch.Tensor]:
        """Read, check and pack ``lora`` (runs in the loader thread; tests replace it to gate a load)."""
        adapter = load_adapter(lora, self.shapes, self.max_rank)
        return adapter.rank, pack(adapter, self.shapes, self.dtype)

    def pages_for(self, rank: int) -> int:
        return -(-packed_bytes(self.page_shapes, rank, self.dtype) // self.page_bytes)

    def ready(self, lora: LoRARequest, busy: set[int]) -> bool:
        """Whether a request for ``lora`` can run this step: its adapter holds pages (made so now if it was
        read and the pool has room once idle adapters are evicted; ``busy``: ids running requests use). False
        while it is being read or the pool is short: the request waits, the others go on. LoRALoadError when
        it cannot be served (its read failed, or it is larger than the pool): its requests fail with the reason."""
        lid = lora.lora_int_id
        if lid in self.resident:
            self.resident.move_to_end(lid)
            return True
        got = self._host_copy(lora)
        if got is None:
            return False
        rank, packed = got
        n = self.pages_for(rank)
        if n > self.kv.num_blocks:
            raise LoRALoadError(f"adapter {lora.lora_name!r} needs {n} KV blocks as pages; the pool has "
                                f"{self.kv.num_blocks} (raise kv_cache_memory)")
        pages = self._allocate(lid, n, busy)
        if pages is None:
            return False
        self.resident[lid] = rank
        self.pending.append(AdapterPages(lid, rank, pages, packed))
        return True

    def _host_copy(self, lora: LoRARequest) -> tuple[int, torch.Tensor] | None:
        """The packed adapter if read (None while it is; the first call starts the read; a failed read raises
        LoRALoadError once, and the next request for it reads again)."""
        lid = lora.lora_int_id
        if lid in self.host:
            self.host.move_to_end(lid)
            return self.host[lid]
        fut = self.loading.get(lid)
        if fut is None:
            self.loading[lid] = self._pool.submit(self.read, lora)
            return None
        if not fut.done():
            return None
        del self.loading[lid]
        self.num_loads += 1
        try:
            got = fut.result()
        except Exception as e:  # noqa: BLE001 - any failure of a registered adapter fails its requests, not the engine
            log.warning("adapter %r failed to load: %s", lora.lora_name, e)
            raise LoRALoadError(f"adapter {lora.lora_name!r} failed to load: {e}") from None
        self.host[lid] = got
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return got

    def _allocate(self, lora_id: int, n: int, busy: set[int]) -> list[int] | None:
        while (pages := self.kv.allocate_pages(_owner(lora_id), n)) is None:
            if not self.evict_one(busy):
                return None
        return pages

    def evict_one(self, busy: set[int]) -> bool:
        """Free the pages of the least recently used adapter no request in ``busy`` uses; False if none is idle."""
        victim = next((i for i in self.resident if i not in busy), None)
        if victim is None:
            return False
        self.remove(victim)
        self.num_evictions += 1
        return True

    def remove(self, lora_id: int) -> None:
        """Drop an adapter's pages (evicted or unloaded); its packed host copy stays for a quick return."""
        self.resident.pop(lora_id, None)
        self.kv.free_pages(_owner(lora_id))

    def unload(self, lora_id: int, busy: set[int]) -> bool:
        """An adapter no longer served (``/v1/unload_lora_adapter``): its host copy and any read in flight are
        dropped, and its pages freed at once if no request in ``busy`` uses it (True); else it becomes the first
        to evict once they finish (False)."""
        self.host.pop(lora_id, None)
        fut = self.loading.pop(lora_id, None)
        if fut is not None:
            fut.cancel()
        if lora_id not in self.resident:
            return False
        if lora_id in busy:
            self.resident.move_to_end(lora_id, last=False)
            return False
        self.remove(lora_id)
        return True

    def forget(self, stored: list[AdapterPages]) -> None:
        """A step carrying these adapters' weights failed, so the worker may not have written their pages: free
        them and mark the adapters not resident (their next request sends them again from the host copy)."""
        for ap in stored:
            self.remove(ap.lora_id)

    def wait_for_load(self) -> bool:
        """Block until one adapter read in flight is done (the engine has nothing else to run); False if none is."""
        if not self.loading:
            return False
        wait(list(self.loading.values()), return_when=FIRST_COMPLETED)
        return True

    def take_pending(self) -> list[AdapterPages]:
        out, self.pending = self.pending, []
        return out

    def check_integrity(self) -> None:
        """Each resident adapter holds exactly its pages; nothing else holds pages."""
        want = sum(self.pages_for(r) for r in self.resident.values())
        if want != self.kv.num_page_blocks:
            raise AssertionError(f"resident adapters need {want} pages; the pool holds {self.kv.num_page_blocks}")
        for lid, rank in self.resident.items():
            if len(self.kv.pages_of(_owner(lid))) != self.pages_for(rank):
                raise AssertionError(f"adapter {lid} holds {len(self.kv.pages_of(_owner(lid)))} pages")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def unload_adapter(lora_id: int, core) -> bool:
    """``core.call`` target (module level, so it crosses to a core process): free an unloaded adapter's pages."""
    return core.scheduler.unload_lora(lora_id)
