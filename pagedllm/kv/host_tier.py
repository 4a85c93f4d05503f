"""L2: KV blocks in host RAM below the pool, keyed by chain hash (pinned memory on CUDA).

Blocks arrive as the batched ``KVCache.gather_blocks`` layout, ``kv`` ``[L, 2, Hkv, n, block_size,
D]`` (plus int8 block scales ``[L, 2, Hkv, n]`` or fp8's per-head ``[L, 2, Hkv, 1]``), and leave the
same way, so a run of blocks moves in one index copy. The tier thread stores, the engine thread
looks up and loads: every method holds the tier's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.kv.kv_quant import raw
from pagedllm.kv.tier_policy import LRUPolicy, ReusePolicy

BlockData = dict[str, torch.Tensor]


@dataclass
class Spill:
    """Blocks leaving L2 (evicted to make room) or never let in (refused by the policy, or more than it
    holds): the ones a disk tier below saves (write-back). ``data`` in the batched layout, ``None`` if empty."""

    hashes: list[int]
    tokens: list[tuple[int, ...]]
    depths: list[int]
    data: BlockData | None

    def __len__(self) -> int:
        return len(self.hashes)


class HostTier:
    """``num_slots`` block slots; a full tier evicts by ``policy`` to make room."""

    def __init__(self, num_slots: int, block_shape: Sequence[int], dtype: torch.dtype,
                 policy: LRUPolicy | ReusePolicy, pin_memory: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"kv_offload_memory: holds no block (num_slots={num_slots})")
        L, two, H, bs, D = block_shape
        self.num_slots = num_slots
        self.dtype = dtype
        self.data = torch.empty((L, two, H, num_slots, bs, D), dtype=dtype, pin_memory=pin_memory)
        self.block_scales = None  # int8: one scale per block and head
        self.head_scales = None  # fp8: the pool's per-head scales, the same for every block
        if dtype == torch.int8:
            self.block_scales = torch.empty((L, two, H, num_slots), dtype=torch.float32, pin_memory=pin_memory)
        self.policy = policy
        self._slot: dict[int, int] = {}  # hash -> slot
        self._tokens: dict[int, tuple[int, ...]] = {}  # hash -> token ids, verified on every hit
        self._depth: dict[int, int] = {}  # hash -> position in its prefix chain (kept for the disk below)
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._slot)

    def contains(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        with self._lock:
            return self._tokens.get(block_hash) == token_ids

    def put(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]], depths: Sequence[int],
            hits: Sequence[int], data: BlockData) -> Spill:
        """Store blocks ``data[..., i]`` under ``hashes[i]`` (ones already here are only touched);
        returns what was evicted to make room and what was not let in."""
        with self._lock:
            offered = [i for i, h in enumerate(hashes) if h not in self._slot]
            new = offered[: self.num_slots]
            for i, h in enumerate(hashes):
                if h in self._slot:
                    self.policy.touch(h, depths[i], hits[i])
            short = len(new) - len(self._free)
            evicted = []
            if short > 0:  # the best newcomers take free slots first, then each replaces a victim it outscores
                new.sort(key=lambda i: hits[i] + 1 / (1 + depths[i]), reverse=True)
                victims = self.policy.victims(short)
                keep = len(self._free)
                for i, v in zip(new[keep:], victims):
                    if not self.policy.admits(depths[i], hits[i], v):
                        break
                    evicted.append(v)
                new = new[:keep + len(evicted)]
            spill = self._spill(evicted, [i for i in offered if i not in set(new)], hashes, tokens, depths, data)
            for h in evicted:
                self.remove(h)
            slots = [self._free.pop() for _ in new]
            if new:
                src = torch.tensor(new, dtype=torch.int64)
                dst = torch.tensor(slots, dtype=torch.int64)
                raw(self.data).index_copy_(3, dst, raw(data["kv"]).index_select(3, src))
                if self.block_scales is not None:
                    self.block_scales.index_copy_(3, dst, data["scales"].index_select(3, src))
                elif "scales" in data:
                    self.head_scales = data["scales"].clone()
            for i, s in zip(new, slots):
                self._slot[hashes[i]] = s
                self._tokens[hashes[i]] = tokens[i]
                self._depth[hashes[i]] = depths[i]
                self.policy.touch(hashes[i], depths[i], hits[i])
            return spill

    def _spill(self, evicted: list[int], refused: list[int], hashes: Sequence[int],
               tokens: Sequence[tuple[int, ...]], depths: Sequence[int], data: BlockData) -> Spill:
        """The evicted entries (read before their slots are reused) and the refused newcomers, as one batch."""
        if not evicted and not refused:
            return Spill([], [], [], None)
        own = self._read([self._slot[h] for h in evicted])
        ref = torch.tensor(refused, dtype=torch.int64)
        kv = torch.cat([raw(own["kv"]), raw(data["kv"]).index_select(3, ref)], dim=3).view(self.dtype)
        out = {"kv": kv}
        if "scales" in own:
            sc = data["scales"]
            out["scales"] = (torch.cat([own["scales"], sc.index_select(3, ref)], dim=3)
                             if self.block_scales is not None else own["scales"])
        elif "scales" in data:
            out["scales"] = data["scales"]
        return Spill([*evicted, *(hashes[i] for i in refused)],
                     [*(self._tokens[h] for h in evicted), *(tokens[i] for i in refused)],
                     [*(self._depth[h] for h in evicted), *(depths[i] for i in refused)], out)

    def _read(self, slots: list[int]) -> BlockData:
        idx = torch.tensor(slots, dtype=torch.int64)
        out = {"kv": raw(self.data).index_select(3, idx).view(self.dtype)}
        if self.block_scales is not None:
            out["scales"] = self.block_scales.index_select(3, idx)
        elif self.head_scales is not None:
            out["scales"] = self.head_scales.clone()
        return out

    def entries(self) -> Spill:
        """Every block held, as one batch (to save them to disk at shutdown)."""
        with self._lock:
            hs = list(self._slot)
            if not hs:
                return Spill([], [], [], None)
            return Spill(hs, [self._tokens[h] for h in hs], [self._depth[h] for h in hs],
                         self._read([self._slot[h] for h in hs]))

    def get(self, hashes: Sequence[int]) -> BlockData:
        """The blocks under ``hashes`` (all present), as a new batch; counts as a hit on each."""
        with self._lock:
            for h in hashes:
                self.policy.touch(h)
            return self._read([self._slot[h] for h in hashes])

    def get_leading(self, hashes: Sequence[int]) -> tuple[BlockData | None, int]:
        """The leading blocks of ``hashes`` still here, as a new batch (None if none), and how many: a block
        located a moment ago may have been evicted since by the store thread making room for a demotion."""
        with self._lock:
            n = next((i for i, h in enumerate(hashes) if h not in self._slot), len(hashes))
            return (self.get(hashes[:n]) if n else None), n

    def remove(self, block_hash: int) -> None:
        with self._lock:
            slot = self._slot.pop(block_hash, None)
            if slot is None:
                return
            del self._tokens[block_hash]
            del self._depth[block_hash]
            self.policy.remove(block_hash)
            self._free.append(slot)

    def clear(self) -> None:
        with self._lock:
            for h in list(self._slot):
                self.remove(h)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used slots = total, one slot per hash, policy = index."""
        with self._lock:
            used = sorted(self._slot.values())
            if len(set(used)) != len(used):
                raise AssertionError("host tier: two hashes share a slot")
            if sorted(used + self._free) != list(range(self.num_slots)):
                raise AssertionError(f"host tier: free {len(self._free)} + used {len(used)} != total {self.num_slots}")
            if self.policy.keys() != set(self._slot) or not set(self._tokens) == set(self._slot) == set(self._depth):
                raise AssertionError("host tier: eviction policy / token index disagree with the slot index")
