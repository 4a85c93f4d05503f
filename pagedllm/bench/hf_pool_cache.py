"""HF's KV cache holding what our pool holds: the oracle for an engine whose pool is lossy (int8, fp8, or a float
dtype narrower than the model's).

Compared with plain HF, such an engine differs by its pool's rounding as well as by its kernels, and on random
weights (flat logits) e5m2's rounding alone moves a prompt's first token (the GPU check's oracle, 2026-11-29). HF
over :class:`PoolCache` writes each layer's new K/V through the engine's own write path into a one-sequence pool of
the same dtype and block size and attends over the rows read back, so the two differ by their kernels only.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from pagedllm.attention.metadata import write_kv
from pagedllm.attention.reference import gather_sequence_kv
from pagedllm.kv.kv_cache import KVCache


class PoolCache(DynamicCache):
    """A batch-1 ``DynamicCache`` whose ``update`` returns the layer's K/V as a ``kv_dtype`` pool stores them."""

    def __init__(self, config, kv_dtype: str, block_size: int, capacity: int, device: torch.device) -> None:
        super().__init__()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        blocks = -(-capacity // block_size)
        self.pool = KVCache(config.num_hidden_layers, getattr(config, "num_key_value_heads", heads), head_dim,
                            blocks, block_size, kv_dtype, device=device)
        self.table = torch.arange(blocks, device=device)  # logical block i in physical block i
        self.lengths = [0] * config.num_hidden_layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Keep HF's own bookkeeping (lengths, masks), then write ``[1, Hkv, T, D]`` into the pool and return the
        whole sequence's rows read back in the model's dtype."""
        super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[0] != 1:
            raise ValueError(f"PoolCache holds one sequence, got a batch of {key_states.shape[0]}")
        k_cache, v_cache = self.pool.layer(layer_idx)
        start, new = self.lengths[layer_idx], key_states.shape[2]
        slots = torch.arange(start, start + new, device=key_states.device)
        write_kv(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), k_cache, v_cache, slots)
        self.lengths[layer_idx] = start + new
        return tuple(gather_sequence_kv(c, self.table, start + new, self.pool.block_size, key_states.dtype)[None]
                     for c in (k_cache, v_cache))
