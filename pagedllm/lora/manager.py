"""The worker's adapters: each resident one's weights stored in its KV pages (the core's ``lora.pager``
chose them), and the step's adapters copied from their pages into ``max_loras`` compute slots, least
recently used slots that no row of the step needs evicted. The scheduler never mixes more adapters in a
step than there are slots, and only schedules an adapter's rows once its pages are written, so a step
always fits and never reads a page that is not there.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pagedllm.kv.kv_cache import KVCache
from pagedllm.lora.adapter import LoRAShapes
from pagedllm.lora.delta import LoRAStep
from pagedllm.lora.pages import packed_bytes
from pagedllm.lora.sharding import AdapterShard
from pagedllm.lora.slots import LoRASlots
from pagedllm.protocol.lora_request import AdapterPages


class LoRAManager:
    def __init__(self, shapes: LoRAShapes, max_loras: int, max_rank: int, kv_cache: KVCache,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 pages_dtype: torch.dtype = torch.float32, shard: AdapterShard | None = None) -> None:
        """``shard``: this tensor-parallel rank's part of each adapter (``shapes`` are then ``shard.shapes``)."""
        self.shard = shard
        self.shapes, self.max_rank, self.dtype, self.kv_cache = shapes, max_rank, dtype, kv_cache
        self.pages_dtype = pages_dtype  # what the core packed adapters in (``lora.pages.page_dtype``)
        self.slots = LoRASlots(shapes, max_loras, max_rank, dtype, device)
        self.pages: dict[int, tuple[list[int], int]] = {}  # adapter id -> (its KV pages, its rank)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free_slots = list(range(max_loras - 1, -1, -1))  # popped lowest first: steps use few leading slots
        self.num_slot_fills = 0  # slots filled from pages (tests and stats)

    def store(self, ap: AdapterPages) -> None:
        """Write an adapter the core made resident into its pages (a slot holding an older copy is dropped)."""
        self._drop_slot(ap.lora_id)
        payload = ap.payload if self.shard is None else self.shard.take(ap.payload, ap.rank)
        self.kv_cache.write_pages(ap.pages, payload)
        self.pages[ap.lora_id] = (list(ap.pages), ap.rank)

    def _drop_slot(self, lora_id: int) -> None:
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.free_slots.sort(reverse=True)

    def step(self, lora_of_token: torch.Tensor) -> LoRAStep | None:
        """The step's ``LoRAStep`` for per-token adapter ids ``[T]`` (0: base), each adapter put in a slot."""
        if lora_of_token.numel() == 0:
            return None
        ids, inverse = torch.unique(lora_of_token, return_inverse=True)
        wanted = [i for i in ids.tolist() if i != 0]
        if not wanted:
            return None
        if len(wanted) > self.slots.num_slots:
            raise ValueError(f"a step mixes {len(wanted)} adapters; max_loras is {self.slots.num_slots}")
        for lora_id in wanted:
            self._fill_slot(lora_id, set(wanted))
        slot_of_id = torch.tensor([self.slot_of[i] if i else -1 for i in ids.tolist()], dtype=torch.int64)
        return LoRAStep.build(self.slots, slot_of_id[inverse], self.dtype)

    def _fill_slot(self, lora_id: int, needed: set[int]) -> None:
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            return
        if lora_id not in self.pages:
            raise ValueError(f"adapter id {lora_id} has no pages: the core scheduled it before making it resident")
        pages, rank = self.pages[lora_id]
        if self.free_slots:
            slot = self.free_slots.pop()
        else:  # the least recently used slot this step does not need
            victim = next(i for i in self.slot_of if i not in needed)
            slot = self.slot_of.pop(victim)
        nbytes = packed_bytes(self.shapes, rank, self.pages_dtype)
        flat = self.kv_cache.read_pages(pages, nbytes).view(self.pages_dtype)
        self.slots.write_packed(slot, flat, rank)
        self.slot_of[lora_id] = slot
        self.num_slot_fills += 1
