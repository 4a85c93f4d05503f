"""The KV pool tensors: a device tier the attention backends read and write in place, and an
optional host tier for preemption by swap.

Layout ``[num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim]``: a block of one head
is a contiguous ``[block_size, head_dim]`` tile and the pool of one head is one long sequence, so
FlexAttention reads it in place and a block move is one index copy along the block dimension for
all layers at once.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

BlockPairs = list[tuple[int, int]]


class KVCache:
    """Pre-allocated K/V storage for every layer, addressed by physical slot."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        num_host_blocks: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim, num_blocks, block_size) < 1 or num_host_blocks < 0:
            raise ValueError("KVCache dimensions must be positive (num_host_blocks >= 0)")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.dtype = dtype
        shape = (num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        # made once: indexing data per layer per step costs ~15 us, a third of a batch-1 layer's attention
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]
        self.host: torch.Tensor | None = None
        if num_host_blocks:
            host_shape = (num_layers, 2, num_kv_heads, num_host_blocks * block_size, head_dim)
            self.host = torch.zeros(host_shape, dtype=dtype, device="cpu")
        per_block = self.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %d B/block), %d host blocks",
            num_blocks, block_size, num_blocks * block_size,
            num_blocks * per_block / 2**20, per_block, num_host_blocks,
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views ``[Hkv, num_slots, D]`` of layer ``i``; writes go to the pool."""
        return self._layers[i]

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        """View ``[L, 2, Hkv, blocks, block_size, D]`` so whole blocks index along dim 3."""
        L, two, H, slots, D = t.shape
        return t.view(L, two, H, slots // self.block_size, self.block_size, D)

    @staticmethod
    def _move(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: BlockPairs) -> None:
        """Copy block ``src`` of ``src_pool`` to block ``dst`` of ``dst_pool`` for every pair: one
        gather and one scatter for all pairs and all layers (the gather finishes before any write,
        so a block that is both a source and a destination reads its old contents)."""
        if not pairs:
            return
        idx = torch.tensor(pairs, dtype=torch.int64)
        src = idx[:, 0].to(src_pool.device)
        dst = idx[:, 1].to(dst_pool.device)
        moved = src_pool.index_select(3, src).to(dst_pool.device, non_blocking=True)
        dst_pool.index_copy_(3, dst, moved)

    def copy_blocks(self, pairs: BlockPairs) -> None:
        """Apply copy-on-write copies ``(src, dst)`` between device blocks."""
        pool = self._blocks(self.data)
        self._move(pool, pool, pairs)

    def swap_out(self, pairs: BlockPairs) -> None:
        """Copy ``(device_block, host_block)`` pairs device -> host."""
        self._move(self._blocks(self.data), self._blocks(self._host()), pairs)

    def swap_in(self, pairs: BlockPairs) -> None:
        """Copy ``(host_block, device_block)`` pairs host -> device."""
        self._move(self._blocks(self._host()), self._blocks(self.data), pairs)

    def _host(self) -> torch.Tensor:
        if self.host is None:
            raise RuntimeError("KVCache has no host tier (num_host_blocks=0); swap is unavailable")
        return self.host

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """K and V of ``block_size`` tokens for every layer and KV head."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * block_size * itemsize

    @classmethod
    def num_blocks_for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """How many whole blocks fit in ``budget_bytes`` (0 if not even one)."""
        per_block = cls.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
        return max(int(budget_bytes) // per_block, 0)

    @classmethod
    def num_blocks_for_memory_fraction(
        cls,
        fraction: float,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> int:
        """How many blocks fit in ``fraction`` of the memory available now on ``device``."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
        budget = int(available_memory_bytes(device) * fraction)
        return cls.num_blocks_for_budget(budget, num_layers, num_kv_heads, head_dim, block_size, dtype)


def available_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Free memory on ``device``: CUDA's free bytes, or MemAvailable from /proc/meminfo (the page
    cache counts as available, unlike MemFree), falling back to free physical pages."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
