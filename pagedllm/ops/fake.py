"""Fake (meta) implementations of every ``torch.ops.pagedllm`` op: the shapes and dtypes of what it returns,
computed without touching data, which is what ``torch.compile`` (FakeTensor tracing) and graph capture need.
Ops that only write into their arguments return nothing (their schemas declare the writes). torch registers a
fake only for an op that exists, so :func:`register` runs when a kernel's library has been loaded
(:func:`pagedllm.ops.load`); the C++ fragments name this module (``set_python_module``), so a process that
loaded a library another way gets the fakes too, when tracing imports this module."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.ops.gguf_blocks import BLOCK_BYTES, PACKED_BYTES

_FAKES: dict[str, list[tuple[str, Callable]]] = {}  # kernel -> its ops' (name, fake)
_registered: set[str] = set()


def _fake(kernel: str, op: str) -> Callable[[Callable], Callable]:
    def record(fn: Callable) -> Callable:
        _FAKES.setdefault(kernel, []).append((op, fn))
        return fn

    return record


def register(kernel: str) -> None:
    """Register the fakes of ``kernel``'s ops (once), whose library is loaded."""
    if kernel not in _registered:
        for op, fn in _FAKES[kernel]:
            torch.library.register_fake(f"pagedllm::{op}", fn)
        _registered.add(kernel)


@_fake("paged_attention", "write_kv")
def _write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, block_size=0) -> None:
    return None


@_fake("paged_attention", "paged_attention_out")
def _paged_attention_out(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale,
                         seq_begin, seq_end, q_tile, k_scale=None, v_scale=None) -> None:
    return None


@_fake("paged_attention", "attend_qkv")
def _attend_qkv(qkv, num_heads, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                block_size, scale, q_tile, k_scale=None, v_scale=None) -> torch.Tensor:
    return qkv.new_empty((qkv.shape[0], num_heads * k_cache.shape[2]))


@_fake("paged_attention", "attend_qkv_part")
def _attend_qkv_part(qkv, num_heads, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                     block_size, scale, q_tile, k_scale, v_scale, out, part, parts) -> None:
    return None


@_fake("gemm", "linear")
def _linear(x, w, bias=None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


@_fake("gemm", "quant_linear")
def _quant_linear(x, wq, qtype, bias=None) -> torch.Tensor:
    return x.new_empty((x.shape[0], wq.shape[0]))


@_fake("decode_layer", "decode_layer")
def _decode_layer(h, delta, input_norms, post_norms, eps, qkv_wq, o_wq, gate_up_wq, down_wq, qtypes, rows,
                  int8_activations, cos, sin, num_heads, k_caches, v_caches, slot_mapping, block_tables, seq_lens,
                  query_start_loc, block_size, scale, q_tile, k_scales, v_scales, one_region=False) -> torch.Tensor:
    return h.new_empty(h.shape)


@_fake("bf16_layers", "bf16_layers")
def _bf16_layers(h, delta, input_norms, post_norms, eps, qkv_w, o_w, gate_up_w, down_w, rows, blocks, blocks_max_rows,
                 cos, sin, num_heads,
                 k_caches, v_caches, slot_mapping, block_tables, seq_lens, query_start_loc, block_size, scale, q_tile,
                 k_scales, v_scales) -> torch.Tensor:
    return h.new_empty(h.shape, dtype=torch.bfloat16)


@_fake("gemv", "quant_gemv")
def _quant_gemv(x, wq, qtype, bias=None) -> torch.Tensor:
    return x.new_empty((1, wq.shape[0]))


@_fake("gemv", "quant_gemv_part")
def _quant_gemv_part(x, wq, qtype, y, part, parts) -> None:
    return None


@_fake("gemm", "dequantize")
def _dequantize(wq, qtype, K) -> torch.Tensor:
    return wq.new_empty((wq.shape[0], K), dtype=torch.float32)


@_fake("fused_ops", "add_rms_norm")
def _add_rms_norm(h, delta, weight, eps, bf16_out=False) -> torch.Tensor:
    return torch.empty_like(h, dtype=torch.bfloat16 if bf16_out else h.dtype)


@_fake("fused_ops", "rope")
def _rope(x, cos, sin, num_heads=-1) -> None:
    return None


@_fake("fused_ops", "rope_widen")
def _rope_widen(x, cos, sin, num_heads) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float32)


@_fake("fused_ops", "silu_mul")
def _silu_mul(gate_up, bf16_out=False) -> torch.Tensor:
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2),
                             dtype=torch.bfloat16 if bf16_out else torch.float32)


@_fake("sampling", "argmax_logsumexp")
def _argmax_logsumexp(logits) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.new_empty(logits.shape[0], dtype=torch.int64), logits.new_empty(logits.shape[0])


@_fake("sampling", "exponential_race")
def _exponential_race(logits, temperature, keys, counters) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@_fake("sampling", "filtered_race")
def _filtered_race(logits, temperature, top_k, top_p, min_p, keys, counters) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@_fake("quant_a8", "linear_a8")
def _linear_a8(x, wq, qtype, bias=None) -> torch.Tensor:
    return x.new_empty((x.shape[0], wq.shape[0]))


@_fake("quant_a8", "quantize_a8")
def _quantize_a8(x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    M, K = x.shape
    return x.new_empty((M, K), dtype=torch.int8), x.new_empty((M, K // 32)), x.new_empty((M, K // 32))


@_fake("quant_a8", "pack_a8")
def _pack_a8(wq, qtype) -> torch.Tensor:
    return wq.new_empty(((wq.shape[0] + 7) // 8, wq.shape[1] // BLOCK_BYTES[qtype] * PACKED_BYTES[qtype]))


@_fake("quant_a8", "linear_a8_packed")
def _linear_a8_packed(x, packed, qtype, N, bias=None) -> torch.Tensor:
    return x.new_empty((x.shape[0], N))


@_fake("quant_a8", "linear_a8_packed_part")
def _linear_a8_packed_part(x, packed, qtype, N, y, part, parts) -> None:
    return None


for _kernel, _ops in _FAKES.items():  # libraries loaded before this module was imported
    if all(hasattr(torch.ops.pagedllm, op) for op, _ in _ops):
        register(_kernel)


@_fake("lora_bgmv", "lora_bgmv")
def _lora_bgmv(y, x, a, bs, los, slots) -> None:
    return None


@_fake("amx_gemm", "amx_pack_bf16")
def _amx_pack_bf16(w) -> torch.Tensor:
    N, K = w.shape
    return w.new_empty(((N + 15) // 16, (K + 31) // 32, 16, 32))


@_fake("amx_gemm", "amx_linear_bf16")
def _amx_linear_bf16(x, packed, N) -> torch.Tensor:
    return x.new_empty((x.shape[0], N))


@_fake("amx_gemm", "amx_linear_silu_bf16")
def _amx_linear_silu_bf16(x, packed, N) -> torch.Tensor:
    return x.new_empty((x.shape[0], N // 2))


@_fake("amx_blocks", "amx_blocks_linear_bf16")
def _amx_blocks_linear_bf16(x, blocks, N) -> torch.Tensor:
    return x.new_empty((x.shape[0], N))


@_fake("amx_blocks", "amx_blocks_linear_silu_bf16")
def _amx_blocks_linear_silu_bf16(x, blocks, N) -> torch.Tensor:
    return x.new_empty((x.shape[0], N // 2))


@_fake("amx_attention", "prefill_attention_amx")
def _prefill_attention_amx(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale, first,
                           end) -> None:
    return None


@_fake("peak", "instruction_peak")
def _instruction_peak(flops, unit, iters) -> None:
    return None


@_fake("step_inputs", "step_inputs")
def _step_inputs(token_ids, block_table, num_blocks, lora_id, rows, query_lens, starts, block_size
                 ) -> tuple[torch.Tensor, ...]:
    ctx = torch.library.get_ctx()  # the tables' width and whether adapter ids come back depend on the rows' data
    T, B = sum(query_lens), len(rows)
    i64 = token_ids.new_empty
    return (i64(T), i64(T), i64(T), block_table.new_empty((B, ctx.new_dynamic_size())), block_table.new_empty(B),
            block_table.new_empty(B + 1), i64(ctx.new_dynamic_size()))
