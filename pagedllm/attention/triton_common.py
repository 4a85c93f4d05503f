"""What every paged Triton kernel shares (decode, split-K decode, prefill): the ``@triton.jit`` helpers that
walk one sequence's keys through its block table, loading K/V tiles from a float or int8 / fp8 pool and
dequantizing them as they are loaded, with an online softmax in fp32; and the host-side view of a pool
that hands both kinds of pool to a kernel the same way.

Import-safe without triton: the helpers exist only when ``import triton`` works (``HAS_TRITON``). They run
on CUDA and in Triton's CPU interpreter (``TRITON_INTERPRET=1``), where jitted helpers calling each other,
constexpr arguments and ``if`` on a constexpr all work (checked with triton 3.9).
"""

from __future__ import annotations

import torch

from pagedllm.kv.kv_quant import QuantizedKV, raw

try:  # pragma: no cover - exercised only where triton is installed
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install without a driver
    triton = None
    tl = None
    HAS_TRITON = False

# The pool formats a kernel's FORMAT constexpr names (pagedllm/kv/kv_quant.py); 0: a float pool.
FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def pad_pow2(x: int, lo: int) -> int:
    """The power of two >= ``x`` and >= ``lo`` (Triton block shapes are powers of two)."""
    return max(lo, 1 << max(0, (x - 1).bit_length()))


def pool_args(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(k, v, k_scale, v_scale, FORMAT)`` for a kernel: the codes (fp8 as bytes, which every GPU and the
    interpreter load) and ``[Hkv, num_blocks]`` scales of a quantized pool, or a float pool with itself in
    place of the scales (never read: FORMAT 0)."""
    if isinstance(k_cache, QuantizedKV):
        return raw(k_cache.data), raw(v_cache.data), k_cache.scale, v_cache.scale, FORMATS[k_cache.dtype]
    return k_cache, v_cache, k_cache, v_cache, 0


if HAS_TRITON:  # pragma: no cover

    @triton.jit
    def dequantize(codes, FORMAT: tl.constexpr):
        """fp32 values of loaded codes, before the scale. fp8 comes as bytes, widened through fp16 bits (e5m2 is an
        fp16's high byte; e4m3's bits moved into fp16's place give value / 2^8), so no fp8 support is needed."""
        if FORMAT == 2:
            c = codes.to(tl.uint16)
            x = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        elif FORMAT == 3:
            x = (codes.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            x = codes.to(tl.float32)
        return x

    @triton.jit
    def load_tile(POOL, SCALE, kvh, phys, slot, d, nmask, dmask, s0, s1, ss0, ss1, FORMAT: tl.constexpr):
        """fp32 ``[BLOCK_N, D_PAD]`` rows ``slot`` of kv head ``kvh`` (pool ``[Hkv, slots, D]``), times the scale
        of their (head, physical block ``phys``) when the pool is quantized; masked rows are 0."""
        x = dequantize(tl.load(POOL + kvh * s0 + slot[:, None] * s1 + d[None, :],
                               mask=nmask[:, None] & dmask[None, :], other=0), FORMAT)
        if FORMAT != 0:
            x = x * tl.load(SCALE + kvh * ss0 + phys * ss1, mask=nmask, other=0.0)[:, None]
        return x

    @triton.jit
    def attend_range(q, q_pos, lo, hi, K, V, KS, VS, BT_ROW, kvh, block_size, scale,
                     sk0, sk1, sv0, sv1, sks0, sks1, svs0, svs1,
                     ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                     FORMAT: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr = False):
        """Attention of ``q [ROWS, D_PAD]`` (fp32) over the keys ``lo .. hi - 1`` of one sequence, read in
        place through its block-table row ``BT_ROW``; row ``r`` sees only keys ``<= q_pos[r]``. Online
        softmax: returns ``(acc, m, l)``, the unnormalised output, running max and sum (``l == 0``: no key).
        ``USE_DOT``: ``tl.dot`` products (tiles of >= 16 rows), else broadcast sums (a decode's few heads); ``IEEE``:
        the dots in full fp32 (an fp32 model's exact path: Triton's default for fp32 dots is TF32, ~1e-3 off)."""
        d = tl.arange(0, D_PAD)
        dmask = d < D
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_PAD], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < hi
            phys = tl.load(BT_ROW + n // block_size, mask=nmask, other=0).to(tl.int64)
            slot = phys * block_size + n % block_size
            k = load_tile(K, KS, kvh, phys, slot, d, nmask, dmask, sk0, sk1, sks0, sks1, FORMAT)
            if USE_DOT:
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
            else:
                s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            s = tl.where((n[None, :] <= q_pos[:, None]) & nmask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = load_tile(V, VS, kvh, phys, slot, d, nmask, dmask, sv0, sv1, svs0, svs1, FORMAT)
            if USE_DOT:
                if IEEE:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p, v)
            else:
                pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def load_group_queries(Q, seq, kvh, sq0, sq1, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                           D: tl.constexpr, D_PAD: tl.constexpr):
        """A decode's ``GROUP`` query heads sharing kv head ``kvh``: ``(q fp32 [GROUP_PAD, D_PAD], their head
        ids, the mask of real rows and columns)``; a program computes them together so K/V is read once."""
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        heads = kvh * GROUP + g
        mask = (g < GROUP)[:, None] & (d < D)[None, :]
        q = tl.load(Q + seq * sq0 + heads[:, None] * sq1 + d[None, :], mask=mask, other=0.0)
        return q.to(tl.float32), heads, mask
