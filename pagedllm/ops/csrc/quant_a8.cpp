// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for W in GGUF Q4_1 / Q8_0 blocks, llama.cpp-style: the
// activations are quantized per row and per 32-element block to int8 (d_x = amax / 127, q_x = round(x / d_x),
// ties to even, plus the block's fp32 sum s_x) and the block dot products run in integer SIMD
// (vpmaddubsw, or VPDPBUSD on AVX512-VNNI: 32 int8 MACs per instruction against 8 per fp32 FMA).
//   Q4_1: sum_j w_j x_j ~ d_w d_x sum (q_w - 8) q_x + (m_w + 8 d_w) s_x     Q8_0: d_w d_x sum q_w q_x
// (Q4_1 is llama.cpp's d_w d_x sum q_w q_x + m_w s_x with the nibbles centred: the block-sum part of the
// x rounding error is taken exactly from s_x, which halves the error for typical blocks.)
// APPROXIMATE: rounding x to 8 bits gives ~0.1-1% relative error per output (the weights are used
// exactly), so results are not bit-identical to the fp32 path of gemm.cpp; in exchange large
// batches run several times faster than dequantize + fp32 GEMM, and decode streams the blocks at close
// to memory bandwidth.
//
// Layout: each thread takes a contiguous range of groups of 8 rows of W and repacks them into a panel
// (per 32-weight block: 32-byte vectors whose int32 lane r holds 4 consecutive weights of row r as
// unsigned nibbles, then d and m of the 8 rows as fp32). An x row's 4 int8 values broadcast to all
// lanes then give, per vpmaddubsw, partial dot products for 8 outputs at once; 8 of them (one block)
// add up in int16 without overflow (8 * 2 * 15 * 127 = 30480), and one vpmaddwd + cvt + fma per block
// and x row applies the scales, with no horizontal sums. Q8_0 weights are split into two nibble
// planes (w + 128 = 16 hi + lo) so the same unsigned x signed products apply; the 128 * sum q_x offset
// is subtracted in int32, so the block's integer dot product is exact. For many rows of x the panel
// covers an L2-sized range of W rows, swept by L2-sized chunks of x rows; for few rows it is one
// L1-resident group and W is streamed once.
// linear_a8 repacks W on every call; the model calls linear_a8_packed on W packed once at load (pack_a8,
// layout further down), which halves a decode step's GEMM time.
#include "ops_common.h"

#include <omp.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace pagedllm_ops;  // hsum8, hmax8, the GGUF blocks and their checks

constexpr int kQ4_1 = BlockQ4_1::kType, kQ8_0 = BlockQ8_0::kType;
constexpr int64_t kQ4Bytes = sizeof(BlockQ4_1), kQ8Bytes = sizeof(BlockQ8_0);
// panel bytes per group of 8 rows and per block
constexpr int64_t kPanelQ4 = 8 * 32 + 2 * 32;   // 8 nibble vectors, d, m
constexpr int64_t kPanelQ8 = 16 * 32 + 32;      // 8 lo + 8 hi nibble vectors, d

// The quantized activations: q [M, K] int8, and per (row, block) d, the fp32 sum s, and sum q.
struct QX {
  int8_t* q;
  float* d;
  float* s;
  int32_t* c;
};

inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s, int32_t* c) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float a = hmax8(amax), db = a / 127.f;
    d[b] = db;
    s[b] = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    if (db == 0.f) {  // an all-zero block (or denormals): q = 0
      std::memset(q + 32 * b, 0, 32);
      c[b] = 0;
      continue;
    }
    const __m256 dv = _mm256_set1_ps(db);
    __m256i r[4];
    __m256 qs = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const __m256 qf = _mm256_round_ps(_mm256_div_ps(v[i], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      qs = _mm256_add_ps(qs, qf);
      r[i] = _mm256_cvtps_epi32(qf);
    }
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), _mm256_permutevar8x32_epi32(p, perm));
    c[b] = static_cast<int32_t>(hsum8(qs));  // exact: small integers
  }
}

// Row m of x [M, K] into qx.
inline void quantize_x_row(const float* x, int64_t m, int64_t K, const QX& qx) {
  const int64_t KB = K / 32;
  quantize_row(x + m * K, K, qx.q + m * K, qx.d + m * KB, qx.s + m * KB, qx.c + m * KB);
}

inline __m128i loadu128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i loadu256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void storeu256(uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline uint16_t ld16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline int32_t ld32(const uint8_t* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// 8 fp16 values -> fp32 vector
inline __m256 halves(const uint8_t* base, int64_t stride) {
  const __m128i h = _mm_setr_epi16(ld16(base), ld16(base + stride), ld16(base + 2 * stride), ld16(base + 3 * stride),
                                   ld16(base + 4 * stride), ld16(base + 5 * stride), ld16(base + 6 * stride),
                                   ld16(base + 7 * stride));
  return _mm256_cvtph_ps(h);
}

// The b-th slice of the next group (8 contiguous rows) into L1 while this one is packed: the hardware
// prefetcher alone leaves the DRAM stream well under bandwidth at M = 1.
inline void prefetch_part(const uint8_t* next, int64_t b, int64_t slice) {
  if (!next) return;
  for (int64_t o = b * slice; o < (b + 1) * slice; o += 64) _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
}

// The 8 rows' nibble bytes of one Q4_1 block (row r at p + r * rb), transposed: c[t] lane r = bytes
// 4t..4t+3 of row r, whose low nibbles are weights 4t.. and high nibbles weights 16 + 4t..
inline void transpose_q4(const uint8_t* p, int64_t rb, __m256i c[4]) {
  __m256i a[4];
  for (int r = 0; r < 4; ++r)
    a[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(loadu128(p + r * rb + 4)), loadu128(p + (r + 4) * rb + 4), 1);
  const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
  c[0] = _mm256_unpacklo_epi64(t0, t2);
  c[1] = _mm256_unpackhi_epi64(t0, t2);
  c[2] = _mm256_unpacklo_epi64(t1, t3);
  c[3] = _mm256_unpackhi_epi64(t1, t3);
}

// The 8 rows' weights of one Q8_0 block as unsigned w + 128, transposed: v[j] lane r = weights 4j..4j+3 of row r.
inline void transpose_q8(const uint8_t* p, int64_t rb, __m256i v[8]) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i r[8];
  for (int i = 0; i < 8; ++i) r[i] = loadu256(p + i * rb + 2);
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int h = 0; h < 8; h += 4) {  // rows h..h+3: u[h + j] lanes = group j | group j + 4
    u[h + 0] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
    u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
    u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
    u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_xor_si256(_mm256_permute2x128_si256(u[j], u[4 + j], 0x20), flip);
    v[j + 4] = _mm256_xor_si256(_mm256_permute2x128_si256(u[j], u[4 + j], 0x31), flip);
  }
}

// Repack 8 rows of Q4_1 blocks (row r at w + r * rb) into the panel, KB blocks.
void pack_q4(const uint8_t* w, int64_t rb, int64_t KB, uint8_t* panel, const uint8_t* next) {
  const __m256i lo = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* p = w + b * kQ4Bytes;
    prefetch_part(next, b, 8 * kQ4Bytes);
    uint8_t* o = panel + b * kPanelQ4;
    __m256i c[4];
    transpose_q4(p, rb, c);
    for (int t = 0; t < 4; ++t) {  // lane r: bytes 4t..4t+3 of row r -> weights 4t.. (low) and 16 + 4t.. (high)
      storeu256(o + 32 * t, _mm256_and_si256(c[t], lo));
      storeu256(o + 32 * (t + 4), _mm256_and_si256(_mm256_srli_epi16(c[t], 4), lo));
    }
    const __m256 d = halves(p, rb);
    _mm256_storeu_ps(reinterpret_cast<float*>(o + 256), d);
    // m + 8 d: the kernel takes q - 8 (centred nibbles) against the quantized x, the 8 d s_x rest exactly
    _mm256_storeu_ps(reinterpret_cast<float*>(o + 288), _mm256_fmadd_ps(d, _mm256_set1_ps(8.f), halves(p + 2, rb)));
  }
}

// Repack 8 rows of Q8_0 blocks: w + 128 split into low and high nibble planes.
void pack_q8(const uint8_t* w, int64_t rb, int64_t KB, uint8_t* panel, const uint8_t* next) {
  const __m256i lo = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* p = w + b * kQ8Bytes;
    prefetch_part(next, b, 8 * kQ8Bytes);
    uint8_t* o = panel + b * kPanelQ8;
    __m256i v[8];
    transpose_q8(p, rb, v);
    for (int j = 0; j < 8; ++j) {
      storeu256(o + 32 * j, _mm256_and_si256(v[j], lo));
      storeu256(o + 256 + 32 * j, _mm256_and_si256(_mm256_srli_epi16(v[j], 4), lo));
    }
    _mm256_storeu_ps(reinterpret_cast<float*>(o + 512), halves(p, rb));
  }
}

// Pins an accumulator to a register at this point: without it GCC hoists all of a block's products ahead
// of the adds and spills them (Q8_0: 3x slower).
inline void pin(__m256i& v) { __asm__("" : "+x"(v)); }

inline __m256i bcast(const int8_t* p) { return _mm256_set1_epi32(ld32(reinterpret_cast<const uint8_t*>(p))); }

// A block's unsigned-weight x int8 products, summed per output lane. AVX512-VNNI: VPDPBUSD adds each lane's 4
// products straight into int32, one instruction per 32 products. AVX2: VPMADDUBSW into int16 pairs (a block cannot
// overflow them, see the top), then one VPMADDWD a block to int32. The same integers either way, hence the same bits.
// Zen 4, the embedded model's four Q4_1 layer GEMMs on 2 threads: 1.22x faster at 8 rows, 1.28x at 36, 1.30-1.32x
// from 64 to 1,024 (one row goes to the GEMV, unchanged). The direct Q8_0 tile takes w + 128 whole there (tile_q8p):
// the tied LM head's GEMM [49152 x 576] 1.30-1.39x at 8-64 rows.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PAGEDLLM_A8_VNNI 1
inline __m256i dot_first(__m256i w, __m256i x) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x); }
inline __m256i dot_add(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(acc, w, x); }
inline __m256i dot_sums(__m256i acc, int shift) { return _mm256_slli_epi32(acc, shift); }  // the sums << shift
#else
inline __m256i dot_first(__m256i w, __m256i x) { return _mm256_maddubs_epi16(w, x); }
inline __m256i dot_add(__m256i acc, __m256i w, __m256i x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
inline __m256i dot_sums(__m256i acc, int shift) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(short{1} << shift)); }
#endif

inline void store_out(float* y, __m256 v, const float* bias, int nr) {
  if (bias) {
    if (nr == 8) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    else {
      alignas(32) float bb[8] = {};
      std::memcpy(bb, bias, nr * sizeof(float));
      v = _mm256_add_ps(v, _mm256_load_ps(bb));
    }
  }
  if (nr == 8) {
    _mm256_storeu_ps(y, v);
  } else {
    alignas(32) float t[8];
    _mm256_store_ps(t, v);
    std::memcpy(y, t, nr * sizeof(float));
  }
}

// One 32-column block's contribution to MR rows' accumulators, from the int16 pair sums p of the centred Q4_1
// nibbles (q - 8) against x's int8 block: (sum p - 8 * sum q_x) * d_w * d_x + (m_w + 8 d_w) * s_x, where
// mw holds m + 8 d and s_x is the x block's exact fp32 sum.
template <int MR>
inline void q4_block_sums(const QX& qx, int64_t m0, int64_t KB, int64_t b, const __m256i* p, __m256 dw, __m256 mw,
                          __m256* acc) {
  for (int i = 0; i < MR; ++i) {
    const int64_t r = (m0 + i) * KB + b;
    const __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(qx.d[r]));
    const __m256i si = _mm256_sub_epi32(dot_sums(p[i], 0), _mm256_set1_epi32(8 * qx.c[r]));
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), sc, acc[i]);
    acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(qx.s[r]), acc[i]);
  }
}

// The same for Q8_0 stored as w + 128 in low (pl) and high (ph) nibble planes: (sum pl + 16 sum ph - 128 sum q_x)
// * d_w * d_x; ph null: pl holds the sums of w + 128 whole (VNNI).
template <int MR>
inline void q8_block_sums(const QX& qx, int64_t m0, int64_t KB, int64_t b, const __m256i* pl, const __m256i* ph,
                          __m256 dw, __m256* acc) {
  for (int i = 0; i < MR; ++i) {
    const int64_t r = (m0 + i) * KB + b;
    const __m256i sums = ph ? _mm256_add_epi32(dot_sums(pl[i], 0), dot_sums(ph[i], 4)) : dot_sums(pl[i], 0);
    const __m256i s = _mm256_sub_epi32(sums, _mm256_set1_epi32(128 * qx.c[r]));
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(qx.d[r])), acc[i]);
  }
}

// MR rows of x (starting at row m0) against one panel group (8 rows of W); y points at y[m0, n].
template <int MR>
void tile_q4(const QX& qx, int64_t m0, int64_t K, const uint8_t* panel, float* y, int64_t ldy, const float* bias,
             int nr) {
  const int64_t KB = K / 32;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const int8_t* xq = qx.q + m0 * K;
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* P = panel + b * kPanelQ4;
    const int8_t* xb = xq + 32 * b;
    __m256i p[MR];
    {
      const __m256i wv = loadu256(P);
      for (int i = 0; i < MR; ++i) p[i] = dot_first(wv, bcast(xb + i * K));
    }
    for (int v = 1; v < 8; ++v) {
      const __m256i wv = loadu256(P + 32 * v);
      for (int i = 0; i < MR; ++i) {
        p[i] = dot_add(p[i], wv, bcast(xb + i * K + 4 * v));
        pin(p[i]);
      }
    }
    const __m256 dw = _mm256_loadu_ps(reinterpret_cast<const float*>(P + 256));
    const __m256 mw = _mm256_loadu_ps(reinterpret_cast<const float*>(P + 288));
    q4_block_sums<MR>(qx, m0, KB, b, p, dw, mw, acc);
  }
  for (int i = 0; i < MR; ++i) store_out(y + i * ldy, acc[i], bias, nr);
}

template <int MR>
void tile_q8(const QX& qx, int64_t m0, int64_t K, const uint8_t* panel, float* y, int64_t ldy, const float* bias,
             int nr) {
  const int64_t KB = K / 32;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const int8_t* xq = qx.q + m0 * K;
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* P = panel + b * kPanelQ8;
    const int8_t* xb = xq + 32 * b;
    __m256i pl[MR], ph[MR];
    {
      const __m256i wl = loadu256(P), wh = loadu256(P + 256);
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = bcast(xb + i * K);
        pl[i] = dot_first(wl, xv);
        ph[i] = dot_first(wh, xv);
      }
    }
    for (int v = 1; v < 8; ++v) {
      const __m256i wl = loadu256(P + 32 * v), wh = loadu256(P + 256 + 32 * v);
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = bcast(xb + i * K + 4 * v);
        pl[i] = dot_add(pl[i], wl, xv);
        ph[i] = dot_add(ph[i], wh, xv);
        pin(pl[i]);
        pin(ph[i]);
      }
    }
    const __m256 dw = _mm256_loadu_ps(reinterpret_cast<const float*>(P + 512));
    q8_block_sums<MR>(qx, m0, KB, b, pl, ph, dw, acc);
  }
  for (int i = 0; i < MR; ++i) store_out(y + i * ldy, acc[i], bias, nr);
}

template <int QT>
struct Kern {
  static constexpr int64_t kBlock = QT == kQ4_1 ? kQ4Bytes : kQ8Bytes;
  static constexpr int64_t kPanel = QT == kQ4_1 ? kPanelQ4 : kPanelQ8;
  static constexpr int MR = QT == kQ4_1 ? 4 : 3;
  static void pack(const uint8_t* w, int64_t rb, int64_t KB, uint8_t* panel, const uint8_t* next) {
    if constexpr (QT == kQ4_1) pack_q4(w, rb, KB, panel, next); else pack_q8(w, rb, KB, panel, next);
  }
  template <int R>
  static void tile(const QX& qx, int64_t m0, int64_t K, const uint8_t* panel, float* y, int64_t ldy, const float* bias,
                   int nr) {
    if constexpr (QT == kQ4_1) tile_q4<R>(qx, m0, K, panel, y, ldy, bias, nr);
    else tile_q8<R>(qx, m0, K, panel, y, ldy, bias, nr);
  }
  // rows [m0, m1) of x against one panel group
  static void rows(const QX& qx, int64_t m0, int64_t m1, int64_t K, const uint8_t* panel, float* y, int64_t N,
                   int64_t n, const float* bias, int nr) {
    int64_t m = m0;
    for (; m + MR <= m1; m += MR) tile<MR>(qx, m, K, panel, y + m * N + n, N, bias, nr);
    switch (m1 - m) {
      case 3: tile<3>(qx, m, K, panel, y + m * N + n, N, bias, nr); break;
      case 2: tile<2>(qx, m, K, panel, y + m * N + n, N, bias, nr); break;
      case 1: tile<1>(qx, m, K, panel, y + m * N + n, N, bias, nr); break;
      default: break;
    }
  }
};

template <int QT>
void gemm(const QX& qx, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K, int nthreads,
          int tid) {
  using Kn = Kern<QT>;
  const int64_t KB = K / 32, rb = KB * Kn::kBlock, G = (N + 7) / 8;
  const int64_t g0 = G * tid / nthreads, g1 = G * (tid + 1) / nthreads;
  if (g0 >= g1) return;
  const int64_t group_bytes = KB * Kn::kPanel;
  // few rows of x: one L1-resident group at a time (W streamed once); many: an L2-sized range of groups,
  // swept by chunks of x rows that stay in L2 too
  const int64_t NC = M <= 16 ? 1 : std::max<int64_t>(1, (192 << 10) / group_bytes);
  const int64_t MC = M <= 16 ? M : std::max<int64_t>(Kn::MR, ((128 << 10) / K) / Kn::MR * Kn::MR);
  std::vector<uint8_t> panel(std::min(NC, g1 - g0) * group_bytes);
  std::vector<uint8_t> tail;
  for (int64_t gc = g0; gc < g1; gc += NC) {
    const int64_t gn = std::min(NC, g1 - gc);
    for (int64_t g = gc; g < gc + gn; ++g) {
      const int64_t n = 8 * g;
      const uint8_t* src = w + n * rb;
      if (N - n < 8) {  // the last, partial group: zero-padded rows (d = m = 0)
        tail.assign(8 * rb, 0);
        std::memcpy(tail.data(), src, (N - n) * rb);
        src = tail.data();
      }
      const uint8_t* next = g + 1 < g1 && N - (n + 8) >= 8 ? w + (n + 8) * rb : nullptr;
      Kn::pack(src, rb, KB, panel.data() + (g - gc) * group_bytes, next);
    }
    for (int64_t mc = 0; mc < M; mc += MC) {
      const int64_t me = std::min(M, mc + MC);
      for (int64_t g = gc; g < gc + gn; ++g) {
        const int64_t n = 8 * g;
        const int nr = static_cast<int>(std::min<int64_t>(8, N - n));
        Kn::rows(qx, mc, me, K, panel.data() + (g - gc) * group_bytes, y, N, n, bias ? bias + n : nullptr, nr);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// The load-time layout (pack_a8 / linear_a8_packed). linear_a8 above repacks W on every call, which at one
// row of x costs about as much as the dot products; packing once at load lets decode stream W at close
// to memory bandwidth. Per group of 8 rows (rows past N zero), the KB blocks' weight vectors, then their
// scales, i.e. the GGUF bytes rearranged at the same size:
//   Q4_1: per block 4 x 32 bytes, transpose_q4's c[t] as raw bytes (lane r low nibbles: weights 4t.. of
//         row r, high nibbles: 16 + 4t..); scales d[8], m[8] fp16 (32 bytes per block)
//   Q8_0: per block 8 x 32 bytes, transpose_q8's w + 128; scales d[8] fp16 (16 bytes per block)
// Scales stay fp16: fp32 (and a precomputed m + 8 d) would add 20% to the Q4_1 bytes one-row decode streams,
// while converting them is 2-3 ops per block shared by all of a tile's rows. Groups are contiguous, so W is
// one sequential stream per thread; the tiles still prefetch the next group (without: 2x slower at M = 1).
// Few rows of x read it directly (the nibble split costs 3 ops per vector, shared by the tile's rows);
// many rows unpack each group into linear_a8's panel (no transposes) and run the same tiles. Both give
// bit-identical results to linear_a8: the same integer sums and the same fp32 operations in the same order.
template <int QT>
struct Packed {
  static constexpr int64_t kW = QT == kQ4_1 ? 128 : 256;  // weight bytes per block
  static constexpr int64_t kS = QT == kQ4_1 ? 32 : 16;    // scale bytes per block
};

void pack_group_q4(const uint8_t* w, int64_t rb, int64_t KB, uint8_t* out) {
  uint8_t* S = out + KB * Packed<kQ4_1>::kW;
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* p = w + b * kQ4Bytes;
    __m256i c[4];
    transpose_q4(p, rb, c);
    for (int t = 0; t < 4; ++t) storeu256(out + b * 128 + 32 * t, c[t]);
    uint16_t h[16];
    for (int r = 0; r < 8; ++r) {
      h[r] = ld16(p + r * rb);
      h[8 + r] = ld16(p + r * rb + 2);
    }
    std::memcpy(S + 32 * b, h, sizeof(h));
  }
}

void pack_group_q8(const uint8_t* w, int64_t rb, int64_t KB, uint8_t* out) {
  uint8_t* S = out + KB * Packed<kQ8_0>::kW;
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* p = w + b * kQ8Bytes;
    __m256i v[8];
    transpose_q8(p, rb, v);
    for (int j = 0; j < 8; ++j) storeu256(out + b * 256 + 32 * j, v[j]);
    uint16_t h[8];
    for (int r = 0; r < 8; ++r) h[r] = ld16(p + r * rb);
    std::memcpy(S + 16 * b, h, sizeof(h));
  }
}

// One packed group -> linear_a8's panel (for many rows of x: the split is then done once, not per tile).
void unpack_q4(const uint8_t* g, int64_t KB, uint8_t* panel) {
  const __m256i lo = _mm256_set1_epi8(0x0F);
  const uint8_t* S = g + KB * Packed<kQ4_1>::kW;
  for (int64_t b = 0; b < KB; ++b) {
    uint8_t* o = panel + b * kPanelQ4;
    for (int t = 0; t < 4; ++t) {
      const __m256i c = loadu256(g + b * 128 + 32 * t);
      storeu256(o + 32 * t, _mm256_and_si256(c, lo));
      storeu256(o + 32 * (t + 4), _mm256_and_si256(_mm256_srli_epi16(c, 4), lo));
    }
    const __m256 d = _mm256_cvtph_ps(loadu128(S + 32 * b));
    _mm256_storeu_ps(reinterpret_cast<float*>(o + 256), d);
    _mm256_storeu_ps(reinterpret_cast<float*>(o + 288),
                     _mm256_fmadd_ps(d, _mm256_set1_ps(8.f), _mm256_cvtph_ps(loadu128(S + 32 * b + 16))));
  }
}

void unpack_q8(const uint8_t* g, int64_t KB, uint8_t* panel) {
  const __m256i lo = _mm256_set1_epi8(0x0F);
  const uint8_t* S = g + KB * Packed<kQ8_0>::kW;
  for (int64_t b = 0; b < KB; ++b) {
    uint8_t* o = panel + b * kPanelQ8;
    for (int j = 0; j < 8; ++j) {
      const __m256i u = loadu256(g + b * 256 + 32 * j);
      storeu256(o + 32 * j, _mm256_and_si256(u, lo));
      storeu256(o + 256 + 32 * j, _mm256_and_si256(_mm256_srli_epi16(u, 4), lo));
    }
    _mm256_storeu_ps(reinterpret_cast<float*>(o + 512), _mm256_cvtph_ps(loadu128(S + 16 * b)));
  }
}

// tile_q4 on a packed group g; next: the following group, prefetched block by block (or null)
template <int MR>
void tile_q4p(const QX& qx, int64_t m0, int64_t K, const uint8_t* g, float* y, int64_t ldy, const float* bias, int nr,
              const uint8_t* next) {
  const int64_t KB = K / 32;
  const uint8_t* S = g + KB * Packed<kQ4_1>::kW;
  const __m256i lo = _mm256_set1_epi8(0x0F);
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const int8_t* xq = qx.q + m0 * K;
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_part(next, b, Packed<kQ4_1>::kW + Packed<kQ4_1>::kS);
    const uint8_t* P = g + b * 128;
    const int8_t* xb = xq + 32 * b;
    __m256i p[MR];
    {
      const __m256i c = loadu256(P);
      const __m256i wl = _mm256_and_si256(c, lo), wh = _mm256_and_si256(_mm256_srli_epi16(c, 4), lo);
      for (int i = 0; i < MR; ++i) p[i] = dot_first(wl, bcast(xb + i * K));
      for (int i = 0; i < MR; ++i) {
        p[i] = dot_add(p[i], wh, bcast(xb + i * K + 16));
        pin(p[i]);
      }
    }
    for (int t = 1; t < 4; ++t) {
      const __m256i c = loadu256(P + 32 * t);
      const __m256i wl = _mm256_and_si256(c, lo), wh = _mm256_and_si256(_mm256_srli_epi16(c, 4), lo);
      for (int i = 0; i < MR; ++i) {
        p[i] = dot_add(p[i], wl, bcast(xb + i * K + 4 * t));
        pin(p[i]);
      }
      for (int i = 0; i < MR; ++i) {
        p[i] = dot_add(p[i], wh, bcast(xb + i * K + 16 + 4 * t));
        pin(p[i]);
      }
    }
    const __m256 dw = _mm256_cvtph_ps(loadu128(S + 32 * b));
    const __m256 mw = _mm256_fmadd_ps(dw, _mm256_set1_ps(8.f), _mm256_cvtph_ps(loadu128(S + 32 * b + 16)));
    q4_block_sums<MR>(qx, m0, KB, b, p, dw, mw, acc);
  }
  for (int i = 0; i < MR; ++i) store_out(y + i * ldy, acc[i], bias, nr);
}

template <int MR>
void tile_q8p(const QX& qx, int64_t m0, int64_t K, const uint8_t* g, float* y, int64_t ldy, const float* bias, int nr,
              const uint8_t* next) {
  const int64_t KB = K / 32;
  const uint8_t* S = g + KB * Packed<kQ8_0>::kW;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const int8_t* xq = qx.q + m0 * K;
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_part(next, b, Packed<kQ8_0>::kW + Packed<kQ8_0>::kS);
    const uint8_t* P = g + b * 256;
    const int8_t* xb = xq + 32 * b;
    const __m256 dw = _mm256_cvtph_ps(loadu128(S + 16 * b));
#ifdef PAGEDLLM_A8_VNNI
    // VPDPBUSD takes w + 128 whole (no 16-bit pairs to keep from overflowing): one product per weight, not two,
    // and sum (w + 128) q_x - 128 sum q_x is the same integer as the two planes give
    __m256i p[MR];
    for (int i = 0; i < MR; ++i) p[i] = _mm256_setzero_si256();
    for (int v = 0; v < 8; ++v) {
      const __m256i u = loadu256(P + 32 * v);
      for (int i = 0; i < MR; ++i) p[i] = dot_add(p[i], u, bcast(xb + i * K + 4 * v));
    }
    q8_block_sums<MR>(qx, m0, KB, b, p, nullptr, dw, acc);
#else
    const __m256i lo = _mm256_set1_epi8(0x0F);
    __m256i pl[MR], ph[MR];
    {
      const __m256i u = loadu256(P);
      const __m256i wl = _mm256_and_si256(u, lo), wh = _mm256_and_si256(_mm256_srli_epi16(u, 4), lo);
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = bcast(xb + i * K);
        pl[i] = dot_first(wl, xv);
        ph[i] = dot_first(wh, xv);
      }
    }
    for (int v = 1; v < 8; ++v) {
      const __m256i u = loadu256(P + 32 * v);
      const __m256i wl = _mm256_and_si256(u, lo), wh = _mm256_and_si256(_mm256_srli_epi16(u, 4), lo);
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = bcast(xb + i * K + 4 * v);
        pl[i] = dot_add(pl[i], wl, xv);
        ph[i] = dot_add(ph[i], wh, xv);
        pin(pl[i]);
        pin(ph[i]);
      }
    }
    q8_block_sums<MR>(qx, m0, KB, b, pl, ph, dw, acc);
#endif
  }
  for (int i = 0; i < MR; ++i) store_out(y + i * ldy, acc[i], bias, nr);
}

// Up to this many rows of x the tiles read the packed groups directly; beyond, unpacking each group once
// into a panel wins (measured on SmolLM2's matrices: equal at 32-64 rows, 15% faster at 128-512).
constexpr int64_t kDirectMaxRows = 64;

// Below this much work (rows of x times W bytes) one thread runs the GEMM: waking OpenMP's second thread
// costs ~25-40 us under pagedllm's default OMP_WAIT_POLICY=PASSIVE (futex sleep; measured on a 2-core VM),
// more than a second thread saves on SmolLM2's layer matrices at one row (0.2-1.1 MB: 0.29 vs 0.39 ms per
// layer). Spinning waiters wake in ~5 us, which pays off from ~128 KB.
int64_t single_thread_work() {
  static const int64_t v = [] {
    const char* p = std::getenv("OMP_WAIT_POLICY");
    std::string s = p ? p : "";
    for (auto& ch : s) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    return s == "PASSIVE" ? int64_t{3} << 19 : int64_t{128} << 10;
  }();
  return v;
}

template <int QT>
struct KernP {
  static constexpr int64_t kBlock = Packed<QT>::kW + Packed<QT>::kS;
  static constexpr int MR = Kern<QT>::MR;
  static void pack(const uint8_t* w, int64_t rb, int64_t KB, uint8_t* out) {
    if constexpr (QT == kQ4_1) pack_group_q4(w, rb, KB, out); else pack_group_q8(w, rb, KB, out);
  }
  static void unpack(const uint8_t* g, int64_t KB, uint8_t* panel) {
    if constexpr (QT == kQ4_1) unpack_q4(g, KB, panel); else unpack_q8(g, KB, panel);
  }
  template <int R>
  static void tile(const QX& qx, int64_t m0, int64_t K, const uint8_t* g, float* y, int64_t ldy, const float* bias,
                   int nr, const uint8_t* next) {
    if constexpr (QT == kQ4_1) tile_q4p<R>(qx, m0, K, g, y, ldy, bias, nr, next);
    else tile_q8p<R>(qx, m0, K, g, y, ldy, bias, nr, next);
  }
  // rows [m0, m1) of x against one packed group; the first tile prefetches the next group
  static void rows(const QX& qx, int64_t m0, int64_t m1, int64_t K, const uint8_t* g, float* y, int64_t N, int64_t n,
                   const float* bias, int nr, const uint8_t* next) {
    int64_t m = m0;
    for (; m + MR <= m1; m += MR, next = nullptr) tile<MR>(qx, m, K, g, y + m * N + n, N, bias, nr, next);
    switch (m1 - m) {
      case 3: tile<3>(qx, m, K, g, y + m * N + n, N, bias, nr, next); break;
      case 2: tile<2>(qx, m, K, g, y + m * N + n, N, bias, nr, next); break;
      case 1: tile<1>(qx, m, K, g, y + m * N + n, N, bias, nr, next); break;
      default: break;
    }
  }
};

template <int QT>
void gemm_packed(const QX& qx, const uint8_t* packed, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                 int nthreads, int tid) {
  using Kp = KernP<QT>;
  const int64_t KB = K / 32, G = (N + 7) / 8, gb = KB * Kp::kBlock;
  const int64_t g0 = G * tid / nthreads, g1 = G * (tid + 1) / nthreads;
  if (g0 >= g1) return;
  if (M <= kDirectMaxRows) {  // W streamed once, each group read straight into the tiles
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = 8 * g;
      const int nr = static_cast<int>(std::min<int64_t>(8, N - n));
      Kp::rows(qx, 0, M, K, packed + g * gb, y, N, n, bias ? bias + n : nullptr, nr,
               g + 1 < g1 ? packed + (g + 1) * gb : nullptr);
    }
    return;
  }
  // as gemm: an L2-sized range of groups unpacked to panels, swept by L2-sized chunks of x rows
  using Kn = Kern<QT>;
  const int64_t panel_bytes = KB * Kn::kPanel;
  const int64_t NC = std::max<int64_t>(1, (192 << 10) / panel_bytes);
  const int64_t MC = std::max<int64_t>(Kn::MR, ((128 << 10) / K) / Kn::MR * Kn::MR);
  thread_local std::vector<uint8_t> panel;  // kept across calls (OpenMP threads persist)
  const size_t need = std::min(NC, g1 - g0) * panel_bytes;
  if (panel.size() < need) panel.resize(need);
  for (int64_t gc = g0; gc < g1; gc += NC) {
    const int64_t gn = std::min(NC, g1 - gc);
    for (int64_t g = gc; g < gc + gn; ++g) Kp::unpack(packed + g * gb, KB, panel.data() + (g - gc) * panel_bytes);
    for (int64_t mc = 0; mc < M; mc += MC) {
      const int64_t me = std::min(M, mc + MC);
      for (int64_t g = gc; g < gc + gn; ++g) {
        const int64_t n = 8 * g;
        const int nr = static_cast<int>(std::min<int64_t>(8, N - n));
        Kn::rows(qx, mc, me, K, panel.data() + (g - gc) * panel_bytes, y, N, n, bias ? bias + n : nullptr, nr);
      }
    }
  }
}

// The quantized activations' buffers, reused across calls by each calling thread (decode makes ~120 small
// calls per token).
struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> c;
  QX get(int64_t M, int64_t K) {
    const size_t n = M * K, nb = M * (K / 32);
    if (q.size() < n) q.resize(n);
    if (d.size() < nb) {
      d.resize(nb);
      s.resize(nb);
      c.resize(nb);
    }
    return QX{q.data(), d.data(), s.data(), c.data()};
  }
};

int64_t packed_row_bytes(int64_t qtype, int64_t K) {
  return K / 32 * (qtype == kQ4_1 ? KernP<kQ4_1>::kBlock : KernP<kQ8_0>::kBlock);
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32, got ", x.size(1));
}

void check_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t qtype, int64_t N) {
  check_x(x);
  check_qtype(qtype);
  const int64_t K = x.size(1);
  TORCH_CHECK(N >= 0, "N must be >= 0");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(0) == (N + 7) / 8 && packed.size(1) == packed_row_bytes(qtype, K),
              "packed must be pack_a8's contiguous uint8 [ceil(N / 8), ", packed_row_bytes(qtype, K),
              "] blocks for N = ", N, ", K = ", K, ", got ", packed.sizes());
}

}  // namespace

// x: [M, K] float32 contiguous -> (q int8 [M, K], d float32 [M, K/32], s float32 [M, K/32]): the activation
// quantization linear_a8 uses (d = amax / 127, q = round-half-to-even(x / d), s = the block's fp32 sum).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_a8(torch::Tensor x) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), KB = K / 32;
  auto q = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto d = torch::empty({M, KB}, x.options());
  auto s = torch::empty({M, KB}, x.options());
  std::vector<int32_t> c(M * KB);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *dp = d.data_ptr<float>(), *sp = s.data_ptr<float>();
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads()) if (M * K >= (1 << 16))
  for (int64_t m = 0; m < M; ++m) quantize_x_row(xp, m, K, QX{qp, dp, sp, c.data()});
  return {q, d, s};
}

// x: [M, K] float32 contiguous; wq: [N, K / 32 * block bytes] uint8 rows of GGUF blocks of type qtype
// (3 = Q4_1, 8 = Q8_0); bias: None or [N] float32. Returns float32 [M, N].
torch::Tensor linear_a8(torch::Tensor x, torch::Tensor wq, int64_t qtype, std::optional<torch::Tensor> bias) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), KB = K / 32, N = check_blocks(wq, qtype, K);
  torch::Tensor b;
  const float* bp = bias_ptr(bias, N, b);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return bp ? bias->unsqueeze(0).expand({M, N}).contiguous() : y.zero_();
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = wq.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * KB), s(M * KB);
  std::vector<int32_t> c(M * KB);
  const QX qx{q.data(), d.data(), s.data(), c.data()};
  const int64_t G = (N + 7) / 8;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), G)));
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) quantize_x_row(xp, m, K, qx);
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    if (qtype == kQ4_1)
      gemm<kQ4_1>(qx, wp, bp, yp, M, N, K, nt, tid);
    else
      gemm<kQ8_0>(qx, wp, bp, yp, M, N, K, nt, tid);
  }
  return y;
}

// wq: [N, K / 32 * block bytes] uint8 rows of GGUF blocks of type qtype (3 = Q4_1, 8 = Q8_0) -> uint8
// [ceil(N / 8), K / 32 * (160 | 272)]: the layout linear_a8_packed reads, made once when the model loads.
torch::Tensor pack_a8(torch::Tensor wq, int64_t qtype) {
  TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == at::kByte && wq.is_contiguous(),
              "wq must be a contiguous uint8 [N, bytes] tensor");
  const int64_t block = block_bytes(qtype), N = wq.size(0), rb = wq.size(1);
  TORCH_CHECK(rb % block == 0, "wq rows must be whole ", block, "-byte blocks, got ", rb, " bytes");
  const int64_t KB = rb / block, G = (N + 7) / 8, gb = packed_row_bytes(qtype, 32 * KB);
  auto out = torch::empty({G, gb}, wq.options());
  const uint8_t* wp = wq.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* src = wp + 8 * g * rb;
    std::vector<uint8_t> tail;
    if (N - 8 * g < 8) {  // the last, partial group: zero rows (d = m = 0), never stored
      tail.assign(8 * rb, 0);
      std::memcpy(tail.data(), src, (N - 8 * g) * rb);
      src = tail.data();
    }
    if (qtype == kQ4_1) KernP<kQ4_1>::pack(src, rb, KB, op + g * gb);
    else KernP<kQ8_0>::pack(src, rb, KB, op + g * gb);
  }
  return out;
}

// linear_a8(x, wq, qtype, bias) with W given as pack_a8(wq, qtype) (N: its row count); the same results.
torch::Tensor linear_a8_packed(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t N,
                               std::optional<torch::Tensor> bias) {
  check_packed(x, packed, qtype, N);
  const int64_t M = x.size(0), K = x.size(1);
  torch::Tensor b;
  const float* bp = bias_ptr(bias, N, b);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return bp ? bias->unsqueeze(0).expand({M, N}).contiguous() : y.zero_();
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  thread_local Scratch scratch;
  const QX qx = scratch.get(M, K);
  const int64_t G = (N + 7) / 8;
  int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), G)));
  if (M * packed.numel() <= single_thread_work()) nthreads = 1;
  auto run = [&](int nt, int tid) {
    if (qtype == kQ4_1) gemm_packed<kQ4_1>(qx, wp, bp, yp, M, N, K, nt, tid);
    else gemm_packed<kQ8_0>(qx, wp, bp, yp, M, N, K, nt, tid);
  };
  // few rows (decode): quantize here, saving the parallel region a barrier
  const bool serial_x = nthreads == 1 || M * K <= (1 << 14);
  if (serial_x)
    for (int64_t m = 0; m < M; ++m) quantize_x_row(xp, m, K, qx);
  if (nthreads == 1) {
    run(1, 0);
  } else if (serial_x) {
#pragma omp parallel num_threads(nthreads)
    run(omp_get_num_threads(), omp_get_thread_num());
  } else {
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m) quantize_x_row(xp, m, K, qx);
      run(omp_get_num_threads(), omp_get_thread_num());
    }
  }
  return y;
}

// linear_a8_packed(x, packed, qtype, N) into y [M, N], only the groups of 8 rows of part `part` of `parts`, in the
// calling thread: the share of one thread of a team that is already running (decode_layer's one parallel region per
// layer). Each part quantizes x itself (a decode row: a few hundred ns, less than a barrier). The same bits as
// linear_a8_packed, whatever the split.
void linear_a8_packed_part(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t N, torch::Tensor y,
                           int64_t part, int64_t parts) {
  check_packed(x, packed, qtype, N);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "y must be a contiguous float32 [", M, ", ", N, "] tensor, got ", y.sizes(), " ", y.scalar_type());
  TORCH_CHECK(parts >= 1 && part >= 0 && part < parts, "part must be in [0, parts), got ", part, " of ", parts);
  TORCH_CHECK(M <= kDirectMaxRows, "linear_a8_packed_part runs up to ", kDirectMaxRows, " rows, got ", M);
  if (M == 0 || N == 0 || K == 0) {
    if (part == 0) y.zero_();
    return;
  }
  thread_local Scratch scratch;
  const QX qx = scratch.get(M, K);
  for (int64_t m = 0; m < M; ++m) quantize_x_row(x.data_ptr<float>(), m, K, qx);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  if (qtype == kQ4_1) gemm_packed<kQ4_1>(qx, wp, nullptr, y.data_ptr<float>(), M, N, K, parts, part);
  else gemm_packed<kQ8_0>(qx, wp, nullptr, y.data_ptr<float>(), M, N, K, parts, part);
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  // x @ W.T (+ bias), W in GGUF Q4_1/Q8_0 blocks, x quantized to int8 per 32-block (approximate, llama.cpp-style)
  m.def("linear_a8(Tensor x, Tensor wq, int qtype, Tensor? bias=None) -> Tensor");
  // x [M, K] -> (q int8 [M, K], d [M, K/32], s [M, K/32]) as linear_a8 quantizes it
  m.def("quantize_a8(Tensor x) -> (Tensor, Tensor, Tensor)");
  // GGUF Q4_1/Q8_0 rows -> the load-time layout linear_a8_packed reads
  m.def("pack_a8(Tensor wq, int qtype) -> Tensor");
  // linear_a8 on pack_a8's layout (W: N rows); the same results
  m.def("linear_a8_packed(Tensor x, Tensor packed, int qtype, int N, Tensor? bias=None) -> Tensor");
  // linear_a8_packed's rows of one part into y, in the calling thread (a team's share)
  m.def("linear_a8_packed_part(Tensor x, Tensor packed, int qtype, int N, Tensor(a!) y, int part, int parts) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("linear_a8", &linear_a8);
  m.impl("quantize_a8", &quantize_a8);
  m.impl("pack_a8", &pack_a8);
  m.impl("linear_a8_packed", &linear_a8_packed);
  m.impl("linear_a8_packed_part", &linear_a8_packed_part);
}
