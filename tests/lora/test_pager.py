"""The core's adapter pager on a bare KV manager: adapters take pages from the pool only once read, idle ones
are evicted least recently used, busy ones never, and the pool's invariants count every page."""

from __future__ import annotations

import threading
from concurrent.futures import wait

import pytest
import torch

from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.lora.adapter import LoRALoadError
from pagedllm.lora.pager import AdapterPager
from pagedllm.lora.pages import packed_bytes
from pagedllm.protocol.lora_request import LoRARequest
from tests.lora.test_delta import SHAPES

PAGE = packed_bytes(SHAPES, 1)  # one page per unit of rank


def pager_with(num_blocks: int, gate: threading.Event | None = None, fail: set[int] = frozenset()):
    kv = KVCacheManager(num_blocks, 16)
    pager = AdapterPager(kv, SHAPES, 16, PAGE, max_cpu_loras=2)

    def read(lora: LoRARequest):
        if gate is not None:
            assert gate.wait(30)
        if lora.lora_int_id in fail:
            raise OSError("disk gone")
        rank = lora.lora_int_id  # adapter i has rank i: i pages
        return rank, torch.full((rank * PAGE // 4,), float(rank))

    pager.read = read
    return kv, pager


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}")


def until_ready(pager: AdapterPager, lr: LoRARequest, busy: set[int]) -> bool:
    for _ in range(3):  # the first call starts the read; later ones place it once read
        if pager.ready(lr, busy):
            return True
        read = pager.loading.get(lr.lora_int_id)  # this adapter's read (another one may finish first)
        if read is not None:
            wait([read], timeout=30)
    return False


def test_pages_only_after_the_read_and_counted_in_the_pool():
    gate = threading.Event()
    kv, pager = pager_with(10, gate)
    assert not pager.ready(lora(3), set()) and kv.num_page_blocks == 0  # being read: no pages yet
    assert not pager.ready(lora(3), set())
    gate.set()
    assert until_ready(pager, lora(3), set())
    (ap,) = pager.take_pending()
    assert (ap.lora_id, ap.rank, len(ap.pages)) == (3, 3, 3) and ap.pages == kv.pages_of(("lora", 3))
    assert kv.pool.num_used == 3 and kv.num_free_blocks == 7
    kv.check_integrity()
    pager.check_integrity()
    assert pager.ready(lora(3), set()) and pager.take_pending() == []  # resident: nothing to send again


def test_lru_eviction_spares_busy_adapters():
    kv, pager = pager_with(10)
    for i in (2, 3, 4):
        assert until_ready(pager, lora(i), set())
    assert kv.num_page_blocks == 9
    assert until_ready(pager, lora(5), busy={2})  # needs 5, 1 free: 3 (LRU idle) then 4 go, 2 is busy
    assert sorted(pager.resident) == [2, 5] and pager.num_evictions == 2
    kv.check_integrity()
    pager.check_integrity()
    assert not pager.ready(lora(9), busy={2, 5})  # 9 pages: nothing idle to evict, it waits
    with pytest.raises(LoRALoadError, match="needs 11 KV blocks as pages; the pool has 10"):
        until_ready(pager, lora(11), set())  # larger than the pool: its requests fail with the reason


def test_integrity_catches_a_page_with_a_stray_reference():
    kv, pager = pager_with(6)
    assert until_ready(pager, lora(2), set())
    kv.pool.incref(kv.pages_of(("lora", 2))[0])
    with pytest.raises(AssertionError, match="ref_count 2 but 1 holders"):
        kv.check_integrity()


def test_a_failed_read_fails_its_requests_not_the_pool():
    kv, pager = pager_with(6, fail={2})
    with pytest.raises(LoRALoadError, match="'a2' failed to load: disk gone"):
        until_ready(pager, lora(2), set())
    assert pager.take_pending() == [] and kv.num_page_blocks == 0 and not pager.loading
    pager.check_integrity()
    assert not pager.ready(lora(2), set()) and 2 in pager.loading  # a later request reads it again
