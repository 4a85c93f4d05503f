// y[1, N] = x[1, K] @ W[N, K]^T (+ bias) in fp32 for W in GGUF Q4_1 / Q8_0 blocks: the batch-1 decode GEMV.
//
// gemm.cpp dequantizes each weight (w = d q + m, one FMA) before multiplying it by x (another FMA), so that its
// result is bit-identical to the dense fp32 kernel. At one row that is compute-bound (~7.5 cycles per Q4_1 block
// on the Zen 3 core, 8 GB/s per core, well under the memory bandwidth), and the Q8_0 LM head went through a
// dequantization buffer. Here the block scales are factored out of the block's dot product:
//   Q4_1: y = sum_b d_b (x_b . q_b) + m_b (sum x_b)        Q8_0: y = sum_b d_b (x_b . q_b)
// with q_b the block's integer codes (exact in fp32) and sum x_b taken once per call for all N rows. The same
// weight values and fp32 arithmetic, summed in another order: the result differs from gemm.cpp's by fp32
// rounding only (relative ~1e-6, like any two fp32 GEMMs, e.g. ours and MKL's), not by an approximation of x
// (gguf-a8's int8 rounding is ~1e-2). Per block: one FMA per 8 weights and two per block instead of two per 8.
// Under AVX-512 the Q4_1 tiles run 16 lanes with the scales gathered out of the block loop (tile16_q4_1): the 30
// layers' GEMVs of the embedded model 5.7 -> 4.4-4.9 ms on an AMX Xeon (2 threads), batch-1 decode ~70 -> ~84 tok/s.
#include "ops_common.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace pagedllm_ops;  // hsum8, the GGUF blocks and their checks

// Rows of W per tile: 4 for Q4_1 rows under LONG_ROW columns (8 independent accumulators keep both FMA pipes busy
// on short rows), else 1: one sequential stream per thread, which measured faster on long rows (SmolLM2's down
// projection, K = 1536: 1.4x) and on the Q8_0 LM head (1.5x; 4 or 8 rows were slower than gemm.cpp's buffer).
constexpr int64_t NR = 4, LONG_ROW = 1024;
// How far ahead of the tile it reads each thread prefetches W: one core's hardware prefetcher keeps too few lines in
// flight for these short row streams. The 30 layers' GEMVs of the embedded model, the blocks in L3 (an AMX Xeon, 2
// threads): 10.2 ms without, 5.8 ms with; out of cache, where DRAM bounds them, no change.
constexpr int64_t kPrefetchBytes = 8192;

// 8 int8 codes at p -> fp32 (Q8_0); 8 bytes of nibbles -> their low / high nibbles as fp32 (Q4_1)
[[gnu::always_inline]] inline __m256 codes_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Q4_1 tile: NR rows of blocks against x; xs[8 b + l] = lane l of block b's sum (x[32b + l] + ... + x[32b + 24 + l])
template <int R>
[[gnu::noinline]] void tile_q4_1(const float* x, const float* xs, int64_t kb, const BlockQ4_1* w, float* y,
                                 const float* bias) {
  __m256 acc[R], macc[R];
#pragma GCC unroll 8
  for (int j = 0; j < R; ++j) acc[j] = macc[j] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int64_t b = 0; b < kb; ++b) {
    const float* xb = x + 32 * b;
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      const BlockQ4_1& blk = w[j * kb + b];
      const __m128 dm = _mm_cvtph_ps(_mm_loadu_si32(&blk));  // d, m
      // byte i of the 16 holds weight i (low nibble) and weight 16 + i (high nibble)
      const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.qs)));
      const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk.qs + 8)));
      __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb), _mm256_cvtepi32_ps(_mm256_and_si256(q0, mask)));
      __m256 u = _mm256_mul_ps(_mm256_loadu_ps(xb + 8), _mm256_cvtepi32_ps(_mm256_and_si256(q1, mask)));
      t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), t);
      u = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), u);
      acc[j] = _mm256_fmadd_ps(_mm256_add_ps(t, u), _mm256_broadcastss_ps(dm), acc[j]);
      macc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + 8 * b), _mm256_broadcastss_ps(_mm_movehdup_ps(dm)), macc[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < R; ++j) y[j] = hsum8(_mm256_add_ps(acc[j], macc[j])) + (bias ? bias[j] : 0.f);
}

template <int R>
[[gnu::noinline]] void tile_q8_0(const float* x, const float*, int64_t kb, const BlockQ8_0* w, float* y,
                                 const float* bias) {
  __m256 acc[R];
#pragma GCC unroll 8
  for (int j = 0; j < R; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    const float* xb = x + 32 * b;
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      const BlockQ8_0& blk = w[j * kb + b];
      __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb), codes_i8(blk.qs));
      __m256 u = _mm256_mul_ps(_mm256_loadu_ps(xb + 8), codes_i8(blk.qs + 8));
      t = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), codes_i8(blk.qs + 16), t);
      u = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), codes_i8(blk.qs + 24), u);
      acc[j] = _mm256_fmadd_ps(_mm256_add_ps(t, u), _mm256_set1_ps(_cvtsh_ss(blk.d)), acc[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < R; ++j) y[j] = hsum8(acc[j]) + (bias ? bias[j] : 0.f);
}

#ifdef __AVX512F__
// The same tiles on 16 lanes (AVX-512), with the block scales moved out of the block loop: a Q4_1 block's 16 bytes
// widen to one register (low nibbles = weights 0-15, high = 16-31), and its d is broadcast from a buffer the
// tile's rows' scales were converted into 16 blocks at a time (a load, where converting and broadcasting each block's
// fp16 d and m took five shuffle-port uops a block). The m term, sum_b m_b xsum_b (xsum[b]: block b's sum of x),
// is a 16-block dot product in the same pass. About half the vector uops a block, which bound the GEMV.
//
// 16 blocks' scale dwords (d low half, m high) are dwords 0, 5, ..., 75 of their 80 (scale_dwords16): four
// two-register permutes pick them out of five loads. A VPGATHERDD did it before; on a Zen 4 core that gather cost
// 0.4x the block loop again (a gate/up tile in L2, one thread: 2.41 -> 1.73 ns a block).
[[gnu::always_inline]] inline __m512i scale_dwords16(const BlockQ4_1* w) {
  const int32_t* p = reinterpret_cast<const int32_t*>(w);
  const __m512i r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + 16), r2 = _mm512_loadu_si512(p + 32),
                r3 = _mm512_loadu_si512(p + 48), r4 = _mm512_loadu_si512(p + 64);
  // blocks 0-6 (dwords 0-30: r0, r1) and 7-12 (35-60: r2, r3); 13-15 are r4's dwords 1, 6, 11 (65, 70, 75)
  const __m512i a = _mm512_permutex2var_epi32(r0, _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 30, 25, 20, 15, 10, 5, 0),
                                              r1);
  const __m512i c = _mm512_permutex2var_epi32(r2, _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 28, 23, 18, 13, 8, 3),
                                              r3);
  const __m512i ac = _mm512_permutex2var_epi32(
      a, _mm512_set_epi32(0, 0, 0, 21, 20, 19, 18, 17, 16, 6, 5, 4, 3, 2, 1, 0), c);
  return _mm512_permutex2var_epi32(ac, _mm512_set_epi32(27, 22, 17, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), r4);
}

template <int R>
[[gnu::noinline]] void tile16_q4_1(const float* x, const float* xsum, int64_t kb, const BlockQ4_1* w, float* y,
                                   const float* bias) {
  thread_local std::vector<float> dbuf;
  if (static_cast<int64_t>(dbuf.size()) < R * kb) dbuf.resize(R * kb);
  float* d = dbuf.data();
  float mterm[R];
  for (int j = 0; j < R; ++j) {
    __m512 macc = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 16 <= kb; b += 16) {
      const __m512i dm = scale_dwords16(w + j * kb + b);
      _mm512_storeu_ps(d + j * kb + b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
      const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
      macc = _mm512_fmadd_ps(m, _mm512_loadu_ps(xsum + b), macc);
    }
    float rest = 0.f;
    for (; b < kb; ++b) {  // the last kb % 16 blocks one at a time
      const __m128 dm = _mm_cvtph_ps(_mm_loadu_si32(w + j * kb + b));
      d[j * kb + b] = _mm_cvtss_f32(dm);
      rest += _mm_cvtss_f32(_mm_movehdup_ps(dm)) * xsum[b];
    }
    mterm[j] = _mm512_reduce_add_ps(macc) + rest;
  }
  __m512 acc[R];
#pragma GCC unroll 8
  for (int j = 0; j < R; ++j) acc[j] = _mm512_setzero_ps();
  // a nibble's value as a float: VPERMPS reads the low 4 bits of each index lane (no mask, no conversion)
  const __m512 nibble = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t b = 0; b < kb; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[j * kb + b].qs)));
      __m512 t = _mm512_mul_ps(x0, _mm512_permutexvar_ps(q, nibble));
      t = _mm512_fmadd_ps(x1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), nibble), t);
      acc[j] = _mm512_fmadd_ps(t, _mm512_set1_ps(d[j * kb + b]), acc[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < R; ++j) y[j] = _mm512_reduce_add_ps(acc[j]) + mterm[j] + (bias ? bias[j] : 0.f);
}

constexpr int64_t kXsLanes = 1;  // xsum: one sum a block
#else
constexpr int64_t kXsLanes = 8;
#endif

template <typename B>
[[gnu::always_inline]] inline void tile(const float* x, const float* xs, int64_t kb, const B* w, int64_t nr, float* y,
                                        const float* bias) {
  if constexpr (std::is_same_v<B, BlockQ4_1>) {
#ifdef __AVX512F__
    if (nr == NR) return tile16_q4_1<NR>(x, xs, kb, w, y, bias);
    for (int64_t r = 0; r < nr; ++r) tile16_q4_1<1>(x, xs, kb, w + r * kb, y + r, bias ? bias + r : nullptr);
#else
    if (nr == NR) return tile_q4_1<NR>(x, xs, kb, w, y, bias);
    for (int64_t r = 0; r < nr; ++r) tile_q4_1<1>(x, xs, kb, w + r * kb, y + r, bias ? bias + r : nullptr);
#endif
  } else {  // the Q8_0 LM head streams from memory at the 8-lane tile's rate already
    for (int64_t r = 0; r < nr; ++r) tile_q8_0<1>(x, xs, kb, w + r * kb, y + r, bias ? bias + r : nullptr);
  }
}

// Tiles of W: rows per tile and their count.
template <typename B>
int64_t tile_rows(int64_t K) { return std::is_same_v<B, BlockQ4_1> && K < LONG_ROW ? NR : 1; }

// xs for the Q4_1 tiles, in a buffer each calling thread keeps; empty for Q8_0. AVX-512 (tile16_q4_1): each block's
// sum of x; else (tile_q4_1) the sum of each block's 4 slices of x, 8 lanes.
template <typename B>
const float* block_sums(const float* x, int64_t K) {
  thread_local std::vector<float> xs;
  if constexpr (!std::is_same_v<B, BlockQ4_1>) return nullptr;
  const int64_t kb = K / 32;
  if (static_cast<int64_t>(xs.size()) < kXsLanes * kb) xs.resize(kXsLanes * kb);
  for (int64_t b = 0; b < kb; ++b) {
    const float* xb = x + 32 * b;
#ifdef __AVX512F__
    xs[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)));
#else
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
    _mm256_storeu_ps(xs.data() + 8 * b, s);
#endif
  }
  return xs.data();
}

// Tiles [t0, t1) of W; a row's result does not depend on which thread or range computes it.
template <typename B>
void gemv_tiles(const float* x, const float* xs, const B* w, const float* bias, float* y, int64_t N, int64_t K,
                int64_t t0, int64_t t1) {
  const int64_t rows = tile_rows<B>(K), kb = K / 32;
  const int64_t tile_bytes = rows * kb * static_cast<int64_t>(sizeof(B));
  const char* end = reinterpret_cast<const char*>(w + std::min<int64_t>(N, t1 * rows) * kb);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * rows;
    const char* ahead = reinterpret_cast<const char*>(w + n * kb) + kPrefetchBytes;
    for (int64_t off = 0; off < tile_bytes && ahead + off < end; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    tile(x, xs, kb, w + n * kb, std::min<int64_t>(rows, N - n), y + n, bias ? bias + n : nullptr);
  }
}

// Each thread takes a contiguous range of tiles of W (one parallel region per call, as gemm.cpp).
template <typename B>
void gemv(const float* x, const B* w, const float* bias, float* y, int64_t N, int64_t K) {
  const int64_t tiles = (N + tile_rows<B>(K) - 1) / tile_rows<B>(K);
  const float* xs = block_sums<B>(x, K);
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles)));
#pragma omp parallel num_threads(nthreads)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    gemv_tiles(x, xs, w, bias, y, N, K, tiles * t / nt, tiles * (t + 1) / nt);
  }
}

// Part `part` of `parts` (a contiguous range of tiles) of gemv, in the calling thread.
template <typename B>
void gemv_part(const float* x, const B* w, float* y, int64_t N, int64_t K, int64_t part, int64_t parts) {
  const int64_t tiles = (N + tile_rows<B>(K) - 1) / tile_rows<B>(K);
  gemv_tiles(x, block_sums<B>(x, K), w, nullptr, y, N, K, tiles * part / parts, tiles * (part + 1) / parts);
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be one contiguous float32 row [1, K], got ", x.sizes(), " ", x.scalar_type());
}

}  // namespace

// x: [1, K] float32 contiguous; wq: [N, K / 32 * block bytes] uint8 rows of GGUF blocks of type qtype.
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor wq, int64_t qtype, std::optional<torch::Tensor> bias) {
  check_x(x);
  const int64_t K = x.size(1), N = check_blocks(wq, qtype, K);
  torch::Tensor b;
  const float* bp = bias_ptr(bias, N, b);
  auto y = torch::empty({1, N}, x.options());
  if (qtype == BlockQ4_1::kType)
    gemv(x.data_ptr<float>(), reinterpret_cast<const BlockQ4_1*>(wq.data_ptr<uint8_t>()), bp, y.data_ptr<float>(), N, K);
  else
    gemv(x.data_ptr<float>(), reinterpret_cast<const BlockQ8_0*>(wq.data_ptr<uint8_t>()), bp, y.data_ptr<float>(), N, K);
  return y;
}

// quant_gemv(x, wq, qtype) into y [1, N], only the rows of part `part` of `parts`, in the calling thread: the share
// of one thread of a team that is already running (decode_layer's one parallel region per layer). The same bits
// as quant_gemv, whatever the split.
void quant_gemv_part(torch::Tensor x, torch::Tensor wq, int64_t qtype, torch::Tensor y, int64_t part,
                     int64_t parts) {
  check_x(x);
  const int64_t K = x.size(1), N = check_blocks(wq, qtype, K);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == 1 && y.size(1) == N && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "y must be a contiguous float32 [1, ", N, "] tensor, got ", y.sizes(), " ", y.scalar_type());
  TORCH_CHECK(parts >= 1 && part >= 0 && part < parts, "part must be in [0, parts), got ", part, " of ", parts);
  if (qtype == BlockQ4_1::kType)
    gemv_part(x.data_ptr<float>(), reinterpret_cast<const BlockQ4_1*>(wq.data_ptr<uint8_t>()), y.data_ptr<float>(),
              N, K, part, parts);
  else
    gemv_part(x.data_ptr<float>(), reinterpret_cast<const BlockQ8_0*>(wq.data_ptr<uint8_t>()), y.data_ptr<float>(),
              N, K, part, parts);
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("quant_gemv(Tensor x, Tensor wq, int qtype, Tensor? bias=None) -> Tensor");  // one row, scales factored out
  // quant_gemv's rows of one part into y, in the calling thread (a team's share)
  m.def("quant_gemv_part(Tensor x, Tensor wq, int qtype, Tensor(a!) y, int part, int parts) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("quant_gemv", &quant_gemv);
  m.impl("quant_gemv_part", &quant_gemv_part);
}
