"""The KV pool tensors: a device tier the attention backends read and write in place, and an
optional host tier for preemption by swap.

Layout ``[num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim]``: a block of one head
is a contiguous ``[block_size, head_dim]`` tile and the pool of one head is one long sequence, so
FlexAttention reads it in place and a block move is one index copy along the block dimension for
all layers at once.

A quantized pool (``dtype`` int8 / fp8, see :mod:`pagedllm.kv.kv_quant`) also holds ``scales``
``[num_layers, 2, num_kv_heads, num_blocks]`` fp32 (fp8: one per head, ``[.., 1]`` broadcast over blocks).
Scales index along the same block dimension as the rows, so copy-on-write, swap and export move them with
their blocks, and sizing counts their bytes.
"""

from __future__ import annotations

import logging
import os

import torch

from pagedllm.kv.kv_quant import QuantizedKV, is_quantized, raw, scale_bytes_per_block_head

from pagedllm.config.device import resolve_kv_cache_dtype

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
        dtype: torch.dtype | str = torch.float32,
        num_host_blocks: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        dtype = resolve_kv_cache_dtype(dtype)
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
        self.scales: torch.Tensor | None = None  # quantized pools: see the module docstring
        self.host: torch.Tensor | None = None
        self.host_scales: torch.Tensor | None = None
        if dtype == torch.int8:
            self.scales = torch.zeros(shape[:3] + (num_blocks,), dtype=torch.float32, device=device)
        elif is_quantized(dtype):
            self.scales = torch.ones(shape[:3] + (1,), dtype=torch.float32, device=device)
        if num_host_blocks:
            host_shape = (num_layers, 2, num_kv_heads, num_host_blocks * block_size, head_dim)
            self.host = torch.zeros(host_shape, dtype=dtype, device="cpu")
            if dtype == torch.int8:
                self.host_scales = torch.zeros(host_shape[:3] + (num_host_blocks,), dtype=torch.float32)
        # made once: indexing data per layer per step costs ~15 us, a third of a batch-1 layer's attention
        self._layers = [self._make_layer(i) for i in range(num_layers)]
        log.info("KV cache: %s", self.describe_line())

    def _make_layer(self, i: int) -> tuple:
        if self.scales is None:
            return self.data[i, 0], self.data[i, 1]
        sc = self.scales[i].expand(2, self.num_kv_heads, self.num_blocks)  # fp8: block stride 0
        return QuantizedKV(self.data[i, 0], sc[0]), QuantizedKV(self.data[i, 1], sc[1])

    def layer(self, i: int) -> tuple:
        """(k_cache, v_cache) of layer ``i``: views ``[Hkv, num_slots, D]`` of the pool (writes go to it), or
        :class:`QuantizedKV` pairs of codes and scales for a quantized pool."""
        return self._layers[i]

    def describe(self) -> dict:
        """What the pool holds, for the engine log, /metrics and the dashboard."""
        per_block = self.bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size,
                                         self.dtype)
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "bytes_per_block": per_block,
            "bytes_per_token": per_block / self.block_size,
            "capacity_tokens": self.num_blocks * self.block_size,
            "pool_bytes": self.num_blocks * per_block,
            "num_host_blocks": self.num_host_blocks,
        }

    def describe_line(self) -> str:
        d = self.describe()
        return (f"{d['dtype']}, {d['num_blocks']} blocks x {d['block_size']} tokens = {d['capacity_tokens']} tokens "
                f"({d['pool_bytes'] / 2**20:.1f} MiB, {d['bytes_per_token']:.1f} B/token), "
                f"{d['num_host_blocks']} host blocks")

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        """View ``[L, 2, Hkv, blocks, block_size, D]`` so whole blocks index along dim 3 (fp8 as its bytes)."""
        L, two, H, slots, D = t.shape
        return raw(t).view(L, two, H, slots // self.block_size, self.block_size, D)

    def _tiers(self, src: str, dst: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, destination) tensors indexed by block along dim 3: the rows, and int8's block scales."""
        rows = {"device": self._blocks(self.data)}
        scales = {"device": self.scales}
        if "host" in (src, dst):
            rows["host"], scales["host"] = self._blocks(self._host()), self.host_scales
        pairs = [(rows[src], rows[dst])]
        if self.dtype == torch.int8:
            pairs.append((scales[src], scales[dst]))
        return pairs

    @staticmethod
    def _move(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: BlockPairs) -> None:
        """Copy block ``src`` of ``src_pool`` to block ``dst`` of ``dst_pool`` for every pair. Every source is
        read before any destination is written, so a block that is both a source and a destination gives its
        old contents.

        On a GPU: one gather and one scatter for all pairs and all layers. Between CPU pools: a copy a pair
        (through a copy of the sources only where a destination is also a source). A block is 180 strided
        runs there (layers x K/V x heads), which ATen's index_select and index_copy_ walk element by
        element: 64 blocks of the embedded model's bf16 pool (189 MB) took 38-58 ms, a copy a pair 14 ms.
        """
        if not pairs:
            return
        if src_pool.device.type == "cpu" and dst_pool.device.type == "cpu":
            sources = [src_pool.select(3, s) for s, _ in pairs]
            if src_pool.data_ptr() == dst_pool.data_ptr() and {s for s, _ in pairs} & {d for _, d in pairs}:
                sources = [b.clone() for b in sources]
            for (_, d), block in zip(pairs, sources):
                dst_pool.select(3, d).copy_(block)
            return
        idx = torch.tensor(pairs, dtype=torch.int64)
        src = idx[:, 0].to(src_pool.device)
        dst = idx[:, 1].to(dst_pool.device)
        moved = src_pool.index_select(3, src).to(dst_pool.device, non_blocking=True)
        dst_pool.index_copy_(3, dst, moved)

    def copy_blocks(self, pairs: BlockPairs) -> None:
        """Apply copy-on-write copies ``(src, dst)`` between device blocks (with their scales)."""
        for src, dst in self._tiers("device", "device"):
            self._move(src, dst, pairs)

    def swap_out(self, pairs: BlockPairs) -> None:
        """Copy ``(device_block, host_block)`` pairs device -> host."""
        for src, dst in self._tiers("device", "host"):
            self._move(src, dst, pairs)

    def swap_in(self, pairs: BlockPairs) -> None:
        """Copy ``(host_block, device_block)`` pairs host -> device."""
        for src, dst in self._tiers("host", "device"):
            self._move(src, dst, pairs)

    def export_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """The named device blocks as CPU tensors, to move them to another process's pool (prefix sharing,
        disaggregated prefill): ``kv`` ``[L, 2, Hkv, n, block_size, D]``, and for a quantized pool ``scales``
        (int8: ``[L, 2, Hkv, n]`` per block; fp8: the per-head ``[L, 2, Hkv, 1]``)."""
        return {k: v.cpu() for k, v in self.gather_blocks(block_ids).items()}

    def gather_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """:meth:`export_blocks` left on the pool's device: one index copy for all layers (a tier's
        demotion orders it before the step's forward, and moves it to the host off that path)."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.data.device)
        out = {"kv": self._blocks(self.data).index_select(3, idx).view(self.dtype)}
        if self.scales is not None:
            out["scales"] = self.scales.index_select(3, idx) if self.dtype == torch.int8 else self.scales.clone()
        return out

    def import_blocks(self, block_ids: list[int], data: dict[str, torch.Tensor]) -> None:
        """Write blocks from :meth:`export_blocks` of a pool of the same shape and dtype into ``block_ids``;
        ValueError naming the field that does not match."""
        kv = data.get("kv")
        want = self._blocks(self.data).shape[:3] + (len(block_ids),) + (self.block_size, self.head_dim)
        if kv is None or tuple(kv.shape) != want or kv.dtype != self.dtype:
            raise ValueError(f"kv: expected a {self.dtype} tensor of shape {list(want)}")
        scales = data.get("scales")
        if self.scales is not None:
            wanted = self.scales.shape[:3] + ((len(block_ids),) if self.dtype == torch.int8 else (1,))
            if scales is None or tuple(scales.shape) != tuple(wanted):
                raise ValueError(f"scales: expected a float32 tensor of shape {list(wanted)}")
            if self.dtype != torch.int8 and not torch.equal(scales.to(self.scales.device), self.scales):
                raise ValueError("scales: the fp8 per-head scales differ from this pool's")
        elif scales is not None:
            raise ValueError(f"scales: a {self.dtype} pool has no scales")
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.data.device)
        self._blocks(self.data).index_copy_(3, idx, raw(kv).to(self.data.device))
        if self.dtype == torch.int8:
            self.scales.index_copy_(3, idx, scales.to(self.scales.device))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def page_bytes(self) -> int:
        """Bytes one block holds across every layer, K and V (scales not counted): what an adapter page stores
        (issue 32: LoRA weights paged in the KV pool's memory)."""
        return self.data[:, :, :, : self.block_size].numel() * self.data.element_size()

    def _page_view(self) -> torch.Tensor:
        """The pool's rows as bytes ``[L, 2, Hkv, blocks, block_size * D * itemsize]``: a page is one block."""
        L, two, H, slots, D = self.data.shape
        return self.data.view(torch.uint8).view(L, two, H, slots // self.block_size, -1)

    def write_pages(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """Store the bytes of ``payload`` (any dtype, at most ``len(block_ids) * page_bytes``) in the blocks."""
        view = self._page_view()
        data = payload.detach().contiguous().view(-1).view(torch.uint8)
        room = len(block_ids) * self.page_bytes
        if data.numel() > room:
            raise ValueError(f"payload of {data.numel()} bytes does not fit {len(block_ids)} pages ({room} bytes)")
        padded = torch.zeros(room, dtype=torch.uint8)
        padded[: data.numel()] = data.cpu()
        L, two, H, _, C = view.shape
        idx = torch.tensor(block_ids, dtype=torch.int64, device=view.device)
        view.index_copy_(3, idx, padded.view(L, two, H, len(block_ids), C).to(view.device))

    def read_pages(self, block_ids: list[int], num_bytes: int) -> torch.Tensor:
        """The first ``num_bytes`` bytes :meth:`write_pages` stored in ``block_ids`` (uint8, on the pool's device)."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.data.device)
        return self._page_view().index_select(3, idx).reshape(-1)[:num_bytes]

    def _host(self) -> torch.Tensor:
        if self.host is None:
            raise RuntimeError("KVCache has no host tier (num_host_blocks=0); swap is unavailable")
        return self.host

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype | str
    ) -> int:
        """K and V of ``block_size`` tokens for every layer and KV head, scales included."""
        dtype = resolve_kv_cache_dtype(dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_head = head_dim * block_size * itemsize + scale_bytes_per_block_head(dtype)
        return 2 * num_layers * num_kv_heads * per_head

    @classmethod
    def num_blocks_for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype | str = torch.float32,
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
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
    ) -> int:
        """How many blocks fit in ``fraction`` of the TOTAL memory of ``device``: the same pool on every
        start of one machine, whatever else happens to be using memory at that moment."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {fraction}")
        budget = int(total_memory_bytes(device) * fraction)
        return cls.num_blocks_for_budget(budget, num_layers, num_kv_heads, head_dim, block_size, dtype)


def total_memory_bytes(device: torch.device | str = "cpu") -> int:
    """Total memory of ``device``: the CUDA device's, or MemTotal of /proc/meminfo (physical pages else)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
