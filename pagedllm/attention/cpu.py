"""CPU backend: a C++ paged-attention kernel reading K/V in place through the block tables.

The kernel (``pagedllm/ops/csrc/paged_attention.cpp``, ops ``torch.ops.pagedllm.write_kv / attend_qkv /
paged_attention_out``) is built at set-up or on first use (:mod:`pagedllm.ops.build`). Work is split over
(sequence, query tile, kv head) with OpenMP, and decodes over long contexts also over parts of the context
(split-K, combined in the kernel; the parts depend on the sequence alone, so its output does not change with the
batch or the thread count); the ``group`` query heads of a kv head are computed together so each K/V row is read
once; softmax is online with fp32 accumulation; caches may be fp32 or bf16, or int8 / fp8
(:class:`~pagedllm.kv.kv_quant.QuantizedKV`: the kernel quantizes the rows it writes and dequantizes the
rows it reads, chunk by chunk in L1; the pool is never dequantized into a copy).

Decodes always go through the kernel. Prefill chunks go through it too unless the chunk is
long enough that torch's CPU flash SDPA over a gathered context is faster (``sdpa_prefill_min_len``; measured in
``pagedllm/bench/attention.py``). A bf16 pool on a CPU with native bf16 (AVX512-BF16 / AMX) sends chunks of
:data:`BF16_SDPA_MIN_LEN` queries and more there by default, computed in bf16 as vLLM's CPU build and HF bf16 do
(queries rounded to bf16; the kernel's arithmetic is fp32 FMAs): torch's flash SDPA runs its bf16 tiles through
oneDNN's brgemm (AMX on a Xeon), ~3x the kernel's prefill throughput at 256-token prompts. On AMX Xeons those
chunks go instead to our own tile kernel (``ops/csrc/amx_attention.cpp``, head_dim 64, block sizes of multiples of
32; ``PAGEDLLM_AMX_ATTENTION=0`` turns it off), which reads K/V in place: no gather, casts or copies around it (one
270-token prompt's prefill 87 -> 74 ms). On AVX512-BF16 CPUs without tiles (Zen 4 / 5) the same kernel runs its
tile products with VDPBF16PS: a layer's attention 3-4.5x faster than SDPA there (9 / 3 heads, 2 threads: 1 x 270
tokens 0.34 vs 1.54 ms, 8 x 256 2.4 vs 9.9, 1 x 1,024 4.1 vs 12.5; W1 1.15x). fp32 pools (the exact path) keep
the kernel.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import causal_mask, gather_sequence_kv
from pagedllm.config.device import cpu_has_native_bf16
from pagedllm.kv.kv_quant import QuantizedKV

# Prefill chunks over a bf16 pool go to torch's bf16 flash SDPA on a CPU with native bf16 when they have at least
# BF16_SDPA_MIN_LEN queries and BF16_SDPA_MIN_PAIRS (query, key) pairs (PAGEDLLM_BF16_SDPA_MIN_LEN=0: never). One
# sequence, SmolLM2's heads (9 q, 3 kv, D 64), a layer's write + attend, AMX Xeon, 2 threads (kernel / SDPA ms):
# 64 x 64 0.071 / 0.108, 128 x 128 0.18 / 0.18, 32 x 512 0.24 / 0.25, 256 x 256 0.61 / 0.40, 64 x 1024 0.91 / 0.57,
# 512 x 2048 13.3 / 5.4. SDPA's gathers and casts cost ~50 us a call; its flash tiles win from ~16k pairs.
# The AMX kernel has no such cost and takes every chunk of BF16_SDPA_MIN_LEN queries: one-at-a-time prefills of
# 128 / 180 random tokens 52-56 / 67-75 -> 48-50 / 61-67 ms; a step of 2,048 W1 prompt tokens 80 -> 53 ms of
# attention (AMX Xeon, 2 threads).
BF16_SDPA_MIN_LEN = int(os.environ.get("PAGEDLLM_BF16_SDPA_MIN_LEN", "32"))
BF16_SDPA_MIN_PAIRS = 1 << 15


AMX_HEAD_DIM = 64


@functools.cache
def amx_prefill_available() -> bool:
    """Whether bf16 prefill chunks go to ``ops/csrc/amx_attention.cpp``: an AMX or AVX512-BF16 CPU (tiles, or
    VDPBF16PS on the same layouts), kernels built for it, not turned off (``PAGEDLLM_AMX_ATTENTION=0``)."""
    if os.environ.get("PAGEDLLM_AMX_ATTENTION") == "0" or not ops.native.builds_native():
        return False
    return cpu_has_native_bf16() and ops.load("amx_attention")


def _prefill_attention_amx(*args) -> None:
    torch.ops.pagedllm.prefill_attention_amx.default(*args)


def load_kernel() -> None:
    """Build (first time, ~1 min) or load the cached C++ kernel's ops; RuntimeError if it cannot be built."""
    try:
        ops.require("paged_attention")
    except RuntimeError as e:
        raise RuntimeError(f"the 'cpu' attention backend is unavailable: {e}. Install a C++ compiler or choose "
                           "the 'reference' or 'flex' backend.") from e


def kernel_args(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The kernel's (k_cache, v_cache, scale keyword arguments) for a float or quantized pool."""
    if isinstance(k_cache, QuantizedKV):
        return k_cache.data, v_cache.data, {"k_scale": k_cache.scale, "v_scale": v_cache.scale}
    return k_cache, v_cache, {}


class CpuBackend:
    name = "cpu"
    graph_safe = True  # decode reads only the metadata's tensors

    def __init__(self, q_tile: int = 16, sdpa_prefill_min_len: int | None = None) -> None:
        self.q_tile = q_tile
        # prefill chunks with at least this many queries use gather + flash SDPA in the query's dtype (None: never)
        self.sdpa_prefill_min_len = sdpa_prefill_min_len
        # prefill chunks over a bf16 pool with BF16_SDPA_MIN_LEN queries, BF16_SDPA_MIN_PAIRS pairs use SDPA in bf16
        self.bf16_sdpa = BF16_SDPA_MIN_LEN > 0 and cpu_has_native_bf16()
        # ... and through our own kernel instead of SDPA (see amx_prefill_available)
        self.amx_prefill = self.bf16_sdpa and amx_prefill_available()
        load_kernel()

    def _sdpa_mode(self, k_cache, meta: AttentionMetadata) -> str | None:
        """How long prefill chunks over this pool run: ``"query"`` (SDPA in the query's dtype, from
        ``sdpa_prefill_min_len`` queries), ``"bf16"`` (SDPA in bf16 over a bf16 pool), ``"amx"`` (the same chunks on
        the AMX kernel, where it serves the pool's head_dim and block size) or None (the paged kernel)."""
        if self.sdpa_prefill_min_len is not None:
            return "query"
        if self.bf16_sdpa and not isinstance(k_cache, QuantizedKV) and k_cache.dtype == torch.bfloat16:
            if self.amx_prefill and k_cache.shape[2] == AMX_HEAD_DIM and meta.block_size % 32 == 0:
                return "amx"
            return "bf16"
        return None

    def _runs(self, meta: AttentionMetadata, mode: str | None) -> list[tuple[int, int, bool]]:
        """The step's sequences as runs ``(begin, end, sdpa)``: consecutive kernel sequences go in one call, SDPA
        ones one by one (worked out once per step, not per layer)."""
        key = ("cpu_sdpa_runs", mode)
        if key not in meta.extra:
            if mode is None:
                use = [False] * meta.num_seqs
            elif mode == "bf16":
                use = [q >= BF16_SDPA_MIN_LEN and q * s >= BF16_SDPA_MIN_PAIRS
                       for q, s in zip(meta.query_lens_list, meta.seq_lens_list)]
            elif mode == "amx":  # no gathers or casts to amortize: every chunk of BF16_SDPA_MIN_LEN queries
                use = [q >= BF16_SDPA_MIN_LEN for q in meta.query_lens_list]
            else:
                use = [q >= self.sdpa_prefill_min_len for q in meta.query_lens_list]
            runs, b = [], 0
            for e in range(1, meta.num_seqs + 1):
                if e == meta.num_seqs or use[e] != use[b]:
                    runs.append((b, e, use[b]))
                    b = e
            meta.extra[key] = runs
        return meta.extra[key]

    def kernel_only(self, k_cache, meta: AttentionMetadata) -> bool:
        """Whether every sequence of this step (over a pool like ``k_cache``) goes through the paged kernel, so that
        :meth:`forward_qkv` is one ``attend_qkv`` call: no prefill chunk for SDPA or the AMX kernel."""
        return not any(run[2] for run in self._runs(meta, self._sdpa_mode(k_cache, meta)))

    def prepare(self, meta: AttentionMetadata) -> None:
        return None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kd, vd, scales = kernel_args(k_cache, v_cache)
        torch.ops.pagedllm.write_kv.default(k, v, kd, vd, meta.slot_mapping, block_size=meta.block_size, **scales)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        self.attend(q, k_cache, v_cache, out, meta, scale, 0, meta.num_seqs)
        return out

    def attend(self, q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float, first: int, end: int) -> None:
        """Sequences ``[first, end)`` of the step into ``out``, their K/V already in the pool, each run of them on its
        path (``bench steptime`` times the decode rows and the prefill chunks apart through this)."""
        mode = self._sdpa_mode(k_cache, meta)
        for b, e, sdpa in self._runs(meta, mode):
            b, e = max(b, first), min(e, end)
            if b >= e:
                continue
            if sdpa and mode == "amx":
                _prefill_attention_amx(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, meta.block_size, float(scale), b, e)
            elif sdpa:
                dtype = torch.bfloat16 if mode == "bf16" else q.dtype
                self._sdpa_chunks(q, k_cache, v_cache, out, meta, scale, b, e, dtype)
            else:
                self._kernel(q, k_cache, v_cache, out, meta, scale, b, e)

    def forward_qkv(self, qkv: torch.Tensor, num_heads: int, k_cache, v_cache, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
        """Attention straight from the fused projection output ``qkv [T, (H + 2 Hkv) D]`` (rope applied):
        one C++ call (write K/V, attend) returning ``[T, H * D]``; at batch 1 the views and separate calls
        of :meth:`forward` cost as much as the attention. Steps with a prefill chunk for SDPA take that path."""
        if not self.kernel_only(k_cache, meta) or qkv.dim() != 2 or qkv.stride(1) != 1:
            T, D = qkv.shape[0], k_cache.shape[2]
            Hkv = k_cache.shape[0]
            q = qkv[:, : num_heads * D].view(T, num_heads, D)
            k = qkv[:, num_heads * D : (num_heads + Hkv) * D].view(T, Hkv, D)
            v = qkv[:, (num_heads + Hkv) * D :].view(T, Hkv, D)
            return self.forward(q, k, v, k_cache, v_cache, meta, scale).reshape(T, num_heads * D)
        kd, vd, scales = kernel_args(k_cache, v_cache)
        return torch.ops.pagedllm.attend_qkv.default(qkv, num_heads, kd, vd, meta.slot_mapping, meta.block_tables,
                                             meta.seq_lens, meta.query_start_loc, meta.block_size, float(scale),
                                             self.q_tile, **scales)

    def _sdpa_chunks(self, q, k_cache, v_cache, out, meta, scale, first, end, dtype) -> None:
        """Sequences ``[first, end)`` through flash SDPA in ``dtype`` over their gathered context."""
        group = q.shape[1] // k_cache.shape[0]
        starts = meta.query_start_loc.tolist()
        for i in range(first, end):
            q_len, s_len = meta.query_lens_list[i], meta.seq_lens_list[i]
            # [1, heads, len, D]: torch's CPU flash kernel takes 4-d inputs only (3-d ones fall back to the
            # unfused math path, ~10x slower)
            ki = gather_sequence_kv(k_cache, meta.block_tables[i], s_len, meta.block_size, dtype)[None]
            vi = gather_sequence_kv(v_cache, meta.block_tables[i], s_len, meta.block_size, dtype)[None]
            qi = q[starts[i] : starts[i] + q_len].transpose(0, 1).to(dtype)[None]
            if q_len == s_len:
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=group > 1)
            else:
                mask = causal_mask(q_len, s_len, q.device)
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=group > 1)
            out[starts[i] : starts[i] + q_len] = oi[0].transpose(0, 1)

    def _kernel(self, q, k_cache, v_cache, out, meta, scale, b, e) -> None:
        """The C++ kernel over sequences ``[b, e)`` of the batch."""
        kd, vd, scales = kernel_args(k_cache, v_cache)
        torch.ops.pagedllm.paged_attention_out.default(
            out, q, kd, vd, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.block_size, float(scale), b, e, self.q_tile, **scales,
        )
