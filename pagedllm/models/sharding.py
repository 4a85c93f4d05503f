"""How each weight of a Llama-family model is split for rank r of N (tensor parallelism, Megatron style).

- qkv and gate_up are column-parallel: rank r keeps the output rows of its q heads, of its KV heads' k and v
  (the fused matrix is sliced per part, so q, k and v stay consistent), and its slice of gate and of up.
- o_proj and down_proj are row-parallel: rank r keeps the input columns matching its heads / its slice of the
  intermediate features, and the partial outputs are summed by an all-reduce (``LlamaDecoderLayer.tp``).
  A bias is added once, on rank 0.
- embed and lm_head are vocab-parallel: rank r keeps rows ``[r * ceil(V / N), ...)``; lookups and logits are
  assembled by the group (``LlamaForCausalLM.embed_tokens`` / ``compute_logits``).
- KV heads are sharded, or replicated when N exceeds their number (as vLLM does): each rank holds
  ``max(1, Hkv // N)`` KV heads, so its KV cache is that many heads wide; block tables are the same everywhere.

GGUF block matrices (:class:`~pagedllm.models.quant.QuantizedWeight`) stay in blocks: a row is whole blocks,
so row slices are exact. Row-parallel layers slice input columns, which stays in blocks when the slice falls on
the 32-column block boundaries (SmolLM2 at N=3, Qwen2.5-0.5B at N=2 do); otherwise that one matrix is
dequantized to fp32 before slicing (same values, more memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import Checkpoint
from pagedllm.models.quant import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """KV heads each rank holds (its KV cache width): sharded, or one replicated head when N > Hkv."""
    return max(1, num_kv_heads // world_size)


@dataclass(frozen=True)
class ShardPlan:
    """The index ranges rank ``rank`` of ``world_size`` keeps (heads, intermediate features, vocab rows)."""

    rank: int
    world_size: int
    q_heads: range
    kv_heads: range
    inter: range
    vocab: range

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world_size: int) -> "ShardPlan":
        """ValueError naming the config field that ``world_size`` does not divide."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        H, Hkv, N = cfg.num_heads, cfg.num_kv_heads, world_size
        if H % N:
            raise ValueError(f"tensor_parallel_size {N} does not divide num_heads {H}")
        if (Hkv % N) if N <= Hkv else (N % Hkv):
            raise ValueError(f"tensor_parallel_size {N} and num_kv_heads {Hkv}: one must divide the other")
        if cfg.intermediate_size % N:
            raise ValueError(f"tensor_parallel_size {N} does not divide intermediate_size {cfg.intermediate_size}")
        h, kv, i = H // N, kv_heads_per_rank(Hkv, N), cfg.intermediate_size // N
        first_kv = rank * Hkv // N  # the KV head of this rank's first q head: r // (N / Hkv) when replicated
        v = -(-cfg.vocab_size // N)
        return cls(rank, N, range(rank * h, (rank + 1) * h), range(first_kv, first_kv + kv),
                   range(rank * i, (rank + 1) * i), range(min(rank * v, cfg.vocab_size), min((rank + 1) * v, cfg.vocab_size)))


def take_rows(w: Weight, rows: torch.Tensor) -> Weight:
    """Output rows ``rows`` of a matrix (or entries of a vector), dense or in blocks."""
    if isinstance(w, QuantizedWeight):
        return w.take_rows(rows)
    return nn.Parameter(w.detach().index_select(0, rows), requires_grad=False)


def take_cols(w: Weight, cols: range) -> Weight:
    """Input columns ``cols`` of a matrix: in blocks when they fall on block boundaries, else dense fp32."""
    if isinstance(w, QuantizedWeight):
        if cols.start % 32 == 0 and cols.stop % 32 == 0:
            return w.take_cols(cols.start, cols.stop)
        w = w.dequantize()
    return nn.Parameter(w.detach()[:, cols.start : cols.stop].contiguous(), requires_grad=False)


def _span(r: range, width: int, offset: int = 0) -> torch.Tensor:
    """Row indices of units ``r`` of ``width`` rows each, starting at row ``offset``."""
    return torch.arange(offset + r.start * width, offset + r.stop * width)


def shard_model(model: LlamaForCausalLM, tp: TPGroup) -> LlamaForCausalLM:
    """Cut ``model`` (loaded whole, e.g. by ``from_checkpoint``) down to rank ``tp.rank``'s shard, in place, and
    wire its collectives. Packed gguf-a8 matrices cannot be sliced: :func:`load_shard` packs after sharding."""
    cfg = model.config
    plan = ShardPlan.of(cfg, tp.rank, tp.world_size)
    if model.quantization == "gguf-a8":
        raise ValueError("quantization='gguf-a8' matrices are packed and cannot be sliced; use load_shard")
    D, q_size, kv_size = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv_rows = torch.cat([_span(plan.q_heads, D), _span(plan.kv_heads, D, q_size),
                          _span(plan.kv_heads, D, q_size + kv_size)])
    gate_up_rows = torch.cat([_span(plan.inter, 1), _span(plan.inter, 1, cfg.intermediate_size)])
    o_cols = range(plan.q_heads.start * D, plan.q_heads.stop * D)
    qk_norm_rows = torch.cat([_span(plan.q_heads, 1), _span(plan.kv_heads, 1, cfg.num_heads)])
    for layer in model.layers:
        layer.qkv_weight = take_rows(layer.qkv_weight, qkv_rows)
        if layer.qkv_bias is not None:
            layer.qkv_bias = take_rows(layer.qkv_bias, qkv_rows)
        if layer.qk_norm is not None:
            layer.qk_norm = take_rows(layer.qk_norm, qk_norm_rows)
        layer.o_weight = take_cols(layer.o_weight, o_cols)
        if tp.rank:
            layer.o_bias = None  # the all-reduce sums the ranks' outputs: the bias goes in once
        layer.gate_up_weight = take_rows(layer.gate_up_weight, gate_up_rows)
        layer.down_weight = take_cols(layer.down_weight, plan.inter)
        layer.num_heads, layer.num_kv_heads = len(plan.q_heads), len(plan.kv_heads)
        layer.q_size, layer.kv_size = len(plan.q_heads) * D, len(plan.kv_heads) * D
        layer.tp = tp
    vocab_rows = torch.arange(plan.vocab.start, plan.vocab.stop)
    tied = model.lm_head is model.embed
    model.embed = take_rows(model.embed, vocab_rows)
    model.lm_head = model.embed if tied else take_rows(model.lm_head, vocab_rows)
    model.vocab_range = (plan.vocab.start, plan.vocab.stop)
    model.tp = tp
    return model


def load_shard(ckpt: Checkpoint, tp: TPGroup, dtype: torch.dtype = torch.float32,
               quantization: str = "auto") -> LlamaForCausalLM:
    """Rank ``tp.rank``'s shard of a loaded checkpoint (``LlamaForCausalLM.from_checkpoint`` arguments); gguf-a8
    and gguf-bf16 load the blocks, shard them, then pack them."""
    model = shard_model(LlamaForCausalLM.from_checkpoint(ckpt, dtype, quantization, pack=False), tp)
    model.pack_blocks(quantization)
    return model
