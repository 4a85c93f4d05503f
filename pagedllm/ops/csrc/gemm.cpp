// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) in fp32 on x86 CPUs with AVX2: every fp32 linear layer of the model.
//
// W may be fp32 or bf16 (widened in registers: half the bytes, fp32 math), or kept in a GGUF block format
// (Q4_1, Q8_0: 5 and 8.5 bits per weight), dequantized on the fly to exactly the values gguf's dequantize
// gives, so the result is bit-identical to the same call on the dequantized fp32 matrix.
// - A few rows (decode steps): a linear layer is a stream over its weights, and MKL's sgemm streams them at
//   under half the memory bandwidth (2-core EPYC: ~11 GB/s; the dot-product tiles here ~25 GB/s at M = 1).
//   Each thread takes a contiguous range of row blocks of W (a block stays in L1 while every row of x is
//   applied to it), with fp32 accumulators in registers and one horizontal sum per output.
// - From PANEL_MIN_ROWS rows up: 16 rows of W at a time are transposed into a K-major panel and 6 x 16 tiles
//   of y accumulate in registers (outer products, no horizontal sums): 90-95 GFLOP/s per core from 128 rows up
//   on the EPYC (its FMA peak: ~100), at or above oneDNN on the dequantized matrix. At 16-64 rows packing the
//   panel is a large part of a call; Q4_1 panels are packed from their bytes (pack_block_panel), a quarter cheaper.
#include "ops_common.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

namespace {

using namespace pagedllm_ops;  // load8, hsum8, the GGUF blocks

// MR rows of x against NR rows of W; K is a multiple of 8.
template <typename WT, int MR, int NR>
inline void tile(const float* x, int64_t K, const WT* w, float* y, int64_t ldy, const float* bias) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = load8(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum8(acc[i][j]) + (bias ? bias[j] : 0.f);
}

// A block's 32 weights as 4 vectors in k order. d * q is exact in fp32 (11-bit d times a <= 8-bit q), so
// fma(q, d, m) rounds like numpy's d * q + m: exactly gguf's dequantized values.
// (d and m are converted by one vcvtph2ps, and the bytes widened straight from memory: ~20% faster at one row
// than a conversion per scale and a shift of the loaded 16 bytes. Forced inline: GCC called it out of line once
// the block types moved to the shared header, 20% slower at one row.)
[[gnu::always_inline]] inline void block_vectors(const BlockQ4_1& b, __m256 v[4]) {
  const __m128 dm = _mm_cvtph_ps(_mm_loadu_si32(&b));  // d, m
  const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int h = 0; h < 2; ++h) {  // bytes 8h..8h+7 hold weights 8h.. (low nibbles) and 16 + 8h.. (high)
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + 8 * h)));
    v[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, mask)), d, m);
    v[h + 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d, m);
  }
}

[[gnu::always_inline]] inline void block_vectors(const BlockQ8_0& b, __m256 v[4]) {
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(b.d));
  for (int i = 0; i < 4; ++i) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + 8 * i));
    v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
  }
}

template <typename B>
inline void dequant_block(const B& b, float* out) {
  __m256 v[4];
  block_vectors(b, v);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, v[i]);
}

// MR rows of x against NR rows of blocks dequantized in registers: the same values and the same FMA order
// as tile<float, MR, NR> on the dequantized rows (so the same bits), without the store to and reload from a
// dequantization buffer, which made the few-row GEMMs compute-bound at ~0.5 cycles per weight.
// (Not inlined: each MR x NR shape is compiled on its own; inlined into one caller they were 20-100% slower.)
template <typename B, int MR, int NR>
__attribute__((noinline)) void block_tile(const float* x, int64_t K, const B* w, float* y, int64_t ldy, const float* bias) {
  const int64_t kb = K / 32;
  __m256 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      __m256 v[4];
      block_vectors(w[j * kb + b], v);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const float* xb = x + i * K + 32 * b;  // read per use (L1 hits, FMA memory operands): held, they spilled
        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), v[0], acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), v[1], acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), v[2], acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), v[3], acc[i][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum8(acc[i][j]) + (bias ? bias[j] : 0.f);
}

template <typename B>
inline void dequant_rows(const B* w, int64_t rows, int64_t K, float* out) {
  const int64_t kb = K / 32;
  for (int64_t i = 0; i < rows * kb; ++i) dequant_block(w[i], out + i * 32);
}

template <typename WT>
constexpr bool kBlocks = std::is_same_v<WT, BlockQ4_1> || std::is_same_v<WT, BlockQ8_0>;

// Whether a GEMM over M rows of x reads these blocks in registers (block_tile). Q8_0 only from 5 rows on: below,
// it measured slower that way than through the dequantization buffer (LM head at M = 1: 1.6-1.8 vs 1.5 ms); at
// 5-8 rows (a speculative verify step) 0.6-0.85x the buffer's time, whose 2-row tiles reread it.
template <typename WT>
inline bool in_registers(int64_t M) {
  return std::is_same_v<WT, BlockQ4_1> || (std::is_same_v<WT, BlockQ8_0> && M >= 5);
}

// The MR x NR tile for W's format: fp32 / bf16 rows, or blocks read in registers.
template <typename WT, int MR, int NR>
inline void any_tile(const float* x, int64_t K, const WT* w, float* y, int64_t ldy, const float* bias) {
  if constexpr (kBlocks<WT>)
    block_tile<WT, MR, NR>(x, K, w, y, ldy, bias);
  else
    tile<WT, MR, NR>(x, K, w, y, ldy, bias);
}

// Every row of x against NR rows of W, two rows of x at a time. Blocks (read in registers): up to 8 rows in one
// tile, so a block is dequantized once for all of them (a speculative verify step's 5 rows, as 4 + 1, dequantized
// every block twice: 25-30% slower).
template <typename WT, int NR>
inline void rows(const float* x, int64_t M, int64_t K, const WT* w, float* y, int64_t N, const float* bias) {
  int64_t m = 0;
  if constexpr (kBlocks<WT>) {
    for (; m + 8 <= M; m += 8) any_tile<WT, 8, NR>(x + m * K, K, w, y + m * N, N, bias);
    switch (M - m) {
      case 7: return any_tile<WT, 7, NR>(x + m * K, K, w, y + m * N, N, bias);
      case 6: return any_tile<WT, 6, NR>(x + m * K, K, w, y + m * N, N, bias);
      case 5: return any_tile<WT, 5, NR>(x + m * K, K, w, y + m * N, N, bias);
      case 4: return any_tile<WT, 4, NR>(x + m * K, K, w, y + m * N, N, bias);
      case 3: return any_tile<WT, 3, NR>(x + m * K, K, w, y + m * N, N, bias);
      default: break;
    }
  }
  for (; m + 2 <= M; m += 2) any_tile<WT, 2, NR>(x + m * K, K, w, y + m * N, N, bias);
  if (m < M) any_tile<WT, 1, NR>(x + m * K, K, w, y + m * N, N, bias);
}

// NR weight rows starting at w (nr < NR at the end of W: one row at a time).
template <typename WT, int64_t NR>
inline void row_block(const float* x, int64_t M, int64_t K, const WT* w, int64_t nr, float* y, int64_t N,
                      const float* bias) {
  if (nr == NR) {
    rows<WT, NR>(x, M, K, w, y, N, bias);
    return;
  }
  const int64_t row_elems = kBlocks<WT> ? K / 32 : K;  // W's row stride in WT units
  for (int64_t r = 0; r < nr; ++r) rows<WT, 1>(x, M, K, w + r * row_elems, y + r, N, bias ? bias + r : nullptr);
}

// Each thread takes a contiguous range of NR-row blocks of W. Block formats are dequantized in registers
// (Q4_1), else first into a per-thread fp32 buffer (L1/L2-resident) that the fp32 tiles read.
template <typename WT, int64_t NR>
void run(const float* x, const WT* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = (N + NR - 1) / NR;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks)));
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> deq(kBlocks<WT> && !in_registers<WT>(M) ? NR * K : 0);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n = b * NR, nr = std::min<int64_t>(NR, N - n);
      const float* bn = bias ? bias + n : nullptr;
      if constexpr (kBlocks<WT>) {
        const WT* wn = w + n * (K / 32);
        if (in_registers<WT>(M)) {
          row_block<WT, NR>(x, M, K, wn, nr, y + n, N, bn);
        } else {
          dequant_rows(wn, nr, K, deq.data());
          row_block<float, NR>(x, M, K, deq.data(), nr, y + n, N, bn);
        }
      } else {
        row_block<WT, NR>(x, M, K, w + n * K, nr, y + n, N, bn);
      }
    }
  }
}

// ---- Outer-product path for PANEL_MIN_ROWS rows and more -------------------------------------------------
// The dot-product tiles above need a horizontal sum per output and a load per FMA pair: ~60% of the FMA peak.
// From a few rows up, 16 rows of W are instead transposed into a K-major panel (panel[k][j] = W[n + j][k]) and
// PM x 16 tiles of y accumulate in registers: per k, two panel loads and PM broadcasts of x feed 2 PM FMAs, and
// no horizontal sums. Every output is the plain sequential sum over k (then + bias), whatever the tiling.
constexpr int64_t PN = 16, PM = 6, PANEL_MIN_ROWS = 16, GROUP_MIN_ROWS = 128, GROUP_BYTES = 256 << 10;

// dst[c * ldd + r] = src[r * lds + c] for an 8 x 8 block
inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// The K-major panel of W's rows [n, n + nr) (nr <= PN; missing rows are zero). `rows` is fp32 scratch of
// PN x K for the formats that are not fp32 rows already.
template <typename WT>
void pack_panel(const WT* w, int64_t nr, int64_t K, float* rows, float* panel) {
  const float* src;
  if constexpr (std::is_same_v<WT, float>) {
    src = w;
  } else if constexpr (kBlocks<WT>) {
    dequant_rows(w, nr, K, rows);
    src = rows;
  } else {  // bf16 rows: widen
    for (int64_t i = 0; i < nr * K; i += 8) _mm256_storeu_ps(rows + i, load8(w + i));
    src = rows;
  }
  if (nr < PN) {  // the last rows of W: pad with zero rows
    if (src != rows) std::copy(src, src + nr * K, rows);
    std::fill(rows + nr * K, rows + PN * K, 0.f);
    src = rows;
  }
  for (int64_t k = 0; k < K; k += 8)
    for (int64_t j = 0; j < PN; j += 8) transpose8x8(src + j * K + k, K, panel + k * PN + j, PN);
}

// r[i] byte j becomes r[j] byte i, for 16 x 16 bytes in each 128-bit lane: four rounds of the perfect shuffle.
inline void transpose16x16_u8(__m256i r[16]) {
  for (int round = 0; round < 4; ++round) {
    __m256i t[16];
    for (int p = 0; p < 8; ++p) {
      t[2 * p] = _mm256_unpacklo_epi8(r[p], r[p + 8]);
      t[2 * p + 1] = _mm256_unpackhi_epi8(r[p], r[p + 8]);
    }
    std::copy(t, t + 16, r);
  }
}

// The scales d and minimums m of block column b of 16 Q4_1 rows (kb blocks each) as fp32 vectors of rows 0-7 and
// 8-15, zero past nr: each row's 4 header bytes in one masked gather per 8 rows (scalar loads through a stack
// array stalled on store forwarding: a quarter of the pack's time).
inline void row_scales(const BlockQ4_1* w, int64_t kb, int64_t b, int64_t nr, __m256 d[2], __m256 m[2]) {
  const __m256i stride = _mm256_set1_epi32(static_cast<int>(kb * sizeof(BlockQ4_1)));
  const __m256i rows = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // per 128-bit lane: the 4 d halves, then the 4 m halves; then the lanes' d halves together, m halves together
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int h = 0; h < 2; ++h) {
    const __m256i j = _mm256_add_epi32(rows, _mm256_set1_epi32(8 * h));
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nr)), j);
    const __m256i g = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(w + b),
                                                  _mm256_mullo_epi32(j, stride), live, 1);
    const __m256i dm = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(g, split), 0xD8);  // d0..d7, m0..m7
    d[h] = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    m[h] = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
  }
}

// Panel rows k = i and i + 16 of a block column from q, its 16 rows' quant bytes i (weight i in the low nibble,
// i + 16 in the high one): fma(q, d, m) as in block_vectors.
inline void store_q4_1(__m128i q, const __m256 d[2], const __m256 m[2], float* out) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  const __m256i v[2] = {_mm256_cvtepu8_epi32(q), _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q))};  // rows 0-7, 8-15
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_ps(out + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v[h], mask)), d[h], m[h]));
    _mm256_storeu_ps(out + 16 * PN + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v[h], 4)), d[h], m[h]));
  }
}

// pack_panel for nr <= PN rows of Q4_1 blocks, written straight from the quants: the 16 rows' quant bytes of two
// block columns (one per 128-bit lane) are transposed as bytes, an eighth of the shuffles of transposing their fp32
// values, then widened with the rows' scales: the same values as pack_panel's dequantize-then-transpose, without
// its fp32 rows buffer (issue 32: 1.1-1.2x at 16-37 rows of x, where the pack is ~a third of the call).
inline void pack_block_panel(const BlockQ4_1* w, int64_t nr, int64_t K, float* panel) {
  const int64_t kb = K / 32;
  for (int64_t b = 0; b < kb; b += 2) {  // block columns b (low lanes) and b + 1 (high lanes)
    const bool pair = b + 1 < kb;
    __m256 d[2][2], m[2][2];
    row_scales(w, kb, b, nr, d[0], m[0]);
    if (pair) row_scales(w, kb, b + 1, nr, d[1], m[1]);
    __m256i q[16];
    for (int64_t j = 0; j < PN; ++j) {
      const __m128i lo = j < nr ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[j * kb + b].qs)) : _mm_setzero_si128();
      const __m128i hi = j < nr && pair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[j * kb + b + 1].qs))
                                        : _mm_setzero_si128();
      q[j] = _mm256_set_m128i(hi, lo);
    }
    transpose16x16_u8(q);
    for (int i = 0; i < 16; ++i) {
      store_q4_1(_mm256_castsi256_si128(q[i]), d[0], m[0], panel + (32 * b + i) * PN);
      if (pair) store_q4_1(_mm256_extracti128_si256(q[i], 1), d[1], m[1], panel + (32 * (b + 1) + i) * PN);
    }
  }
}

// y[i][j] = sum_k x[i][k] * panel[k][j] (+ bias[j]) for i < MR rows, j < nr columns
template <int MR>
inline void panel_tile(const float* x, int64_t K, const float* panel, float* y, int64_t ldy, const float* bias,
                       int64_t nr) {
  __m256 c[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * PN), w1 = _mm256_loadu_ps(panel + k * PN + 8);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * K + k);
      c[i][0] = _mm256_fmadd_ps(xv, w0, c[i][0]);
      c[i][1] = _mm256_fmadd_ps(xv, w1, c[i][1]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    if (bias) {
      c[i][0] = _mm256_add_ps(c[i][0], _mm256_loadu_ps(bias));
      c[i][1] = _mm256_add_ps(c[i][1], _mm256_loadu_ps(bias + 8));
    }
    if (nr == PN) {
      _mm256_storeu_ps(y + i * ldy, c[i][0]);
      _mm256_storeu_ps(y + i * ldy + 8, c[i][1]);
    } else {
      alignas(32) float tmp[PN];
      _mm256_store_ps(tmp, c[i][0]);
      _mm256_store_ps(tmp + 8, c[i][1]);
      std::copy(tmp, tmp + nr, y + i * ldy);
    }
  }
}

template <int MR>
void panel_rows(const float* x, int64_t M, int64_t K, const float* panel, float* y, int64_t N, const float* bias,
                int64_t nr) {
  if constexpr (MR > 0) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) panel_tile<MR>(x + m * K, K, panel, y + m * N, N, bias, nr);
    if (m < M) panel_rows<MR - 1>(x + m * K, M - m, K, panel, y + m * N, N, bias, nr);
  }
}

// One tile of MR rows of x against `count` packed panels (PN * K floats apart) of consecutive columns of y; the last
// panel holds last_nr columns.
template <int MR>
void tile_panels(const float* x, int64_t K, const float* panels, int64_t count, float* y, int64_t N,
                 const float* bias, int64_t last_nr) {
  for (int64_t g = 0; g < count; ++g)
    panel_tile<MR>(x, K, panels + g * PN * K, y + g * PN, N, bias ? bias + g * PN : nullptr,
                   g + 1 == count ? last_nr : PN);
}

// The rows of x in tiles of as even a size as fits PM (19 rows: 5, 5, 5, 4 rather than 6, 6, 6, 1: a tile of 1-3
// rows holds 2-6 accumulators, too few to cover the FMA latency, and costs as much as one of 4 rows), each tile
// applied to every panel of the group while it is in L1.
void balanced_panel_rows(const float* x, int64_t M, int64_t K, const float* panels, int64_t count, float* y,
                         int64_t N, const float* bias, int64_t last_nr) {
  const int64_t tiles = (M + PM - 1) / PM, base = M / tiles, larger = M % tiles;
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = base + (t < larger);
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (rows) {  // at least 4 from 16 rows up (the panels' range)
      case 6: tile_panels<6>(xm, K, panels, count, ym, N, bias, last_nr); break;
      case 5: tile_panels<5>(xm, K, panels, count, ym, N, bias, last_nr); break;
      case 4: tile_panels<4>(xm, K, panels, count, ym, N, bias, last_nr); break;
      case 3: tile_panels<3>(xm, K, panels, count, ym, N, bias, last_nr); break;
      case 2: tile_panels<2>(xm, K, panels, count, ym, N, bias, last_nr); break;
      default: tile_panels<1>(xm, K, panels, count, ym, N, bias, last_nr); break;
    }
    m += rows;
  }
}

// PAGEDLLM_GEMM_V1=1: the panels as before issue 32 (blocks dequantized into fp32 rows, then transposed; tiles of
// 6 rows and the rest), for A/B benchmarks against the current kernel in one process (read at every call).
inline bool gemm_v1() {
  const char* v = std::getenv("PAGEDLLM_GEMM_V1");
  return v && v[0] == '1';
}

// Each thread takes a contiguous range of 16-row panels of W; a packed panel (L2-resident) serves every row of x.
// Below GROUP_MIN_ROWS rows, while a panel's tiles run, the next panel's Q4_1 blocks are prefetched into L2: packing
// reads 16 short row streams (360 bytes each at K = 576) that the hardware prefetcher leaves to DRAM latency. The 30
// layers' GEMMs of the embedded model, blocks out of cache (Zen 3, 2 threads, alternating call by call): 1.05-1.07x
// at 16 rows, 1.03-1.05x at 24-40, 1.01-1.03x at 48-64; from GROUP_MIN_ROWS rows the pack is a small share. Not for
// Q8_0 (the LM head, 612-byte rows): 0.98x.
// (Packing and applying it in L1-sized K chunks measured no faster, again with Q4_1's byte-transposed pack. Q8_0
// keeps the dequantize-then-transpose pack: its bytes transposed the same way measured slower for the LM head.)
// From GROUP_MIN_ROWS rows, where x no longer stays in L2 between panels, a group of panels (GROUP_BYTES) is packed
// and each tile of x applied to all of them: x is streamed once per group instead of once per panel.
template <typename WT>
void run_panels(const float* x, const WT* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t panels = (N + PN - 1) / PN, panel_floats = PN * K;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels)));
  const int64_t row_elems = kBlocks<WT> ? K / 32 : K;  // W's row stride in WT units
  const bool v1 = gemm_v1();
  const int64_t group = !v1 && M >= GROUP_MIN_ROWS ? std::max<int64_t>(1, GROUP_BYTES / (4 * panel_floats)) : 1;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> rows(v1 || !std::is_same_v<WT, BlockQ4_1> ? panel_floats : 0), packed(group * panel_floats),
        bias_pad(group * PN, 0.f);
    const int64_t per = (panels + omp_get_num_threads() - 1) / omp_get_num_threads();
    const int64_t begin = std::min(panels, omp_get_thread_num() * per), end = std::min(panels, begin + per);
    for (int64_t p0 = begin; p0 < end; p0 += group) {
      const int64_t count = std::min(group, end - p0), n0 = p0 * PN, ncols = std::min(count * PN, N - n0);
      const int64_t last_nr = ncols - (count - 1) * PN;
      for (int64_t g = 0; g < count; ++g) {
        const int64_t n = n0 + g * PN, nr = g + 1 == count ? last_nr : PN;
        if (std::is_same_v<WT, BlockQ4_1> && !v1)
          pack_block_panel(reinterpret_cast<const BlockQ4_1*>(w) + n * row_elems, nr, K, packed.data() + g * panel_floats);
        else
          pack_panel(w + n * row_elems, nr, K, rows.data(), packed.data() + g * panel_floats);
      }
      if (std::is_same_v<WT, BlockQ4_1> && group == 1 && p0 + 1 < end) {  // the next panel toward L2 (see above)
        const int64_t n1 = n0 + PN, bytes = std::min(PN, N - n1) * row_elems * static_cast<int64_t>(sizeof(WT));
        const char* next = reinterpret_cast<const char*>(w + n1 * row_elems);
        for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
      }
      const float* bn = nullptr;
      if (bias) {
        std::copy(bias + n0, bias + n0 + ncols, bias_pad.data());
        bn = bias_pad.data();
      }
      if (v1)
        panel_rows<PM>(x, M, K, packed.data(), y + n0, N, bn, last_nr);
      else
        balanced_panel_rows(x, M, K, packed.data(), count, y + n0, N, bn, last_nr);
    }
  }
}

// Rows of W per tile. fp32 / bf16 rows and the dequantization buffer: 8 for one row of x (more loads in flight),
// else 4 (the 2x4 tile fits the registers). Q4_1 blocks: 4 for up to 3 rows of x (at least 8 accumulators keep
// both FMA pipes busy through their 4-cycle latency), else 2 (up to 8 x 2 tiles); Q8_0 blocks from 5 rows: 1 (the
// fastest measured). From PANEL_MIN_ROWS rows on, the outer-product panels.
template <typename WT>
void dispatch(const float* x, const WT* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  if (M >= PANEL_MIN_ROWS)
    run_panels<WT>(x, w, bias, y, M, N, K);
  else if (M == 1 && !in_registers<WT>(M))
    run<WT, 8>(x, w, bias, y, M, N, K);
  else if (M > 3 && std::is_same_v<WT, BlockQ4_1>)
    run<WT, 2>(x, w, bias, y, M, N, K);
  else if (in_registers<WT>(M) && std::is_same_v<WT, BlockQ8_0>)
    run<WT, 1>(x, w, bias, y, M, N, K);
  else
    run<WT, 4>(x, w, bias, y, M, N, K);
}

}  // namespace

// x: [M, K] float32 contiguous; w: [N, K] float32 or bfloat16 contiguous; bias: None or [N] float32.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "w must be float32 or bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  TORCH_CHECK(x.size(1) % 8 == 0, "K must be a multiple of 8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor b;
  const float* bp = bias_ptr(bias, N, b);
  auto y = torch::empty({M, N}, x.options());
  if (w.scalar_type() == at::kFloat)
    dispatch<float>(x.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), M, N, K);
  else
    dispatch<at::BFloat16>(x.data_ptr<float>(), w.data_ptr<at::BFloat16>(), bp, y.data_ptr<float>(), M, N, K);
  return y;
}

// x: [M, K] float32 contiguous; wq: [N, K / 32 * block bytes] uint8 rows of GGUF blocks of type qtype.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor wq, int64_t qtype, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = check_blocks(wq, qtype, K);
  torch::Tensor b;
  const float* bp = bias_ptr(bias, N, b);
  auto y = torch::empty({M, N}, x.options());
  if (qtype == BlockQ4_1::kType)
    dispatch(x.data_ptr<float>(), reinterpret_cast<const BlockQ4_1*>(wq.data_ptr<uint8_t>()), bp,
                   y.data_ptr<float>(), M, N, K);
  else
    dispatch(x.data_ptr<float>(), reinterpret_cast<const BlockQ8_0*>(wq.data_ptr<uint8_t>()), bp,
                   y.data_ptr<float>(), M, N, K);
  return y;
}

// The fp32 matrix [N, K] of GGUF rows (embedding lookups; tests).
torch::Tensor dequantize(torch::Tensor wq, int64_t qtype, int64_t K) {
  const int64_t N = check_blocks(wq, qtype, K);
  auto out = torch::empty({N, K}, wq.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* w = wq.data_ptr<uint8_t>();
  const int64_t chunk = 64;  // rows per task
#pragma omp parallel for schedule(static) if (N * K >= (1 << 16))
  for (int64_t r = 0; r < N; r += chunk) {
    const int64_t nr = std::min(chunk, N - r);
    if (qtype == BlockQ4_1::kType)
      dequant_rows(reinterpret_cast<const BlockQ4_1*>(w) + r * (K / 32), nr, K, o + r * K);
    else
      dequant_rows(reinterpret_cast<const BlockQ8_0*>(w) + r * (K / 32), nr, K, o + r * K);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");  // x @ w.T (+ bias), w float32 or bfloat16
  m.def("quant_linear(Tensor x, Tensor wq, int qtype, Tensor? bias=None) -> Tensor");  // w in GGUF Q4_1/Q8_0 blocks
  m.def("dequantize(Tensor wq, int qtype, int K) -> Tensor");  // GGUF rows -> float32 [N, K] (embedding lookups)
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("linear", &linear);
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize", &dequantize);
}
