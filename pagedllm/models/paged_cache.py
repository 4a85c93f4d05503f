"""``PagedCache``: a transformers ``Cache`` whose K/V live in our paged block pool.

A drop-in for ``DynamicCache`` so an unmodified ``AutoModelForCausalLM`` (any architecture
transformers implements) generates with its KV in the pool:

    cache = PagedCache(model.config, num_blocks=256, block_size=16)
    model.generate(input_ids, **hf_cache_kwargs(model, cache), ...)

Each batch row owns a block table; ``update`` scatters the step's K/V into the pool through the
slot mapping (one ``index_copy_`` per layer for the whole batch) and returns the rows' full K/V
gathered from their blocks in one ``index_select`` (HF attention wants dense tensors: the gather
is the drop-in's price; our own model reads the pool in place). Rows of a batch share one length,
as in any HF cache (left padding is masked by HF's attention mask, so it lives in the pool too).

The pool's ``dtype`` may be narrower than the model's, or quantized (int8, fp8): the K/V are then rounded by the
engine's own write path and read back dequantized, so HF attends over what the engine's kernels read (the GPU
oracle's reference for a lossy pool, ``bench/gpu_oracle.py``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from pagedllm.attention.metadata import write_kv
from pagedllm.kv.kv_cache import KVCache
from pagedllm.kv.kv_quant import read_rows


def hf_cache_kwargs(model, cache) -> dict:
    """``cache`` as the keyword this transformers' ``forward`` / ``generate`` takes: ``cache`` in recent 5.x releases,
    which warn that ``past_key_values`` goes (5.40 for ``forward``), ``past_key_values`` before; nothing for None."""
    return {} if cache is None else {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_cls: type) -> str:
    """Read once per model class: callers pass caches inside timed decode loops (``bench context``'s HF baseline)."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


class PagedLayer(CacheLayerMixin):
    """One layer's view of the shared pool; the block tables live in the owning ``PagedCache``."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, owner: "PagedCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.owner._init_pool(key_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, Hkv, q, D = key_states.shape
        own = self.owner
        start, end = self.length, self.length + q
        own._ensure_rows(B, end)
        k_cache, v_cache = own.kv_cache.layer(self.layer_idx)
        new = own._slots(start, end).flatten()  # [B * q], row-major like the permuted K/V below
        # [B * q, Hkv, D], row-major like ``new``; a quantized pool rounds them as the engine's write does
        write_kv(key_states.transpose(1, 2).reshape(B * q, Hkv, D), value_states.transpose(1, 2).reshape(B * q, Hkv, D),
                 k_cache, v_cache, new)
        self.length = end
        every = own._slots(0, end).flatten()
        keys = read_rows(k_cache, every, key_states.dtype).view(Hkv, B, end, D).transpose(0, 1)
        values = read_rows(v_cache, every, value_states.dtype).view(Hkv, B, end, D).transpose(0, 1)
        self.keys, self.values = keys, values  # what DynamicLayer exposes, for callers that peek
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(self.length + tokens_to_remove, 0)

    # batch reshuffles are done for all layers at once by PagedCache
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.owner.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.owner.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.owner.batch_select_indices(indices)


class PagedCache(Cache):
    """A transformers ``Cache`` backed by a ``KVCache`` block pool and per-row block tables.

    ``config``: the HF model config (for layer count, KV heads, head dim), or pass ``kv_cache``
    (an existing pool whose blocks this cache may use, all of them). ``dtype`` (the pool's, a KV cache dtype)
    defaults to the dtype of the first K/V it sees.
    """

    def __init__(
        self,
        config: Any = None,
        num_blocks: int = 256,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        kv_cache: KVCache | None = None,
    ):
        if kv_cache is None and config is None:
            raise ValueError("PagedCache needs the model config or an existing KVCache")
        if kv_cache is not None:
            num_layers = kv_cache.num_layers
            self._dims = None
        else:
            cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            heads = cfg.num_attention_heads
            num_layers = cfg.num_hidden_layers
            self._dims = (
                num_layers,
                getattr(cfg, "num_key_value_heads", None) or heads,
                getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            )
        self.kv_cache = kv_cache
        self.num_blocks = kv_cache.num_blocks if kv_cache is not None else num_blocks
        self.block_size = kv_cache.block_size if kv_cache is not None else block_size
        self._dtype = dtype
        self.free_blocks: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2 ...
        self.tables: list[list[int]] = []  # one block table per batch row
        self._table_tensor: torch.Tensor | None = None
        self._slot_memo: dict[tuple[int, int], torch.Tensor] = {}
        super().__init__(layers=[PagedLayer(self, i) for i in range(num_layers)])

    # ------------------------------------------------------------------ pool and tables
    def _init_pool(self, key_states: torch.Tensor) -> None:
        if self.kv_cache is None:
            L, Hkv, D = self._dims
            dtype = self._dtype or key_states.dtype
            self.kv_cache = KVCache(L, Hkv, D, self.num_blocks, self.block_size, dtype=dtype, device=key_states.device)

    def _alloc(self) -> int:
        if not self.free_blocks:
            raise RuntimeError(
                f"PagedCache is out of blocks ({self.num_blocks} of {self.block_size} tokens); "
                "pass a larger num_blocks"
            )
        return self.free_blocks.pop()

    def _ensure_rows(self, batch: int, length: int) -> None:
        """Give every row enough blocks for ``length`` tokens."""
        if not self.tables:
            self.tables = [[] for _ in range(batch)]
        elif len(self.tables) != batch:
            raise ValueError(f"PagedCache holds {len(self.tables)} rows but got a batch of {batch}")
        need = -(-length // self.block_size)
        if len(self.tables[0]) >= need:
            return
        for t in self.tables:
            while len(t) < need:
                t.append(self._alloc())
        self._tables_changed()

    def _tables_changed(self) -> None:
        self._table_tensor = torch.tensor(self.tables, dtype=torch.int64) if self.tables else None
        self._slot_memo.clear()

    def _slots(self, start: int, end: int) -> torch.Tensor:
        """Physical slots ``[B, end - start]`` of positions ``start..end-1`` of every row (memoised per step)."""
        key = (start, end)
        s = self._slot_memo.get(key)
        if s is None:
            if len(self._slot_memo) > 8:
                self._slot_memo.clear()
            pos = torch.arange(start, end)
            s = self._table_tensor[:, pos // self.block_size] * self.block_size + pos % self.block_size
            self._slot_memo[key] = s
        return s

    def _free_all(self) -> None:
        for t in self.tables:
            self.free_blocks.extend(reversed(t))
        self.tables = []
        self._tables_changed()

    # ------------------------------------------------------------------ Cache API
    def reset(self):
        for layer in self.layers:
            layer.reset()
        self._free_all()

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def _remap_rows(self, rows: list[int]) -> None:
        """New row ``i`` = a private copy of old row ``rows[i]`` (blocks copied for all layers at once)."""
        if not self.tables:
            return
        old = self.tables
        used = -(-max(layer.length for layer in self.layers) // self.block_size)
        new_tables, pairs = [], []
        for r in rows:
            t = [self._alloc() for _ in old[r]]
            pairs.extend(zip(old[r][:used], t[:used]))
            new_tables.append(t)
        self.kv_cache.copy_blocks(pairs)
        for t in old:
            self.free_blocks.extend(reversed(t))
        self.tables = new_tables
        self._tables_changed()

    def batch_select_indices(self, indices: torch.Tensor):
        self._remap_rows([int(i) for i in torch.as_tensor(indices).flatten().tolist()])

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int):
        self._remap_rows([r for r in range(len(self.tables)) for _ in range(repeats)])

    @property
    def block_tables(self) -> list[list[int]]:
        return [list(t) for t in self.tables]
