// Paged attention for x86 CPUs, reading K/V in place from the block pool.
//
// One work item = (sequence, query tile, kv head), or a part of its keys for decodes over a long context
// (split-K, see make_items).  All `group` query heads that share the kv head are computed together, so every
// K/V row is read once per tile.  Keys are visited in chunks of up to CHUNK logical positions through the block
// table (the next chunk is prefetched where the hardware prefetcher can't guess it); scores and P@V run as 3-row
// register blocks (AVX-512 where the compiler targets it, else AVX2, else scalar) and softmax is online
// (flash-decoding style) with a vectorised exp and fp32 accumulation.  Works for decodes (tile = the single query)
// and prefill chunks (tile = up to q_tile queries, causal: query at position p sees keys 0..p).
// Caches may be fp32 or bf16; q/out may be fp32 or bf16.
// Quantized caches (pagedllm/kv/kv_quant.py): int8 with an fp32 scale per (kv head, block), or fp8 e4m3 / e5m2
// with one per kv head (a [Hkv, num_blocks] view with block stride 0). Rows are dequantized into the chunk's
// L1 buffer as they are read (AVX2 + F16C chosen at run time, scalar otherwise), then go through the same
// score / P@V blocks as fp32, except int8: its codes are converted in registers inside those blocks, and the
// block's scale multiplies each key's score and each value's softmax weight (4x fewer bytes read than fp32, and
// no float copy written and read back). The write path quantizes the step's new rows (same bits as Python's).
#include "ops_common.h"
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAGEDLLM_X86 1
#endif

namespace {

using namespace pagedllm_ops;  // load8, hsum8, hmax8

// ---- quantized rows: code -> float, with the row's scale -------------------------------------------
enum class KvFormat { Int8, E4M3, E5M2 };

template <KvFormat F>
inline float decode_scalar(uint8_t b) {
  if constexpr (F == KvFormat::Int8) return static_cast<float>(static_cast<int8_t>(b));
  else if constexpr (F == KvFormat::E4M3) return c10::detail::fp8e4m3fn_to_fp32_value(b);
  else return c10::detail::fp8e5m2_to_fp32_value(b);
}

template <KvFormat F>
void dequant_scalar(const uint8_t* src, float scale, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = decode_scalar<F>(src[d]) * scale;
}

#ifdef PAGEDLLM_X86
// 8 codes -> 8 floats. fp8 goes through fp16 (F16C): e5m2 is the high byte of an fp16; e4m3's exponent and
// mantissa bits moved into fp16's place give value / 2^8 (normal and subnormal alike), folded into the scale.
template <KvFormat F>
__attribute__((target("avx2,fma,f16c"))) void dequant_avx2(const uint8_t* src, float scale, float* dst, int64_t n) {
  const __m256 sc = _mm256_set1_ps(F == KvFormat::E4M3 ? scale * 256.f : scale);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d));
    __m256 x;
    if constexpr (F == KvFormat::Int8) {
      x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    } else {
      const __m128i w = _mm_cvtepu8_epi16(b);
      const __m128i h = F == KvFormat::E5M2
                            ? _mm_slli_epi16(w, 8)
                            : _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                           _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
      x = _mm256_cvtph_ps(h);
    }
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(x, sc));
  }
  for (; d < n; ++d) dst[d] = decode_scalar<F>(src[d]) * scale;
}
const bool kHasAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif

template <KvFormat F>
inline void dequant_row(const uint8_t* src, float scale, float* dst, int64_t n) {
#ifdef PAGEDLLM_X86
  if (kHasAvx2) return dequant_avx2<F>(src, scale, dst, n);
#endif
  dequant_scalar<F>(src, scale, dst, n);
}

// the storage type of each format (the kernel templates dispatch on it)
struct Int8Code { uint8_t b; static constexpr KvFormat format = KvFormat::Int8; };
struct E4M3Code { uint8_t b; static constexpr KvFormat format = KvFormat::E4M3; };
struct E5M2Code { uint8_t b; static constexpr KvFormat format = KvFormat::E5M2; };
template <typename T> constexpr bool is_code_v = std::is_same_v<T, Int8Code> || std::is_same_v<T, E4M3Code> ||
                                                 std::is_same_v<T, E5M2Code>;

// A quantized pool's scales: scale of (kv head h, physical block b) = p[h * s0 + b * s1] (s1 = 0: per head).
struct Scales {
  const float* p = nullptr;
  int64_t s0 = 0, s1 = 0;
  float at(int64_t h, int64_t b) const { return p[h * s0 + b * s1]; }
};

constexpr int64_t CHUNK = 64;

// The next chunk's K/V lines, issued a few at a time from inside the score and P@V loops (see run_items; AVX-512
// and AVX2 builds fill it). Into L2 (prefetcht1), not L1: an L1 prefetch holds one of the core's few L1 fill
// buffers until its line arrives, and the chunk's own loads queue behind them (W1's decode shape with scattered
// blocks, Zen 4: 23.4 -> 20.4 ms for 30 layers).
struct PrefetchQueue {
  // the chunk's K and V rows as ranges of lines, one per block (a block's rows are contiguous): the V range of each
  // at the same offsets as its K range. Issued a line pair (K, V) at a time, from a cursor. A list of every line,
  // written and then read back a line at a time, cost about as many instructions as the score and P@V FMAs it fed:
  // attend_qkv with its K/V in cache 1.06-1.21x faster this way (Zen 3, 2 threads), out of cache with 16-token
  // blocks 1.11x; with 128-token blocks out of cache (W1's decode steps) even, bound by the DRAM. Issuing the lines
  // two chunks ahead instead of one measured 3-11% slower there.
  const char* k[CHUNK];
  const char* v[CHUNK];
  int64_t bytes[CHUNK];
  int n = 0, per_scores = 0, per_pv = 0;  // ranges; line pairs per 4-key score step / per P@V key
  int r = 0;                              // the range being issued
  int64_t off = 0;                        // the next line's offset in it
  int64_t pairs = 0;                      // line pairs in all the ranges
  void add(const char* kr, const char* vr, int64_t nbytes) {
    k[n] = kr, v[n] = vr, bytes[n++] = nbytes;
    pairs += (nbytes + 63) / 64;
  }
  inline void issue(int64_t count) {  // the cursor in locals: GCC kept the fields in memory, a store a line
    if (r >= n || count <= 0) return;
    const char* kc = k[r] + off;
    const char* kend = k[r] + bytes[r];
    ptrdiff_t to_v = v[r] - k[r];
    for (;;) {
      __builtin_prefetch(kc, 0, 2);
      __builtin_prefetch(kc + to_v, 0, 2);
      kc += 64;
      if (kc >= kend) {
        if (++r >= n) return;
        kc = k[r], kend = kc + bytes[r], to_v = v[r] - kc;
      }
      if (--count == 0) break;
    }
    off = kc - k[r];
  }
  void issue_all() { issue(pairs); }
  void reset() { n = r = 0, off = pairs = 0; }
};

// K/V row elements as floats: fp32 rows as they are, int8 codes unscaled (their block's scale multiplies the
// dot product / the softmax weight instead, so an int8 row is converted in registers, never stored as floats).
inline float elem(const float* p, int64_t d) { return p[d]; }
inline float elem(const int8_t* p, int64_t d) { return static_cast<float>(p[d]); }
inline float elem(const at::BFloat16* p, int64_t d) { return static_cast<float>(p[d]); }
#ifdef __AVX2__
// The score loop of every layout and ISA: NR rows x 4 keys of accumulators per step (each K vector feeds NR FMAs),
// summed 4 keys at a time; dot4(o, a) / dot1(o, a) add the products of keys o.. into them. Sum: the vector type and
// its sums (Sum8: AVX2, Sum16: AVX-512). kmul: a multiplier per key (an int8 row's block scale), or null.
template <int NR, typename Sum, typename Dot4, typename Dot1>
inline void score_loop(int64_t n, float scale, const float* kmul, float* S, PrefetchQueue* pf, Dot4&& dot4,
                       Dot1&& dot1) {
  using V = typename Sum::V;
  const __m128 sc = _mm_set1_ps(scale);
  int64_t o = 0;
  for (; o + 4 <= n; o += 4) {
    if (pf) pf->issue(pf->per_scores);
    V a[NR][4];
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < 4; ++j) a[i][j] = Sum::zero();
    dot4(o, a);
    const __m128 sk = kmul ? _mm_mul_ps(sc, _mm_loadu_ps(kmul + o)) : sc;
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i)
      _mm_storeu_ps(S + i * CHUNK + o, _mm_mul_ps(Sum::hsum4(a[i][0], a[i][1], a[i][2], a[i][3]), sk));
  }
  for (; o < n; ++o) {
    V a[NR];
    for (int i = 0; i < NR; ++i) a[i] = Sum::zero();
    dot1(o, a);
    const float so = kmul ? scale * kmul[o] : scale;
    for (int i = 0; i < NR; ++i) S[i * CHUNK + o] = Sum::reduce(a[i]) * so;
  }
}
#endif

#ifdef __AVX512F__
using pagedllm_ops::load16;  // fp32 and bf16 rows; int8 codes here (a local overload would hide them otherwise)
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// the four horizontal sums of a0..a3, in order: 128-bit lanes folded pairwise across the four vectors (6 lane
// shuffles, 3 adds), then each lane's 4 floats summed in place and lanes 0, 4, 8, 12 picked
inline __m128 hsum4x16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4,
                                                                        8, 12), u));
}
struct Sum16 {
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static __m128 hsum4(V a0, V a1, V a2, V a3) { return hsum4x16(a0, a1, a2, a3); }
  static float reduce(V a) { return _mm512_reduce_add_ps(a); }
};

// S rows r < NR (CHUNK apart) for keys [0, n): NR rows x 4 keys of accumulators in registers (NR = 3: 12 of the
// 32), so each K vector (int8: converted once) feeds NR FMAs. D % 16 == 0; ND = D / 16 keeps the Q rows in
// registers too (loads, not FMAs, bounded the loop with a Q operand from memory per FMA), ND = 0 reloads them.
template <int NR, int ND, typename T>
inline void scores_rows16(const float* Q, const T* const* K, const float* kmul, int64_t n, int64_t D, float scale,
                          float* S, PrefetchQueue* pf) {
  __m512 qr[NR][ND > 0 ? ND : 1];
  if constexpr (ND > 0)
    for (int i = 0; i < NR; ++i)
      for (int d = 0; d < ND; ++d) qr[i][d] = _mm512_loadu_ps(Q + i * D + 16 * d);
  auto dot4 = [&](int64_t o, __m512 (&a)[NR][4]) {
    auto step = [&](int64_t d, auto&& qv) {
      const __m512 x[4] = {load16(K[o] + d), load16(K[o + 1] + d), load16(K[o + 2] + d), load16(K[o + 3] + d)};
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i)
        for (int j = 0; j < 4; ++j) a[i][j] = _mm512_fmadd_ps(qv(i), x[j], a[i][j]);
    };
    if constexpr (ND > 0) {
#pragma GCC unroll 4
      for (int d = 0; d < ND; ++d) step(16 * d, [&](int i) { return qr[i][d]; });
    } else {
      for (int64_t d = 0; d < D; d += 16) step(d, [&](int i) { return _mm512_loadu_ps(Q + i * D + d); });
    }
  };
  auto dot1 = [&](int64_t o, __m512 (&a)[NR]) {
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = load16(K[o] + d);
      for (int i = 0; i < NR; ++i) a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(Q + i * D + d), x, a[i]);
    }
  };
  score_loop<NR, Sum16>(n, scale, kmul, S, pf, dot4, dot1);
}

// bf16 rows at head_dim 32 / 64, 32 dims per 64-byte load: the even dims are the load shifted left 16 bits and the
// odd dims the load with its low halves cleared, no cross-lane shuffle. Widening 16 dims at a time took a vpmovzxwd
// (the shuffle port, which AVX-512 FMAs share) and a shift per 16 dims; this takes a shift or an and per 16, so the
// score and P@V loops spend half the non-FMA uops on the FMA ports. q and the P@V accumulators are put in the same
// even / odd order once per call (two permutes per 32 dims), and the accumulators back on the way out.
inline void widen_pairs(const at::BFloat16* p, __m512& even, __m512& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
inline void split_pairs(const float* p, __m512& even, __m512& odd) {
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
  even = _mm512_permutex2var_ps(a, ev, b);
  odd = _mm512_permutex2var_ps(a, od, b);
}
inline void join_pairs(__m512 even, __m512 odd, float* p) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(p, _mm512_permutex2var_ps(even, lo, odd));
  _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(even, hi, odd));
}

// scores_rows16 for bf16 rows, G = D / 32 groups of 32 dims (G <= 2: q in 4 G NR registers)
template <int NR, int G>
inline void scores_rows_bf16(const float* Q, const at::BFloat16* const* K, int64_t n, int64_t D, float scale,
                             float* S, PrefetchQueue* pf) {
  __m512 qe[NR][G], qo[NR][G];
  for (int i = 0; i < NR; ++i)
    for (int g = 0; g < G; ++g) split_pairs(Q + i * D + 32 * g, qe[i][g], qo[i][g]);
  auto dot4 = [&](int64_t o, __m512 (&a)[NR][4]) {
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512 e, od;
        widen_pairs(K[o + j] + 32 * g, e, od);
#pragma GCC unroll 4
        for (int i = 0; i < NR; ++i) a[i][j] = _mm512_fmadd_ps(qo[i][g], od, _mm512_fmadd_ps(qe[i][g], e, a[i][j]));
      }
    }
  };
  auto dot1 = [&](int64_t o, __m512 (&a)[NR]) {
    for (int g = 0; g < G; ++g) {
      __m512 e, od;
      widen_pairs(K[o] + 32 * g, e, od);
      for (int i = 0; i < NR; ++i) a[i] = _mm512_fmadd_ps(qo[i][g], od, _mm512_fmadd_ps(qe[i][g], e, a[i]));
    }
  };
  score_loop<NR, Sum16>(n, scale, static_cast<const float*>(nullptr), S, pf, dot4, dot1);
}

// pv_rows16 for bf16 rows over all D = 32 G dims (G <= 2: NR x 2 G accumulators)
template <int NR, int G>
inline void pv_rows_bf16(const float* P, const at::BFloat16* const* V, int64_t n, int64_t D, float* A,
                         PrefetchQueue* pf) {
  __m512 ce[NR][G], co[NR][G];
  for (int i = 0; i < NR; ++i)
    for (int g = 0; g < G; ++g) split_pairs(A + i * D + 32 * g, ce[i][g], co[i][g]);
  for (int64_t o = 0; o < n; ++o) {
    if (pf) pf->issue(pf->per_pv);
    __m512 e[G], od[G];
    for (int g = 0; g < G; ++g) widen_pairs(V[o] + 32 * g, e[g], od[g]);
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      const __m512 w = _mm512_set1_ps(P[i * CHUNK + o]);
      for (int g = 0; g < G; ++g) {
        ce[i][g] = _mm512_fmadd_ps(w, e[g], ce[i][g]);
        co[i][g] = _mm512_fmadd_ps(w, od[g], co[i][g]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int g = 0; g < G; ++g) join_pairs(ce[i][g], co[i][g], A + i * D + 32 * g);
}

#ifdef __AVX512BF16__
// scores_rows_bf16 where the query rows hold bf16 values exactly (a bf16 model's q): VDPBF16PS multiplies 32 dims of a
// K row by the query's in one instruction, without widening the row; the products are exact in fp32, only the order
// of the sum differs (dims in pairs)
template <int NR, int G>
inline void scores_rows_dpbf16(const float* Q, const at::BFloat16* const* K, int64_t n, int64_t D, float scale,
                               float* S, PrefetchQueue* pf) {
  __m512bh qb[NR][G];
  for (int i = 0; i < NR; ++i)
    for (int g = 0; g < G; ++g)
      qb[i][g] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(Q + i * D + 32 * g + 16), _mm512_loadu_ps(Q + i * D + 32 * g));
  auto dot4 = [&](int64_t o, __m512 (&a)[NR][4]) {
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(K[o + j] + 32 * g);
#pragma GCC unroll 4
        for (int i = 0; i < NR; ++i) a[i][j] = _mm512_dpbf16_ps(a[i][j], qb[i][g], k);
      }
    }
  };
  auto dot1 = [&](int64_t o, __m512 (&a)[NR]) {
    for (int g = 0; g < G; ++g) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(K[o] + 32 * g);
      for (int i = 0; i < NR; ++i) a[i] = _mm512_dpbf16_ps(a[i], qb[i][g], k);
    }
  };
  score_loop<NR, Sum16>(n, scale, static_cast<const float*>(nullptr), S, pf, dot4, dot1);
}
#endif

template <int NR, typename T>
inline void scores_cols16(const float* Q, const T* const* K, const float* kmul, int64_t n, int64_t D, float scale,
                          float* S, PrefetchQueue* pf, bool q_bf16) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#ifdef __AVX512BF16__
    if (q_bf16 && D == 64) return scores_rows_dpbf16<NR, 2>(Q, K, n, D, scale, S, pf);
    if (q_bf16 && D == 32) return scores_rows_dpbf16<NR, 1>(Q, K, n, D, scale, S, pf);
#endif
    if (D == 64) return scores_rows_bf16<NR, 2>(Q, K, n, D, scale, S, pf);
    if (D == 32) return scores_rows_bf16<NR, 1>(Q, K, n, D, scale, S, pf);
  }
  switch (D) {
    case 64: return scores_rows16<NR, 4>(Q, K, kmul, n, D, scale, S, pf);
    case 48: return scores_rows16<NR, 3>(Q, K, kmul, n, D, scale, S, pf);
    case 32: return scores_rows16<NR, 2>(Q, K, kmul, n, D, scale, S, pf);
    case 16: return scores_rows16<NR, 1>(Q, K, kmul, n, D, scale, S, pf);
    default: return scores_rows16<NR, 0>(Q, K, kmul, n, D, scale, S, pf);
  }
}

// A rows r < NR (D apart), columns [d, d + 16 J) += sum_o P[r * CHUNK + o] * V[o]: NR x J accumulators stay in
// registers over the chunk's keys (3 x 4 = 12), so each V vector feeds NR FMAs.
template <int NR, int J, typename T>
inline void pv_rows16(const float* P, const T* const* V, int64_t n, int64_t D, int64_t d, float* A,
                      PrefetchQueue* pf) {
  __m512 c[NR][J];
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < J; ++j) c[i][j] = _mm512_loadu_ps(A + i * D + d + 16 * j);
  for (int64_t o = 0; o < n; ++o) {
    if (pf) pf->issue(pf->per_pv);
    const T* vr = V[o] + d;
    __m512 v[J];
    for (int j = 0; j < J; ++j) v[j] = load16(vr + 16 * j);
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      const __m512 w = _mm512_set1_ps(P[i * CHUNK + o]);
      for (int j = 0; j < J; ++j) c[i][j] = _mm512_fmadd_ps(w, v[j], c[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(A + i * D + d + 16 * j, c[i][j]);
}

template <int NR, typename T>
inline void pv_cols16(const float* P, const T* const* V, int64_t n, int64_t D, float* A, PrefetchQueue* pf) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (D == 64) return pv_rows_bf16<NR, 2>(P, V, n, D, A, pf);
    if (D == 32) return pv_rows_bf16<NR, 1>(P, V, n, D, A, pf);
  }
  int64_t d = 0;
  for (; d + 64 <= D; d += 64, pf = nullptr) pv_rows16<NR, 4>(P, V, n, D, d, A, pf);
  switch ((D - d) / 16) {
    case 3: pv_rows16<NR, 3>(P, V, n, D, d, A, pf); break;
    case 2: pv_rows16<NR, 2>(P, V, n, D, d, A, pf); break;
    case 1: pv_rows16<NR, 1>(P, V, n, D, d, A, pf); break;
    default: break;
  }
}
#endif

inline void row_to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void row_to_float(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t d = 0;
#ifdef __AVX2__
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
#endif
  for (; d < n; ++d) {
    uint32_t u = static_cast<uint32_t>(s[d]) << 16;
    std::memcpy(dst + d, &u, 4);
  }
}
inline void float_to_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void float_to_row(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<at::BFloat16>(src[d]);
}

#ifdef __AVX2__
// The vector operations exp_lanes needs: Lanes8 (AVX2) and Lanes16 (AVX-512), the same code on __m256 / __m512.
#define PAGEDLLM_LANES(NAME, BITS)                                                                            \
  struct NAME {                                                                                               \
    using V = __m##BITS;                                                                                      \
    static V set(float c) { return _mm##BITS##_set1_ps(c); }                                                 \
    static V fmadd(V a, V b, V c) { return _mm##BITS##_fmadd_ps(a, b, c); }                                  \
    static V fnmadd(V a, V b, V c) { return _mm##BITS##_fnmadd_ps(a, b, c); }                                \
    static V min(V a, V b) { return _mm##BITS##_min_ps(a, b); }                                              \
    static V max(V a, V b) { return _mm##BITS##_max_ps(a, b); }                                              \
    static V mul(V a, V b) { return _mm##BITS##_mul_ps(a, b); }                                              \
    static V add(V a, V b) { return _mm##BITS##_add_ps(a, b); }                                              \
    static V floor(V a) { return _mm##BITS##_floor_ps(a); }                                                  \
    static V pow2(V n) { /* 2^n, n integral */                                                                \
      const auto e = _mm##BITS##_add_epi32(_mm##BITS##_cvtps_epi32(n), _mm##BITS##_set1_epi32(127));        \
      return _mm##BITS##_castsi##BITS##_ps(_mm##BITS##_slli_epi32(e, 23));                                   \
    }                                                                                                         \
  };
PAGEDLLM_LANES(Lanes8, 256)
#ifdef __AVX512F__
PAGEDLLM_LANES(Lanes16, 512)
#endif
#undef PAGEDLLM_LANES

// exp per lane (Cephes' expf: range reduction to [-ln2/2, ln2/2], degree-5 polynomial, scale by 2^n);
// within 2 ulp of std::exp on [-87, 88]; inputs below -88.37 (including -inf) give 0. The same operations on 8 or
// 16 lanes, so the same bits per element.
template <typename L>
inline typename L::V exp_lanes(typename L::V x) {
  x = L::min(x, L::set(88.3762626647949f));
  x = L::max(x, L::set(-88.3762626647949f));
  const typename L::V fx = L::floor(L::fmadd(x, L::set(1.44269504088896341f), L::set(0.5f)));
  x = L::fnmadd(fx, L::set(0.693359375f), x);
  x = L::fnmadd(fx, L::set(-2.12194440e-4f), x);
  typename L::V y = L::set(1.9875691500e-4f);
  y = L::fmadd(y, x, L::set(1.3981999507e-3f));
  y = L::fmadd(y, x, L::set(8.3334519073e-3f));
  y = L::fmadd(y, x, L::set(4.1665795894e-2f));
  y = L::fmadd(y, x, L::set(1.6666665459e-1f));
  y = L::fmadd(y, x, L::set(5.0000001201e-1f));
  y = L::fmadd(y, L::mul(x, x), L::add(x, L::set(1.f)));
  return L::mul(y, L::pow2(fx));
}

// v, held in a register: GCC otherwise folds a K or V load into each of the 3 FMAs that use it (3 loads where 1
// does), and the AVX2 score and P@V loops became bound by the load ports (2 a cycle on Zen 3) instead of the FMAs.
inline __m256 in_register(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

// the four horizontal sums of a0..a3, in order
inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
struct Sum8 {
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static __m128 hsum4(V a0, V a1, V a2, V a3) { return hsum4x8(a0, a1, a2, a3); }
  static float reduce(V a) { return hsum8(a); }
};

// S rows r < NR (CHUNK apart) for keys [0, n), AVX2, D % 8 == 0: NR rows x 4 keys of accumulators, each loaded K
// vector (in a register, see in_register) feeding NR FMAs. The NR Q vectors are held in registers too (NR = 3:
// all 16 in use); GCC otherwise folded a Q load into each FMA, 16 loads per 12 FMAs, bound by the load ports (Zen
// 3, one thread: 27.5 -> 17.6 cycles a key from L1; prefill chunks, 15 prompts of 32-512 tokens, 2 threads, 30
// layers 94 -> 105 GFLOP/s; W1's decode shape out of cache 28.1 -> 26.7 ms). NR < 3 takes a GQA group's last rows
// (Qwen2.5's 7 query heads a kv head: a scalar loop there had doubled a decode's attention). A row's sums are the
// same whichever NR computes it.
template <int NR, typename T>
inline void scores_rows8(const float* Q, const T* const* K, const float* kmul, int64_t n, int64_t D, float scale,
                         float* S, PrefetchQueue* pf) {
  auto dot4 = [&](int64_t o, __m256 (&a)[NR][4]) {
    const T* k[4] = {K[o], K[o + 1], K[o + 2], K[o + 3]};
    for (int64_t d = 0; d < D; d += 8) {
      __m256 q[NR];
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) q[i] = in_register(_mm256_loadu_ps(Q + i * D + d));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 x = in_register(load8(k[j] + d));
        for (int i = 0; i < NR; ++i) a[i][j] = _mm256_fmadd_ps(q[i], x, a[i][j]);
      }
    }
  };
  auto dot1 = [&](int64_t o, __m256 (&a)[NR]) {
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 x = load8(K[o] + d);
      for (int i = 0; i < NR; ++i) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(Q + i * D + d), x, a[i]);
    }
  };
  score_loop<NR, Sum8>(n, scale, kmul, S, pf, dot4, dot1);
}

// A rows r < NR (D apart) += sum_o P[r * CHUNK + o] * V[o] for o < n, AVX2, D % 32 == 0: NR rows x 32 columns of
// accumulators (12 + 3 weights + 1 V vector: the 16 registers at NR = 3), so each loaded V vector feeds NR FMAs.
// (Holding all 4 of a row's V vectors at once needs 19 registers: GCC spilled the accumulators to the stack, 8%
// slower from cache.) The prefetch queue is fed from the first 32 columns' pass.
template <int NR, typename T>
inline void pv_rows8(const float* P, const T* const* V, int64_t n, int64_t D, float* A, PrefetchQueue* pf) {
  for (int64_t d = 0; d < D; d += 32, pf = nullptr) {
    __m256 c[NR][4];
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < 4; ++j) c[i][j] = _mm256_loadu_ps(A + i * D + d + 8 * j);
    for (int64_t o = 0; o < n; ++o) {
      if (pf) pf->issue(pf->per_pv);
      const T* vr = V[o] + d;
      __m256 w[NR];
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) w[i] = _mm256_set1_ps(P[i * CHUNK + o]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 v = in_register(load8(vr + 8 * j));
        for (int i = 0; i < NR; ++i) c[i][j] = _mm256_fmadd_ps(w[i], v, c[i][j]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(A + i * D + d + 8 * j, c[i][j]);
  }
}
#endif

inline float max_of(const float* s, int64_t n, float init) {
  int64_t o = 0;
  float mx = init;
#ifdef __AVX512F__
  if (n >= 16) {
    __m512 m16 = _mm512_loadu_ps(s);
    for (o = 16; o + 16 <= n; o += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(s + o));
    mx = std::max(mx, _mm512_reduce_max_ps(m16));
  }
#endif
#ifdef __AVX2__
  if (n - o >= 8) {
    __m256 m8 = _mm256_loadu_ps(s + o);
    for (o += 8; o + 8 <= n; o += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + o));
    mx = std::max(mx, hmax8(m8));
  }
#endif
  for (; o < n; ++o) mx = std::max(mx, s[o]);
  return mx;
}

// s[o] = exp(s[o] - mx) * mul[o] (mul: a per-key factor applied after the sum, e.g. an int8 V row's block scale;
// null: 1) for o < n; returns the sum of the exps
inline float exp_sub_sum(float* s, int64_t n, float mx, const float* mul) {
  int64_t o = 0;
  float sum = 0.f;
#ifdef __AVX512F__
  {
    __m512 acc = _mm512_setzero_ps();
    const __m512 m16 = _mm512_set1_ps(mx);
    for (; o + 16 <= n; o += 16) {
      const __m512 e = exp_lanes<Lanes16>(_mm512_sub_ps(_mm512_loadu_ps(s + o), m16));
      _mm512_storeu_ps(s + o, mul ? _mm512_mul_ps(e, _mm512_loadu_ps(mul + o)) : e);
      acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
  }
#endif
#ifdef __AVX2__
  {
    __m256 acc = _mm256_setzero_ps(), m8 = _mm256_set1_ps(mx);
    for (; o + 8 <= n; o += 8) {
      const __m256 e = exp_lanes<Lanes8>(_mm256_sub_ps(_mm256_loadu_ps(s + o), m8));
      _mm256_storeu_ps(s + o, mul ? _mm256_mul_ps(e, _mm256_loadu_ps(mul + o)) : e);
      acc = _mm256_add_ps(acc, e);
    }
    sum += hsum8(acc);
  }
#endif
  for (; o < n; ++o) {
    const float e = std::exp(s[o] - mx);
    s[o] = mul ? e * mul[o] : e;
    sum += e;
  }
  return sum;
}

// S[r * CHUNK + o] = scale * dot(Q[r], K[o]) for r < R, o < n (Q rows are D apart). Blocks of 3 rows x 4 keys
// keep 12 accumulators in registers, so each loaded K vector feeds 3 FMAs and each Q vector 4 (see scores_rows8 /
// scores_cols16); a GQA group's last 1-2 rows take 1- and 2-row blocks.
// kmul: a multiplier per key (an int8 row's block scale), or null.
template <typename T>
inline void scores_block(const float* Q, int64_t R, const T* const* K, const float* kmul, int64_t n, int64_t D,
                         float scale, float* S, PrefetchQueue* pf = nullptr, bool q_bf16 = false) {
  int64_t r = 0;
#ifdef __AVX512F__
  if (D % 16 == 0) {
    for (; r + 3 <= R; r += 3, pf = nullptr)
      scores_cols16<3>(Q + r * D, K, kmul, n, D, scale, S + r * CHUNK, pf, q_bf16);
    if (R - r == 2) scores_cols16<2>(Q + r * D, K, kmul, n, D, scale, S + r * CHUNK, pf, q_bf16);
    if (R - r == 1) scores_cols16<1>(Q + r * D, K, kmul, n, D, scale, S + r * CHUNK, pf, q_bf16);
    return;
  }
#endif
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; r + 3 <= R; r += 3, pf = nullptr) scores_rows8<3>(Q + r * D, K, kmul, n, D, scale, S + r * CHUNK, pf);
    if (R - r == 2) scores_rows8<2>(Q + r * D, K, kmul, n, D, scale, S + r * CHUNK, pf);
    if (R - r == 1) scores_rows8<1>(Q + r * D, K, kmul, n, D, scale, S + r * CHUNK, pf);
    return;
  }
#endif
  for (; r < R; ++r) {
    const float* q = Q + r * D;
    for (int64_t o = 0; o < n; ++o) {
      float acc = 0.f;
      const T* kr = K[o];
      for (int64_t d = 0; d < D; ++d) acc += q[d] * elem(kr, d);
      S[r * CHUNK + o] = acc * (kmul ? scale * kmul[o] : scale);
    }
  }
}

// A[r][:] += sum_o P[r * CHUNK + o] * V[o][:] for r < R (A rows are D apart; an int8 row's block scale is already
// folded into its weight). AVX2: blocks of 3 rows x 32 columns (pv_rows8); AVX-512: 3 rows x 64 columns (32
// registers, pv_cols16); a GQA group's last 1-2 rows take 1- and 2-row blocks.
template <typename T>
inline void pv_block(const float* P, int64_t R, const T* const* V, int64_t n, int64_t D, float* A,
                     PrefetchQueue* pf = nullptr) {
  int64_t r = 0;
#ifdef __AVX512F__
  if (D % 16 == 0) {
    for (; r + 3 <= R; r += 3, pf = nullptr) pv_cols16<3>(P + r * CHUNK, V, n, D, A + r * D, pf);
    if (R - r == 2) pv_cols16<2>(P + r * CHUNK, V, n, D, A + r * D, pf);
    if (R - r == 1) pv_cols16<1>(P + r * CHUNK, V, n, D, A + r * D, pf);
    return;
  }
#endif
#ifdef __AVX2__
  if (D % 32 == 0) {
    for (; r + 3 <= R; r += 3, pf = nullptr) pv_rows8<3>(P + r * CHUNK, V, n, D, A + r * D, pf);
    if (R - r == 2) pv_rows8<2>(P + r * CHUNK, V, n, D, A + r * D, pf);
    if (R - r == 1) pv_rows8<1>(P + r * CHUNK, V, n, D, A + r * D, pf);
    return;
  }
#endif
  for (; r < R; ++r) {
    const float* p = P + r * CHUNK;
    float* a = A + r * D;
    for (int64_t o = 0; o < n; ++o) {
      const T* vr = V[o];
      for (int64_t d = 0; d < D; ++d) a[d] += p[o] * elem(vr, d);
    }
  }
}

// Decodes (tiles of up to SPLIT_MAX_Q queries) over more than SPLIT_MIN_KEYS keys are split over the context, as
// flash-decoding does: into up to SPLIT_PARTS parts of at least SPLIT_MIN_KEYS keys, one work item each, leaving
// its rows' running max, sum and unnormalised output in a partial buffer; the thread that finishes a split's last
// part combines them (no barrier). A batch-1 decode then has kv heads x parts items instead of kv heads (3 for
// SmolLM2: one of 2 threads did 2 of them, the other waited). The parts depend on the sequence alone, not on the
// batch or the thread count, and are combined in order, so a sequence's output does not change with those.
// Each part costs a little (one thread, int8 pool, 8k context, out of cache: 2 parts +3% time, 4 parts +7%,
// 8 +16%, 32 +45% over one; fp32, bound by memory, is unaffected), hence few, long parts.
constexpr int64_t SPLIT_MIN_KEYS = 512;  // a multiple of CHUNK
constexpr int64_t SPLIT_PARTS = 4;
constexpr int64_t SPLIT_MAX_Q = 8;

constexpr std::chrono::microseconds JOIN_SPIN{200};

inline void spin_pause() {
#ifdef PAGEDLLM_X86
  _mm_pause();
#endif
}

struct Item {
  int32_t seq, q_begin, q_end, kv_head;  // q_begin/q_end: offsets inside the sequence's queries
  int32_t k_begin, k_end;                // the keys it attends: [k_begin, k_end), k_end <= last query's position + 1
  int32_t split;                         // a part's split (index in `splits`); -1: not split, it writes `out`
  int64_t part;                          // a part's offset in the partial buffer: max [R], sum [R], rows [R, D]
};
struct Split {  // the items [first, first + count) that cover one (sequence, tile, kv head)
  int64_t first, count;
};

// Work items of sequences [seq_begin, seq_end) and kv heads [h0, h1) (see above); returns the partial buffer's size
// in floats.
int64_t make_items(const int32_t* qsl, const int32_t* lens, int64_t seq_begin, int64_t seq_end, int64_t q_tile,
                   int64_t h0, int64_t h1, int64_t group, int64_t D, std::vector<Item>& items,
                   std::vector<Split>& splits) {
  int64_t n_partial = 0;
  for (int64_t b = seq_begin; b < seq_end; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    for (int64_t t0 = 0; t0 < q_len; t0 += q_tile) {
      const int64_t t1 = std::min(q_len, t0 + q_tile), kv_end = lens[b] - q_len + t1, rows = (t1 - t0) * group;
      const int64_t per_part = (kv_end + SPLIT_PARTS * CHUNK - 1) / (SPLIT_PARTS * CHUNK) * CHUNK;
      const int64_t part_len = std::max(SPLIT_MIN_KEYS, per_part);
      const bool split = t1 - t0 <= SPLIT_MAX_Q && kv_end > part_len;
      for (int64_t h = h0; h < h1; ++h) {
        if (!split) {
          items.push_back({(int32_t)b, (int32_t)t0, (int32_t)t1, (int32_t)h, 0, (int32_t)kv_end, -1, -1});
          continue;
        }
        const int32_t si = static_cast<int32_t>(splits.size());
        splits.push_back({(int64_t)items.size(), (kv_end + part_len - 1) / part_len});
        for (int64_t k0 = 0; k0 < kv_end; k0 += part_len, n_partial += rows * (D + 2))
          items.push_back({(int32_t)b, (int32_t)t0, (int32_t)t1, (int32_t)h, (int32_t)k0,
                           (int32_t)std::min(kv_end, k0 + part_len), si, n_partial});
      }
    }
  }
  return n_partial;
}

// The queries and the output rows: token t, head h at p + t * s0 + h * s1 (D contiguous values).
template <typename T>
struct Heads {
  T* p;
  int64_t s0, s1;
};

// The items on nthreads threads (a parallel region), or on the calling thread alone for nthreads 1 (no region: a
// team's thread, decode_layer's, calls it for its share).
template <typename qscalar_t, typename kvscalar_t>
void run_items(const std::vector<Item>& items, const std::vector<Split>& splits, float* partials,
               Heads<const qscalar_t> qh, int64_t H, int64_t D, const torch::Tensor& k_cache,
               const torch::Tensor& v_cache, Heads<qscalar_t> oh, const int32_t* tables, int64_t table_stride,
               const int32_t* seq_lens, const int32_t* qsl, int64_t block_size, float scale, int64_t max_rows,
               int max_threads, Scales ksc = {}, Scales vsc = {}) {
  const int64_t Hkv = k_cache.size(0), group = H / Hkv;
  const qscalar_t* qp = qh.p;
  qscalar_t* op = oh.p;
  const int64_t qs0 = qh.s0, qs1 = qh.s1, os0 = oh.s0, os1 = oh.s1;
  const kvscalar_t* kp = static_cast<const kvscalar_t*>(k_cache.data_ptr());
  const kvscalar_t* vp = static_cast<const kvscalar_t*>(v_cache.data_ptr());
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  constexpr bool kv_is_float = std::is_same_v<kvscalar_t, float>;
  constexpr bool kv_is_int8 = std::is_same_v<kvscalar_t, Int8Code>;
  // bf16 rows are read in place and widened in registers (as int8 codes are): converting each chunk's rows into
  // fp32 buffers first cost a store and a reload per element
  constexpr bool kv_is_bf16 = std::is_same_v<kvscalar_t, at::BFloat16>;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t block_bytes = block_size * ks1 * static_cast<int64_t>(sizeof(kvscalar_t));  // one head's K
  const int nthreads = std::max<int>(1, std::min<int64_t>(max_threads, n_items));
  std::vector<int32_t> parts_done(splits.size(), 0);
  int64_t items_done = 0;
  // Each thread takes a contiguous run of items of about equal work (keys x rows, plus a fixed cost per item), so
  // it knows its next item and prefetches that item's first chunk during the current one's last (below). Dynamic
  // scheduling left that chunk cold: W1's decode shape (Zen 4, 30 layers, scattered blocks) 18.9 -> 17.7 ms at 40
  // sequences x 450 keys, 22.8 -> 19.9 at 64 x 300. Items are claimed one at a time from a run's counter, and a
  // thread done with its run goes on with the others' (a parked thread's run is not left waiting for it).
  std::vector<int64_t> work_before(n_items + 1, 0);
  for (int64_t i = 0; i < n_items; ++i)
    work_before[i + 1] = work_before[i] + (items[i].k_end - items[i].k_begin + CHUNK) *
                                              (items[i].q_end - items[i].q_begin) * group;
  std::vector<int64_t> run_begin(nthreads + 1, n_items);
  for (int t = 0; t < nthreads; ++t)
    run_begin[t] = std::lower_bound(work_before.begin(), work_before.end() - 1,
                                    work_before[n_items] * t / nthreads) - work_before.begin();
  std::vector<int64_t> claimed(run_begin.begin(), run_begin.end() - 1);  // each run's next unclaimed item
  // row r of an item (r = qi * group + g) is token qsl[seq] + q_begin + qi, head kv_head * group + g
  auto out_row = [&](const Item& w, int64_t r) {
    return op + (qsl[w.seq] + w.q_begin + r / group) * os0 + (w.kv_head * group + r % group) * os1;
  };
  // a split's rows: its parts rescaled to their common max (a part none of the row's keys are in has max -inf,
  // so weight 0), summed in order, normalised
  auto combine = [&](const Split& sp, std::vector<float>& obuf) {
    const Item& w = items[sp.first];
    const int64_t R = (w.q_end - w.q_begin) * group;
    for (int64_t r = 0; r < R; ++r) {
      float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
      for (int64_t j = 0; j < sp.count; ++j) mx = std::max(mx, partials[items[sp.first + j].part + r]);
      std::fill(obuf.begin(), obuf.begin() + D, 0.f);
      for (int64_t j = 0; j < sp.count; ++j) {
        const float* pp = partials + items[sp.first + j].part;
        const float f = std::exp(pp[r] - mx);
        sum += f * pp[R + r];
        const float* pa = pp + 2 * R + r * D;
        for (int64_t d = 0; d < D; ++d) obuf[d] += f * pa[d];
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) obuf[d] *= inv;
      float_to_row(obuf.data(), out_row(w, r), D);
    }
  };

  auto work = [&](const int tid) {
    // a thread's buffers, kept between calls (a decode step's layers call this ~30 times)
    thread_local std::vector<float> qbuf, acc, m, l, s, kbuf, vbuf, obuf;
    thread_local std::vector<int64_t> pos;
    const int64_t kv_rows = kv_is_float || kv_is_int8 || kv_is_bf16 ? 0 : CHUNK * D;
    const std::pair<std::vector<float>*, int64_t> sizes[] = {{&qbuf, max_rows * D}, {&acc, max_rows * D},
        {&m, max_rows}, {&l, max_rows}, {&s, max_rows * CHUNK}, {&kbuf, kv_rows}, {&vbuf, kv_rows}, {&obuf, D}};
    for (auto [v, n] : sizes)
      if (static_cast<int64_t>(v->size()) < n) v->resize(n);
    if (static_cast<int64_t>(pos.size()) < max_rows) pos.resize(max_rows);
    const float* krow[CHUNK];
    const float* vrow[CHUNK];
    const int8_t* krow8[CHUNK];  // int8 pools: the codes in place, with their block's scale per key
    const int8_t* vrow8[CHUNK];
    float kmul[CHUNK], vmul[CHUNK];
    const at::BFloat16* krowb[CHUNK];  // bf16 pools: the rows in place
    const at::BFloat16* vrowb[CHUNK];
    PrefetchQueue pfq;
#ifdef __AVX512F__
    const bool spread = D % 16 == 0;
#elif defined(__AVX2__)  // the AVX2 score and P@V blocks (3 rows) take the queue from D % 32 == 0
    const bool spread = D % 32 == 0;
#else
    const bool spread = false;
#endif
    int ri = 0;  // runs this thread has emptied (its own first)
    auto claim = [&](int64_t& run_end) -> int64_t {  // the thread's next item and the end of its run; -1: none left
      for (; ri < nthreads; ++ri) {
        const int run = (tid + ri) % nthreads;
        const int64_t it = __atomic_fetch_add(&claimed[run], 1, __ATOMIC_RELAXED);
        if (it < run_begin[run + 1]) {
          run_end = run_begin[run + 1];
          return it;
        }
      }
      return -1;
    };
    for (int64_t run_end = 0, it = claim(run_end); it >= 0; it = claim(run_end)) {
      const Item& w = items[it];
      const Item* next = it + 1 < run_end ? &items[it + 1] : nullptr;  // the item it most likely claims next
      const int64_t q_len = qsl[w.seq + 1] - qsl[w.seq];
      const int64_t first_pos = seq_lens[w.seq] - q_len;
      const int64_t nq = w.q_end - w.q_begin, R = nq * group;
      const int32_t* table = tables + w.seq * table_stride;
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t t = qsl[w.seq] + w.q_begin + qi;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = qi * group + g;
          row_to_float(qp + t * qs0 + (w.kv_head * group + g) * qs1, qbuf.data() + r * D, D);
          pos[r] = first_pos + w.q_begin + qi;
        }
      }
      std::fill(acc.begin(), acc.begin() + R * D, 0.f);
      std::fill(m.begin(), m.begin() + R, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + R, 0.f);
      const int64_t kv_end = w.k_end;
      for (int64_t c0 = w.k_begin; c0 < kv_end; c0 += CHUNK) {
        const int64_t n = std::min(CHUNK, kv_end - c0);
        // start loading the next chunk's K/V while this one is computed, where the hardware prefetcher can't guess
        // it: a block that does not follow the previous one in the pool, or one of a page or more (fp32 at head_dim
        // 64) that starts a page. Measured at 8k context, one thread (Zen 5): prefetching every block made int8
        // over consecutive blocks 45% slower, every block that starts a page still 23%; with no prefetch at all,
        // scattered blocks took 36% (int8) and 14% (fp32) longer, consecutive fp32 blocks 15%.
        // (blocks are walked from the chunk's first: one 64-bit division per chunk, not one per block or key)
        // AVX-512 and AVX2 paths (`spread`): the lines are queued and issued a few per score step and per P@V key
        // instead of all at once. A burst of 256 prefetches (bf16, head_dim 64) waits on the core's ~16 line-fill
        // buffers, so the chunk's compute only started once most of the next chunk was in flight: perf put 87% of the
        // loop's own samples on the prefetch instructions. Spread (K and V lines interleaved, half over each loop), the
        // W1 decode shape (64 sequences x 400 keys, 30 layers' bf16 pools, 2 threads, AMX Xeon) went from 39.3 to
        // 32.4 ms (touching the lines alone: 25 ms; all in the score or all in the P@V loop: 36 ms; K lines first:
        // 37-40 ms). The AVX2 loops too since session 32 (Zen 3, fp32 pool, 2 threads, attend_qkv a step over 30
        // layers, spread vs burst alternating in one process: 64 sequences x 400 keys 53.7 vs 75.2 ms, 16 x 150 6.5
        // vs 8.9, one sequence of 1,500 5.8 vs 8.1).
        // The last chunk prefetches the first chunk of the thread's next item instead (its blocks are cold: an
        // item of a W1 decode is 5-7 chunks).
        const Item* ahead = c0 + CHUNK >= kv_end ? next : nullptr;  // the item whose first chunk comes next, if not w's
        const Item& pw = ahead ? *ahead : w;
        const int32_t* ptable = tables + pw.seq * table_stride;
        const int64_t pstart = ahead ? ahead->k_begin : c0 + CHUNK;
        const int64_t stop = std::min<int64_t>(pstart + CHUNK, pw.k_end);
        pfq.reset();
        for (int64_t lp = pstart, lb = lp / block_size, off = lp - lb * block_size; lp < stop; ++lb, off = 0) {
          const int64_t cnt = std::min(block_size - off, stop - lp);
          const int64_t slot0 = static_cast<int64_t>(ptable[lb]) * block_size + off;
          const char* kr = reinterpret_cast<const char*>(kp + pw.kv_head * ks0 + slot0 * ks1);
          const char* vr = reinterpret_cast<const char*>(vp + pw.kv_head * vs0 + slot0 * vs1);
          lp += cnt;
          const bool page_start = block_bytes >= 4096 && (reinterpret_cast<uintptr_t>(kr) & 4095) == 0;
          const bool follows = ahead ? lp - cnt > pstart : lb > 0;  // a block after one being read
          if (follows && ptable[lb] == ptable[lb - 1] + 1 && !page_start) continue;
          const int64_t nbytes = cnt * ks1 * static_cast<int64_t>(sizeof(kvscalar_t));
          if (spread) {
            pfq.add(kr, vr, nbytes);
            continue;
          }
          for (int64_t b = 0; b < nbytes; b += 64) {
            __builtin_prefetch(kr + b, 0, 3);
            __builtin_prefetch(vr + b, 0, 3);
          }
        }
        if (spread) {  // half over the score steps (n / 4), half over the P@V keys (n)
          const int64_t half = (pfq.pairs + 1) / 2;
          pfq.per_scores = static_cast<int>(n >= 4 ? (half + n / 4 - 1) / (n / 4) : half);
          pfq.per_pv = static_cast<int>((half + n - 1) / n);
        }
        // the chunk's K/V row pointers, one block-table lookup per block
        for (int64_t o = 0, lb = c0 / block_size, off = c0 - lb * block_size; o < n; ++lb, off = 0) {
          const int64_t cnt = std::min(block_size - off, n - o);
          const int64_t blk = table[lb], slot0 = blk * block_size + off;
          const kvscalar_t* kr = kp + w.kv_head * ks0 + slot0 * ks1;
          const kvscalar_t* vr = vp + w.kv_head * vs0 + slot0 * vs1;
          [[maybe_unused]] float sk = 0.f, sv = 0.f;
          if constexpr (is_code_v<kvscalar_t>) sk = ksc.at(w.kv_head, blk), sv = vsc.at(w.kv_head, blk);
          for (int64_t j = 0; j < cnt; ++j, ++o, kr += ks1, vr += vs1) {
            if constexpr (kv_is_float) {
              krow[o] = reinterpret_cast<const float*>(kr);
              vrow[o] = reinterpret_cast<const float*>(vr);
            } else if constexpr (kv_is_bf16) {
              krowb[o] = kr;
              vrowb[o] = vr;
            } else if constexpr (kv_is_int8) {
              krow8[o] = reinterpret_cast<const int8_t*>(kr);
              vrow8[o] = reinterpret_cast<const int8_t*>(vr);
              kmul[o] = sk;
              vmul[o] = sv;
            } else if constexpr (is_code_v<kvscalar_t>) {
              dequant_row<kvscalar_t::format>(&kr->b, sk, kbuf.data() + o * D, D);
              dequant_row<kvscalar_t::format>(&vr->b, sv, vbuf.data() + o * D, D);
              krow[o] = kbuf.data() + o * D;
              vrow[o] = vbuf.data() + o * D;
            } else {
              row_to_float(kr, kbuf.data() + o * D, D);
              row_to_float(vr, vbuf.data() + o * D, D);
              krow[o] = kbuf.data() + o * D;
              vrow[o] = vbuf.data() + o * D;
            }
          }
        }
        // rows are in query order, so the ones that see this chunk (pos >= c0) are a suffix
        int64_t r0 = 0;
        while (pos[r0] < c0) ++r0;
        const int64_t Ra = R - r0;
        float* s0 = s.data() + r0 * CHUNK;
        PrefetchQueue* pf = pfq.n ? &pfq : nullptr;
        if constexpr (kv_is_int8) scores_block(qbuf.data() + r0 * D, Ra, krow8, kmul, n, D, scale, s0, pf);
        else if constexpr (kv_is_bf16)
          scores_block(qbuf.data() + r0 * D, Ra, krowb, static_cast<const float*>(nullptr), n, D, scale, s0, pf,
                       std::is_same_v<qscalar_t, at::BFloat16>);
        else scores_block(qbuf.data() + r0 * D, Ra, krow, static_cast<const float*>(nullptr), n, D, scale, s0, pf);
        for (int64_t r = r0; r < R; ++r) {
          const int64_t nv = std::min(n, pos[r] - c0 + 1);  // causal: keys of the chunk the row sees
          float* sr = s.data() + r * CHUNK;
          const float mx = max_of(sr, nv, m[r]);
          const float corr = mx == m[r] ? 1.f : std::exp(m[r] - mx);  // m[r] = -inf on the first chunk -> 0
          // int8: the V rows' block scales fold into the weights, after the sum
          const float sum = exp_sub_sum(sr, nv, mx, kv_is_int8 ? vmul : nullptr);
          std::fill(sr + nv, sr + n, 0.f);  // hidden keys weigh nothing in pv_block
          float* ar = acc.data() + r * D;
          if (corr != 1.f)
            for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
          l[r] = l[r] * corr + sum;
          m[r] = mx;
        }
        if constexpr (kv_is_int8) pv_block(s0, Ra, vrow8, n, D, acc.data() + r0 * D, pf);
        else if constexpr (kv_is_bf16) pv_block(s0, Ra, vrowb, n, D, acc.data() + r0 * D, pf);
        else pv_block(s0, Ra, vrow, n, D, acc.data() + r0 * D, pf);
        if (pf) pf->issue_all();  // whatever the loops left (short chunks, other paths)
      }
      if (w.split >= 0) {  // a part of a split: (max, sum, unnormalised rows); the last part done combines
        float* pp = partials + w.part;
        std::copy(m.begin(), m.begin() + R, pp);
        std::copy(l.begin(), l.begin() + R, pp + R);
        std::copy(acc.begin(), acc.begin() + R * D, pp + 2 * R);
        const Split& sp = splits[w.split];
        if (__atomic_add_fetch(&parts_done[w.split], 1, __ATOMIC_ACQ_REL) == sp.count) combine(sp, obuf);
      } else {
        for (int64_t r = 0; r < R; ++r) {
          const float inv = 1.f / l[r];
          for (int64_t d = 0; d < D; ++d) obuf[d] = acc[r * D + d] * inv;
          float_to_row(obuf.data(), out_row(w, r), D);
        }
      }
      __atomic_add_fetch(&items_done, 1, __ATOMIC_RELEASE);
    }
    // The calling thread waits for the other threads' last items spinning (for at most JOIN_SPIN), so it reaches
    // the region's closing barrier last and passes it without sleeping: under pagedllm's OMP_WAIT_POLICY=PASSIVE
    // a sleeping thread takes 25-45 us to wake, about what one layer's int8 attention at 8k takes.
    if (tid == 0 && nthreads > 1) {
      const auto deadline = std::chrono::steady_clock::now() + JOIN_SPIN;
      while (__atomic_load_n(&items_done, __ATOMIC_ACQUIRE) < n_items && std::chrono::steady_clock::now() < deadline)
        spin_pause();
    }
  };
  if (nthreads == 1) {
    work(0);
    return;
  }
#pragma omp parallel num_threads(nthreads)
  work(omp_get_thread_num());
}

}  // namespace

namespace {

// The kernel's view of a quantized pool's scales [Hkv, num_blocks] (any strides); none for a float pool.
Scales scales_of(const c10::optional<torch::Tensor>& t, const torch::Tensor& cache) {
  if (!t.has_value()) return {};
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == cache.size(0),
              "scales must be float32 [Hkv, num_blocks]");
  return {t->data_ptr<float>(), t->stride(0), t->stride(1)};
}

bool is_code_dtype(at::ScalarType t) {
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// Checks the pool and the step's metadata paged attention reads.
void check_attend(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                  const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale) {
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3, "caches must be [Hkv, slots, D]");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "last dim must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt, "metadata must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && query_start_loc.is_contiguous());
  TORCH_CHECK(is_code_dtype(k_cache.scalar_type()) == (k_scale.has_value() && v_scale.has_value()),
              "int8 / fp8 caches need k_scale and v_scale, float caches take none");
}

// The attention of sequences [seq_begin, seq_end) and kv heads [h0, h1) on up to max_threads threads: q and out
// (fp32 where q_f, else bf16) hold H heads of D values a token (see Heads); the rest as check_attend checked it.
void attend_heads(const void* q, int64_t qs0, int64_t qs1, void* out, int64_t os0, int64_t os1, bool q_f, int64_t H,
                  int64_t D, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_tables, const int32_t* lens, const int32_t* qsl, int64_t block_size,
                  double scale, int64_t seq_begin, int64_t seq_end, int64_t q_tile, int64_t h0, int64_t h1,
                  const Scales& ksc, const Scales& vsc, int max_threads) {
  const int64_t group = H / k_cache.size(0);
  q_tile = std::max<int64_t>(1, q_tile);
  thread_local std::vector<Item> items;  // kept between calls, as the buffers below
  thread_local std::vector<Split> splits;
  items.clear();
  splits.clear();
  const int64_t n_partial = make_items(qsl, lens, seq_begin, seq_end, q_tile, h0, h1, group, D, items, splits);
  if (items.empty()) return;
  const int64_t max_rows = q_tile * group;
  thread_local std::vector<float> partials;  // a fresh buffer costs page faults every call
  if (static_cast<int64_t>(partials.size()) < n_partial) partials.resize(n_partial);
  auto run_kv = [&](auto kvdummy) {
    using KT = decltype(kvdummy);
    auto go = [&](auto qdummy) {
      using QT = decltype(qdummy);
      run_items<QT, KT>(items, splits, partials.data(), {static_cast<const QT*>(q), qs0, qs1}, H, D, k_cache, v_cache,
                        {static_cast<QT*>(out), os0, os1}, block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                        lens, qsl, block_size, static_cast<float>(scale), max_rows, max_threads, ksc, vsc);
    };
    if (q_f) go(float{});
    else go(at::BFloat16{});
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: run_kv(float{}); break;
    case at::kBFloat16: run_kv(at::BFloat16{}); break;
    case at::kChar: run_kv(Int8Code{}); break;
    case at::kFloat8_e4m3fn: run_kv(E4M3Code{}); break;
    case at::kFloat8_e5m2: run_kv(E5M2Code{}); break;
    default: TORCH_CHECK(false, "kv cache must be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2");
  }
}

}  // namespace

// Attend the queries of sequences [seq_begin, seq_end) of the flat batch; writes their rows of `out`.
// k_scale / v_scale: the scales of an int8 or fp8 pool (see the header), None for fp32 / bf16.
void paged_attention_out(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                         int64_t block_size, double scale, int64_t seq_begin, int64_t seq_end, int64_t q_tile,
                         c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale) {
  check_attend(k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale);
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out must be [T, H, D] with contiguous head rows");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out dtypes differ");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "num heads must be a multiple of num kv heads");
  attend_heads(q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
               q.scalar_type() == at::kFloat, q.size(1), q.size(2), k_cache, v_cache, block_tables,
               seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(), block_size, scale, seq_begin,
               seq_end, q_tile, 0, k_cache.size(0), scales_of(k_scale, k_cache), scales_of(v_scale, v_cache),
               at::get_num_threads());
}

namespace {

// The step's new K or V rows of kv heads [h0, h1): token t, head h at p + t * s0 + h * s1 (D contiguous values).
template <typename ST>
struct NewRows {
  const ST* p;
  int64_t s0, s1, T, h0, h1, D;
  const ST* row(int64_t t, int64_t h) const { return p + t * s0 + h * s1; }
};

template <typename ST, typename DT>
void scatter_rows(const NewRows<ST>& src, torch::Tensor& cache, const int64_t* slots) {
  const int64_t T = src.T, D = src.D;
  DT* cp = cache.data_ptr<DT>();
  const int64_t rows = cache.size(1);
  auto rows_of = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < rows, "slot ", slots[t], " is outside the pool");
      for (int64_t h = src.h0; h < src.h1; ++h) {
        const ST* s = src.row(t, h);
        DT* d = cp + (h * rows + slots[t]) * D;
        if constexpr (std::is_same_v<ST, DT>) {
          std::memcpy(d, s, D * sizeof(DT));
          continue;
        }
        int64_t i = 0;
#ifdef __AVX2__
        if constexpr (std::is_same_v<ST, float>)  // into bf16: c10's rounding, 8 lanes
          for (; i + 8 <= D; i += 8) pagedllm_ops::store8(d + i, _mm256_loadu_ps(s + i));
#endif
        for (; i < D; ++i) d[i] = static_cast<DT>(static_cast<float>(s[i]));  // bf16: round to nearest even
      }
    }
  };
  // a prefill chunk's rows over the threads (1,691 rows: 357 -> 114-145 us a layer); a decode step's on this
  // thread (at::parallel_for's inline path cost ~2 us more a call there)
  if (T >= 256)
    at::parallel_for(0, T, 256, rows_of);
  else
    rows_of(0, T);
}

template <typename ST>
void scatter(const NewRows<ST>& src, torch::Tensor& cache, const int64_t* slots) {
  if (cache.scalar_type() == at::kFloat)
    scatter_rows<ST, float>(src, cache, slots);
  else
    scatter_rows<ST, at::BFloat16>(src, cache, slots);
}

template <typename ST>
inline float to_f(ST x) { return static_cast<float>(x); }

// int8 rows with a scale per (kv head, block): for each run of new rows landing in one block, the block's scale
// becomes max(old, amax(run) / 127) (old = 0 when the run starts the block); if it grew, the block's earlier
// codes are re-rounded by old / new; then the run's rows are rounded with it. Same arithmetic as kv_quant.write_int8.
template <typename ST>
void write_int8_rows(const NewRows<ST>& src, torch::Tensor& cache, const Scales& sc, const int64_t* slots,
                     int64_t block_size) {
  const int64_t T = src.T, D = src.D, rows = cache.size(1);
  int8_t* cp = cache.data_ptr<int8_t>();
  float* scp = const_cast<float*>(sc.p);
  for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
    const int64_t blk = slots[t0] / block_size, off0 = slots[t0] % block_size;
    for (t1 = t0 + 1; t1 < T && slots[t1] / block_size == blk; ++t1) {}
    for (int64_t t = t0; t < t1; ++t)
      TORCH_CHECK(slots[t] >= 0 && slots[t] < rows, "slot ", slots[t], " is outside the pool");
    for (int64_t h = src.h0; h < src.h1; ++h) {
      float amax = 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        const ST* s = src.row(t, h);
        for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(to_f(s[i])));
      }
      float& scale = scp[h * sc.s0 + blk * sc.s1];
      const float old = off0 > 0 ? scale : 0.f, nw = std::max(old, amax / 127.f);
      int8_t* block = cp + (h * rows + blk * block_size) * D;
      if (off0 > 0 && nw > old) {
        const float ratio = old / nw;
        for (int64_t i = 0; i < off0 * D; ++i) block[i] = static_cast<int8_t>(std::nearbyint(block[i] * ratio));
      }
      scale = nw;
      const float div = nw > 0.f ? nw : 1.f;
      for (int64_t t = t0; t < t1; ++t) {
        const ST* s = src.row(t, h);
        int8_t* d = cp + (h * rows + slots[t]) * D;
        for (int64_t i = 0; i < D; ++i)
          d[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(to_f(s[i]) / div))));
      }
    }
  }
}

// fp8 rows: divided by the head's scale, saturated at the format's max, rounded to nearest even (as Tensor.to).
template <typename ST, typename FP8>
void write_fp8_rows(const NewRows<ST>& src, torch::Tensor& cache, const Scales& sc, const int64_t* slots) {
  const int64_t T = src.T, D = src.D, rows = cache.size(1);
  const float fmax = static_cast<float>(std::numeric_limits<FP8>::max());
  FP8* cp = static_cast<FP8*>(cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < rows, "slot ", slots[t], " is outside the pool");
    for (int64_t h = src.h0; h < src.h1; ++h) {
      const ST* s = src.row(t, h);
      FP8* d = cp + (h * rows + slots[t]) * D;
      const float div = sc.at(h, 0);
      for (int64_t i = 0; i < D; ++i) d[i] = FP8(std::min(fmax, std::max(-fmax, to_f(s[i]) / div)));
    }
  }
}

template <typename ST>
void write_quantized(const NewRows<ST>& src, torch::Tensor& cache, const Scales& sc, const int64_t* slots,
                     int64_t block_size) {
  switch (cache.scalar_type()) {
    case at::kChar: write_int8_rows<ST>(src, cache, sc, slots, block_size); break;
    case at::kFloat8_e4m3fn: write_fp8_rows<ST, c10::Float8_e4m3fn>(src, cache, sc, slots); break;
    default: write_fp8_rows<ST, c10::Float8_e5m2>(src, cache, sc, slots); break;
  }
}

// Checks write_kv's pool, scales and slots against T new rows of src dtype, Hkv heads of D values.
void check_write(at::ScalarType src, int64_t T, int64_t Hkv, int64_t D, const torch::Tensor& k_cache,
                 const torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                 const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                 int64_t block_size) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == Hkv && k_cache.size(2) == D,
              "caches must be contiguous [Hkv, slots, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "dtypes differ");
  TORCH_CHECK(src == at::kFloat || src == at::kBFloat16, "k must be float32 or bfloat16");
  const bool quantized = is_code_dtype(k_cache.scalar_type());
  TORCH_CHECK(quantized || k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
              "cache must be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()),
              "int8 / fp8 caches need k_scale and v_scale, float caches take none");
  TORCH_CHECK(!quantized || (block_size > 0 && k_cache.size(1) % block_size == 0), "bad block_size");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "slot_mapping must be int64 [T]");
}

// Writes the new K rows (token t, kv head h at kp + t * ks0 + h * ks1) and V rows (vp, vs0, vs1) of kv heads
// [h0, h1), fp32 where src_f else bf16, into the pool as check_write checked it.
void write_heads(const void* kp, int64_t ks0, int64_t ks1, const void* vp, int64_t vs0, int64_t vs1, bool src_f,
                 int64_t T, int64_t h0, int64_t h1, int64_t D, torch::Tensor& k_cache, torch::Tensor& v_cache,
                 const int64_t* slots, const Scales& ksc, const Scales& vsc, int64_t block_size) {
  const bool quantized = is_code_dtype(k_cache.scalar_type());
  auto go = [&](auto dummy) {
    using ST = decltype(dummy);
    const NewRows<ST> k{static_cast<const ST*>(kp), ks0, ks1, T, h0, h1, D};
    const NewRows<ST> v{static_cast<const ST*>(vp), vs0, vs1, T, h0, h1, D};
    if (quantized) {
      write_quantized<ST>(k, k_cache, ksc, slots, block_size);
      write_quantized<ST>(v, v_cache, vsc, slots, block_size);
    } else {
      scatter<ST>(k, k_cache, slots);
      scatter<ST>(v, v_cache, slots);
    }
  };
  if (src_f) go(float{});
  else go(at::BFloat16{});
}

}  // namespace

// Writes the step's new K and V rows [T, Hkv, D] (row-strided views of the qkv output are fine) into the pool
// rows named by slot_mapping [T] (int64), converting to the cache dtype: one call instead of two index_copy_
// dispatches per layer, which cost more than the decode attention itself at batch 1. An int8 / fp8 pool takes
// its scales (k_scale / v_scale [Hkv, num_blocks]) and block_size, and the rows are quantized on the way in.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
              c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, int64_t block_size) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [T, Hkv, D] with contiguous head rows");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "dtypes differ");
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  check_write(k.scalar_type(), T, Hkv, D, k_cache, v_cache, slot_mapping, k_scale, v_scale, block_size);
  write_heads(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
              k.scalar_type() == at::kFloat, T, 0, Hkv, D, k_cache, v_cache, slot_mapping.data_ptr<int64_t>(),
              scales_of(k_scale, k_cache), scales_of(v_scale, v_cache), block_size);
}

namespace {

// kv heads [h0, h1) of attend_qkv (below) into their columns of out [T, H D], on up to max_threads threads.
void attend_qkv_heads(const torch::Tensor& qkv, int64_t H, torch::Tensor& k_cache, torch::Tensor& v_cache,
                      const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                      const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, int64_t block_size,
                      double scale, int64_t q_tile, const c10::optional<torch::Tensor>& k_scale,
                      const c10::optional<torch::Tensor>& v_scale, torch::Tensor& out, int64_t h0, int64_t h1,
                      int max_threads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, (H + 2 Hkv) D] with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 3, "caches must be [Hkv, slots, D]");
  const int64_t T = qkv.size(0), Hkv = k_cache.size(0), D = k_cache.size(2);
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "qkv has ", qkv.size(1), " columns; (H + 2 Hkv) D = ",
              (H + 2 * Hkv) * D);
  TORCH_CHECK(H > 0 && H % Hkv == 0, "num heads must be a multiple of num kv heads");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) >= 1, "query_start_loc must be [B + 1]");
  check_write(qkv.scalar_type(), T, Hkv, D, k_cache, v_cache, slot_mapping, k_scale, v_scale, block_size);
  check_attend(k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale);
  // the q, k and v heads of a row are views of qkv: pointers and strides, not tensors (a view costs a dispatch)
  const char* base = static_cast<const char*>(qkv.data_ptr());
  const int64_t ld = qkv.stride(0), es = qkv.element_size();
  const bool f = qkv.scalar_type() == at::kFloat;
  const Scales ksc = scales_of(k_scale, k_cache), vsc = scales_of(v_scale, v_cache);
  write_heads(base + H * D * es, ld, D, base + (H + Hkv) * D * es, ld, D, f, T, h0, h1, D, k_cache, v_cache,
              slot_mapping.data_ptr<int64_t>(), ksc, vsc, block_size);
  attend_heads(base, ld, D, out.data_ptr(), out.stride(0), D, f, H, D, k_cache, v_cache, block_tables,
               seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(), block_size, scale, 0,
               query_start_loc.size(0) - 1, q_tile, h0, h1, ksc, vsc, max_threads);
}

}  // namespace

// One layer's attention from the fused projection's output qkv [T, (H + 2 Hkv) D] (q heads, then k, then v;
// rope already applied): writes the new K/V rows to the pool and attends every sequence of the batch; returns
// [T, H * D], the o projection's input. One call instead of the ~6 Python-level ops (views, write, empty,
// attend, reshape) that took ~50 us a layer at batch 1, as long as the attention itself.
torch::Tensor attend_qkv(torch::Tensor qkv, int64_t num_heads, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                         torch::Tensor query_start_loc, int64_t block_size, double scale, int64_t q_tile,
                         c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale) {
  auto out = torch::empty({qkv.size(0), num_heads * k_cache.size(2)}, qkv.options());
  attend_qkv_heads(qkv, num_heads, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                   block_size, scale, q_tile, k_scale, v_scale, out, 0, k_cache.size(0), at::get_num_threads());
  return out;
}

// attend_qkv's kv heads of part `part` of `parts` (heads [Hkv part / parts, Hkv (part + 1) / parts): their K/V
// rows written, their query heads attended) into their columns of out [T, H D], in the calling thread: a share of
// decode_layer's team, which has applied rope to those heads. The same bits as attend_qkv, whatever the split: a
// kv head's new rows and its items are one part's.
void attend_qkv_part(torch::Tensor qkv, int64_t num_heads, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                     torch::Tensor query_start_loc, int64_t block_size, double scale, int64_t q_tile,
                     c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, torch::Tensor out,
                     int64_t part, int64_t parts) {
  TORCH_CHECK(parts >= 1 && part >= 0 && part < parts, "part must be in [0, parts), got ", part, " of ", parts);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == qkv.size(0) && out.size(1) == num_heads * k_cache.size(2) &&
                  out.stride(1) == 1 && out.scalar_type() == qkv.scalar_type(),
              "out must be [T, H D] with contiguous rows, of qkv's dtype");
  const int64_t Hkv = k_cache.size(0);
  attend_qkv_heads(qkv, num_heads, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                   block_size, scale, q_tile, k_scale, v_scale, out, Hkv * part / parts, Hkv * (part + 1) / parts, 1);
}

// Schemas: what each op mutates is declared (Tensor(a!)), so torch.compile functionalizes the calls; the fake
// (shape-only) implementations are in pagedllm/ops/fake.py.
TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("paged_attention_out(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int block_size, float scale, int seq_begin, int seq_end, "
        "int q_tile, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None, int block_size=0) -> ()");
  m.def("attend_qkv(Tensor qkv, int num_heads, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int block_size, float scale, int q_tile, "
        "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor");
  // attend_qkv's kv heads of one part into out, in the calling thread (a team's share)
  m.def("attend_qkv_part(Tensor qkv, int num_heads, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int block_size, float scale, int q_tile, "
        "Tensor(c!)? k_scale, Tensor(d!)? v_scale, Tensor(e!) out, int part, int parts) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("paged_attention_out", &paged_attention_out);
  m.impl("write_kv", &write_kv);
  m.impl("attend_qkv", &attend_qkv);
  m.impl("attend_qkv_part", &attend_qkv_part);
}
