"""Quantized KV cache formats: int8 with a scale per (block, kv head), fp8 with a scale per kv head.

**int8: symmetric, one fp32 scale per (block, kv head, K or V)**, ``scale = amax(|rows|) / 127``. A scale per
(token, kv head) would be simpler to write (final when the token arrives) and at least as accurate, but with
head_dim 64 it costs 4 bytes per 64: 68 bytes a row, 3.76x the tokens of fp32 in the same memory, below the
3.9x an int8 cache must give. Per block of 16 tokens it costs 0.25 bytes a row (3.98x fp32, 1.99x bf16).
A block fills token by token, so its scale may have to grow: the write path computes, per run of new rows
landing in one block, ``new = max(old, amax(run) / 127)`` (a write at offset 0 starts a block afresh) and,
when the scale grew, re-rounds the block's earlier codes by ``old / new`` (at most half a step more error on
those rows) before rounding the new rows with ``new``. Full blocks never change again (prefix caching only
shares full blocks; a shared partial block is copied first). Accuracy on SmolLM2: bench/README.md
(``pagedllm bench kvquant``).

**fp8 (e4m3 / e5m2): a scale per (layer, K or V, kv head)**, as vLLM stores them: a float format keeps its
relative precision at any magnitude, so the scale only guards the range (e4m3 saturates at 448). The
scales default to 1.0 (vLLM's value when a checkpoint brings none) and live in the cache
(``KVCache.scales``), so calibrated ones can be written there.

Kernels get a layer's pool as :class:`QuantizedKV` (codes + scales) and dequantize rows as they read them;
both schemes hand over ``scale [Hkv, num_blocks]`` (a per-head scale is a view with block stride 0), so
every kernel reads ``scale[head, physical block]`` the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config.device import QUANTIZED_KV_DTYPES

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_DTYPES = QUANTIZED_KV_DTYPES
INT8_MAX = 127.0


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or its bytes (a uint8 view) for fp8, which torch's index copies do not take."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def scale_bytes_per_block_head(dtype: torch.dtype) -> int:
    """Bytes of scale stored per (block, kv head, K or V): 4 for int8, 0 for float and fp8 (per-head)."""
    return 4 if dtype == torch.int8 else 0


@dataclass(frozen=True)
class QuantizedKV:
    """One layer's K (or V) pool in a quantized format: ``data [Hkv, num_slots, D]`` codes and
    ``scale [Hkv, num_blocks]`` fp32 (block stride 0 for per-head fp8 scales). Value = code * scale."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def block_size(self) -> int:
        return self.data.shape[1] // self.scale.shape[1]

    def rows(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized ``[Hkv, len(slots), D]`` rows of the given slots, for the paths that gather a context
        anyway (the reference oracle, SDPA prefill chunks)."""
        codes = self.data.index_select(1, slots).to(torch.float32)
        scale = self.scale.index_select(1, torch.div(slots, self.block_size, rounding_mode="floor"))
        return (codes * scale[..., None]).to(dtype)


def read_rows(cache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[Hkv, len(slots), D]`` rows of one layer's K or V pool in ``dtype``: a float pool's own rows, or a
    :class:`QuantizedKV`'s dequantized."""
    if isinstance(cache, QuantizedKV):
        return cache.rows(slots, dtype)
    return cache.index_select(1, slots).to(dtype)


def _runs(slot_mapping: torch.Tensor, block_size: int):
    """Runs of consecutive new rows landing in one block: (run of each row, block of each run, offset of
    each run's first row)."""
    block = torch.div(slot_mapping, block_size, rounding_mode="floor")
    starts = torch.ones_like(block, dtype=torch.bool)
    starts[1:] = block[1:] != block[:-1]
    run = torch.cumsum(starts, 0) - 1
    first = torch.nonzero(starts).squeeze(1)
    return run, block[first], slot_mapping[first] % block_size


def write_int8(x: torch.Tensor, cache: QuantizedKV, slot_mapping: torch.Tensor) -> None:
    """Quantize rows ``x [T, Hkv, D]`` into the int8 pool with per-(block, head) scales (see the module
    docstring); the C++ kernel's write path computes the same bits."""
    bs = cache.block_size
    x = x.to(torch.float32).transpose(0, 1)  # [Hkv, T, D]
    run, blocks, off0 = _runs(slot_mapping, bs)
    amax = x.abs().amax(-1)  # [Hkv, T]
    run_max = amax.new_zeros(x.shape[0], len(blocks)).scatter_reduce_(1, run.expand_as(amax), amax, "amax")
    old = torch.where(off0 > 0, cache.scale[:, blocks], 0.0)  # [Hkv, runs]
    # divided by a device tensor, not a Python number: CUDA computes ``t / number`` as ``t * (1 / number)``, an ulp
    # off the CPU's division, and the pools written on the two devices would differ (seen on an H200)
    new = torch.maximum(old, run_max / run_max.new_tensor(INT8_MAX))
    grew = torch.nonzero(((new > old) & (off0 > 0)).any(0)).squeeze(1)
    if len(grew):  # re-round the earlier rows of blocks whose scale grew
        in_block = torch.arange(bs, device=x.device)
        slots = (blocks[grew, None] * bs + in_block).flatten()
        ratio = torch.where(new > 0, old / torch.where(new > 0, new, 1.0), 0.0)[:, grew]  # [Hkv, g]
        codes = cache.data[:, slots].view(x.shape[0], len(grew), bs, -1).to(torch.float32)
        keep = (in_block[None, :] < off0[grew, None]).flatten()
        redo = torch.round(codes * ratio[..., None, None]).to(torch.int8).view(x.shape[0], len(slots), -1)
        cache.data.index_copy_(1, slots[keep], redo[:, keep])
    cache.scale.index_copy_(1, blocks, new)
    safe = torch.where(new > 0, new, 1.0)[:, run]  # [Hkv, T]
    codes = torch.round(x / safe[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    cache.data.index_copy_(1, slot_mapping, codes)


def write_fp8(x: torch.Tensor, cache: QuantizedKV, slot_mapping: torch.Tensor) -> None:
    """Rows ``x [T, Hkv, D]`` divided by their head's scale, saturated, rounded to the fp8 format."""
    fmax = torch.finfo(cache.dtype).max
    scale = cache.scale[:, 0].to(torch.float32)[:, None, None]
    codes = (x.to(torch.float32).transpose(0, 1) / scale).clamp_(-fmax, fmax).to(cache.dtype)
    raw(cache.data).index_copy_(1, slot_mapping, raw(codes))  # torch has no fp8 index_copy_: move the bytes


def write_kv_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: QuantizedKV, v_cache: QuantizedKV,
                       slot_mapping: torch.Tensor) -> None:
    """Quantize the step's new K/V ``[T, Hkv, D]`` into the pool slots (codes and scales)."""
    write = write_int8 if k_cache.dtype == torch.int8 else write_fp8
    write(k, k_cache, slot_mapping)
    write(v, v_cache, slot_mapping)
