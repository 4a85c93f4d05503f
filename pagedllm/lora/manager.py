"""The worker's adapters: which one sits in which device slot, loaded on demand, least recently used evicted.

Adapters the core has announced (``register``) are read from disk when a step first needs them and kept in a
host-memory LRU of ``max_cpu_loras``; a step's adapters are copied into device slots, evicting the least
recently used slots that no row of this step needs. The scheduler never mixes more adapters in a step than
there are slots, so a step always fits.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from pagedllm.lora.adapter import LoRAAdapter, LoRAShapes, load_adapter
from pagedllm.lora.delta import LoRAStep
from pagedllm.lora.slots import LoRASlots
from pagedllm.protocol.lora_request import LoRARequest


class LoRAManager:
    def __init__(self, shapes: LoRAShapes, max_loras: int, max_rank: int, max_cpu_loras: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.shapes, self.max_rank, self.dtype = shapes, max_rank, dtype
        self.max_cpu_loras = max(max_cpu_loras or max_loras, 1)
        self.slots = LoRASlots(shapes, max_loras, max_rank, dtype, device)
        self.requests: dict[int, LoRARequest] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free_slots = list(range(max_loras - 1, -1, -1))  # popped lowest first: steps use few leading slots
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # loaded adapters, least recently used first
        self.num_loads = 0  # adapters read from disk (tests and stats)

    def register(self, lora: LoRARequest) -> None:
        """Remember where adapter ``lora.lora_int_id`` lives; a different path under a known id replaces it."""
        old = self.requests.get(lora.lora_int_id)
        if old is not None and old != lora:
            self.remove(lora.lora_int_id)
        self.requests[lora.lora_int_id] = lora

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (unloaded): its slot is freed and its host copy dropped."""
        self.requests.pop(lora_id, None)
        self.host.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.free_slots.sort(reverse=True)

    def step(self, lora_of_token: torch.Tensor) -> LoRAStep | None:
        """The step's ``LoRAStep`` for per-token adapter ids ``[T]`` (0: base), making each adapter resident."""
        if lora_of_token.numel() == 0:
            return None
        ids, inverse = torch.unique(lora_of_token, return_inverse=True)
        wanted = [i for i in ids.tolist() if i != 0]
        if not wanted:
            return None
        if len(wanted) > self.slots.num_slots:
            raise ValueError(f"a step mixes {len(wanted)} adapters; max_loras is {self.slots.num_slots}")
        for lora_id in wanted:
            self._make_resident(lora_id, set(wanted))
        slot_of_id = torch.tensor([self.slot_of[i] if i else -1 for i in ids.tolist()], dtype=torch.int64)
        return LoRAStep.build(self.slots, slot_of_id[inverse], self.dtype)

    def _make_resident(self, lora_id: int, needed: set[int]) -> None:
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            return
        if self.free_slots:
            slot = self.free_slots.pop()
        else:  # the least recently used slot this step does not need
            victim = next(i for i in self.slot_of if i not in needed)
            slot = self.slot_of.pop(victim)
        self.slots.write(slot, self._host_copy(lora_id))
        self.slot_of[lora_id] = slot

    def _host_copy(self, lora_id: int) -> LoRAAdapter:
        adapter = self.host.get(lora_id)
        if adapter is not None:
            self.host.move_to_end(lora_id)
            return adapter
        lora = self.requests.get(lora_id)
        if lora is None:
            raise ValueError(f"adapter id {lora_id} was never registered with the worker")
        adapter = load_adapter(lora, self.shapes, self.max_rank)
        self.num_loads += 1
        self.host[lora_id] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter
