"""CUDA backend: a Triton paged-decode kernel (block-table indirection, GQA) and a Triton paged
prefill kernel for the chunks (``triton_prefill.py``), both reading K/V in place.

Import-safe without triton or CUDA: the kernel is defined only when ``import triton`` works, and
``TritonBackend()`` raises a clear RuntimeError when it cannot run (it runs on the CPU under
``TRITON_INTERPRET=1``, which is how CI tests it). One program per (decode sequence, kv head)
computes all ``group`` query heads of that kv head together, walking the sequence's keys
``BLOCK_N`` positions at a time through the block table, with an online softmax in fp32.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata, write_kv
from pagedllm.attention.reference import gather_sequence_kv
from pagedllm.attention.triton_prefill import paged_prefill
from pagedllm.attention.triton_splitk import splitk_decode
from pagedllm.attention.triton_write import write_kv_fused

SPLITK_MIN_LEN = 1024  # decodes over contexts this long split their keys across programs (flash-decoding)
from pagedllm.kv.kv_quant import QuantizedKV, raw

try:  # pragma: no cover - exercised only on machines with triton
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install without a driver
    triton = None
    tl = None
    HAS_TRITON = False


# int8 / fp8 pools (pagedllm/kv/kv_quant.py): codes are dequantized as they are loaded, times the scale of
# their (kv head, physical block); fp8 comes in as bytes and is widened through fp16 bits (e5m2 is an fp16's
# high byte; e4m3's bits moved into fp16's place give value / 2^8), so the interpreter and old GPUs need no fp8.
FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}  # 0: a float pool


def _paged_decode(
    Q, K, V, O, BT, SL, KS, VS,
    sq0, sq1, sk0, sk1, sv0, sv1, so0, so1, sbt, sks0, sks1, svs0, svs1,
    scale, block_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, FORMAT: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(SL + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < D
    heads = kvh * GROUP + g
    q = tl.load(Q + seq * sq0 + heads[:, None] * sq1 + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < seq_len
        phys = tl.load(BT + seq * sbt + n // block_size, mask=nmask, other=0).to(tl.int64)
        slot = phys * block_size + n % block_size
        kvmask = nmask[:, None] & dmask[None, :]
        kc = tl.load(K + kvh * sk0 + slot[:, None] * sk1 + d[None, :], mask=kvmask, other=0)
        if FORMAT == 2:  # (the interpreter cannot call a jitted helper: the dequant is written out twice)
            kc = kc.to(tl.uint16)
            k = (((kc & 0x80) << 8) | ((kc & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        elif FORMAT == 3:
            k = (kc.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            k = kc.to(tl.float32)
        if FORMAT != 0:
            k = k * tl.load(KS + kvh * sks0 + phys * sks1, mask=nmask, other=0.0)[:, None]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vc = tl.load(V + kvh * sv0 + slot[:, None] * sv1 + d[None, :], mask=kvmask, other=0)
        if FORMAT == 2:
            vc = vc.to(tl.uint16)
            v = (((vc & 0x80) << 8) | ((vc & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        elif FORMAT == 3:
            v = (vc.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            v = vc.to(tl.float32)
        if FORMAT != 0:
            v = v * tl.load(VS + kvh * svs0 + phys * svs1, mask=nmask, other=0.0)[:, None]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        O + seq * so0 + heads[:, None] * so1 + d[None, :],
        out.to(O.dtype.element_ty),
        mask=gmask[:, None] & dmask[None, :],
    )


if HAS_TRITON:  # pragma: no cover
    _paged_decode_kernel = triton.jit(_paged_decode)


def interpreted() -> bool:
    """Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` set before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class TritonBackend:
    name = "triton"

    def __init__(self, block_n: int = 64, splitk_min_len: int = SPLITK_MIN_LEN) -> None:
        if not HAS_TRITON:
            raise RuntimeError("the 'triton' attention backend needs the triton package (pip install triton)")
        if not (torch.cuda.is_available() or interpreted()):
            raise RuntimeError("the 'triton' attention backend needs a CUDA GPU (or TRITON_INTERPRET=1, for tests); "
                               "use 'cpu' or 'flex' on CPU")
        self.block_n = block_n
        self.splitk_min_len = splitk_min_len

    def prepare(self, meta: AttentionMetadata) -> None:
        return None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        quantized = isinstance(k_cache, QuantizedKV)
        if quantized:  # quantizing write (codes + block scales)
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            if k.stride(-1) != 1 or v.stride(-1) != 1:
                k, v = k.contiguous(), v.contiguous()
            write_kv_fused(k, v, k_cache, v_cache, meta.slot_mapping.to(k.device))
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q)
        H, D = q.shape[1], q.shape[2]
        Hkv = k_cache.shape[0]
        group = H // Hkv
        nd = meta.num_decodes
        max_decode_len = max(meta.seq_lens_list[:nd], default=0)
        if nd > 0 and max_decode_len >= self.splitk_min_len and not quantized:
            splitk_decode(q, k_cache, v_cache, out, meta.block_tables.to(q.device), meta.seq_lens.to(q.device), nd,
                          max_decode_len, meta.block_size, scale)
        elif nd > 0:
            bt = meta.block_tables.to(q.device)
            sl = meta.seq_lens.to(q.device)
            if quantized:
                kd, vd, ks, vs = raw(k_cache.data), raw(v_cache.data), k_cache.scale, v_cache.scale
            else:
                kd, vd, ks, vs = k_cache, v_cache, k_cache, v_cache  # scales unused (FORMAT 0)
            _paged_decode_kernel[(nd, Hkv)](
                q, kd, vd, out, bt, sl, ks, vs,
                q.stride(0), q.stride(1), kd.stride(0), kd.stride(1),
                vd.stride(0), vd.stride(1), out.stride(0), out.stride(1), bt.stride(0),
                ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
                float(scale), meta.block_size,
                GROUP=group, GROUP_PAD=max(2, _next_pow2(group)), D=D, D_PAD=max(16, _next_pow2(D)),
                BLOCK_N=self.block_n, FORMAT=FORMATS.get(k_cache.dtype, 0),
            )
        if nd < meta.num_seqs and not quantized:  # prefill chunks: varlen causal attention over the paged K/V
            paged_prefill(q, k_cache, v_cache, out, meta.block_tables.to(q.device), meta.query_start_loc.to(q.device),
                          meta.seq_lens.to(q.device), nd, meta.num_seqs - nd, meta.max_query_len, meta.block_size,
                          scale)
        elif nd < meta.num_seqs:  # int8/fp8 prefill chunks: gather (dequantized) per chunk + SDPA
            starts = meta.query_start_loc.tolist()
            for i in range(nd, meta.num_seqs):
                q_len, s_len = meta.query_lens_list[i], meta.seq_lens_list[i]
                table = meta.block_tables[i].to(q.device)
                ki = gather_sequence_kv(k_cache, table, s_len, meta.block_size, q.dtype).repeat_interleave(group, 0)
                vi = gather_sequence_kv(v_cache, table, s_len, meta.block_size, q.dtype).repeat_interleave(group, 0)
                qi = q[starts[i] : starts[i] + q_len].transpose(0, 1)
                qpos = torch.arange(s_len - q_len, s_len, device=q.device)[:, None]
                mask = torch.arange(s_len, device=q.device)[None, :] <= qpos
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
                out[starts[i] : starts[i] + q_len] = oi.transpose(0, 1)
        return out
