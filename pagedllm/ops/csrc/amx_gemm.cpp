// y[M, N] = x[M, K] @ W[N, K]^T in bf16 on AMX tiles, for the small M of decode steps (AMX Xeons).
//
// At 1-64 rows oneDNN's prepacked bf16 GEMM streams the embedded model's weights at ~13 GB/s on 2 cores, half of
// what the memory gives: the decode step's GEMMs are then bound by neither memory nor the tiles. Here W is packed
// once into the tiles' VNNI layout, 16 output columns at a time, so that each thread streams one contiguous run of
// memory (the hardware prefetcher's best case) and every weight byte loaded feeds all M rows: a B tile is used by
// every A tile of the call before the next is loaded. Products accumulate in fp32 in the tiles (as oneDNN's do);
// the result is rounded to bf16 like oneDNN's bf16 output. Only summation order differs from oneDNN's.
//
// Packed layout [Nb, Kb, 16, 32] bf16: for column block nb (16 columns) and K block kb (32), one B tile of 16 rows kp
// holding the pairs (W[n][kb*32 + 2kp], W[n][kb*32 + 2kp + 1]) of its columns n; zero past N and K.
// Measured (the embedded model's 30 layers' GEMMs, weights out of cache, Xeon with AMX, 2 threads): 11.0 ms at 1-16
// rows against oneDNN's 15.4-15.6, 14.6 against 18.6 at 32; from 48 rows oneDNN led (16.4 vs 15.6 ms), so callers
// keep it for decode-sized GEMMs.
#include "ops_common.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace pagedllm_ops;

constexpr int64_t TN = 16;  // output columns per block (one B tile)
constexpr int64_t TK = 32;  // K per tile step (32 bf16 = one 64-byte tile row)
constexpr int64_t MAX_M = 64;  // rows per call: four 16-row accumulator tiles

// where W[n][k] sits in the packing (see the header): tile (n / 16, k / 32), row (k % 32) / 2, pair n % 16, half k % 2
inline int64_t packed_index(int64_t n, int64_t k, int64_t Kb) {
  return ((n / TN) * Kb + k / TK) * 16 * 32 + ((k % TK) / 2) * 32 + (n % TN) * 2 + (k % 2);
}

torch::Tensor amx_pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx_pack_bf16: w must be a 2-d bf16 matrix");
  const int64_t N = w.size(0), K = w.size(1), Kb = (K + TK - 1) / TK;
  auto wc = w.contiguous();
  auto out = torch::zeros({(N + TN - 1) / TN, Kb, 16, 32}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, TN, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) dst[packed_index(n, k, Kb)] = src[n * K + k];
  });
  return out;
}

// W [N, K] back from its packing (where this build or CPU has no tiles, the op multiplies by it through ATen)
torch::Tensor amx_unpack_bf16(const torch::Tensor& packed, int64_t N, int64_t K) {
  const int64_t Kb = packed.size(1);
  auto w = torch::empty({N, K}, packed.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[n * K + k] = src[packed_index(n, k, Kb)];
  return w;
}

#ifdef PAGEDLLM_AMX
// One column block (16 columns) for all MT * 16 rows of xp (Kb * 32 columns, zero padded), in one pass over K: each
// B tile is loaded once and feeds the MT row tiles (accumulators: tiles 0..MT-1; A and B double buffered in 4/6,
// 5/7 so a load does not wait for the product that reads the previous one).
template <int MT>
inline void column_block(const uint16_t* xp, int64_t Kb, const uint16_t* wblock, float* cbuf, at::BFloat16* y,
                         int64_t M, int64_t N, int64_t n0) {
  const int64_t xstride = Kb * TK * 2, rstride = 16 * Kb * TK;
  if constexpr (MT > 0) _tile_zero(0);
  if constexpr (MT > 1) _tile_zero(1);
  if constexpr (MT > 2) _tile_zero(2);
  if constexpr (MT > 3) _tile_zero(3);
  for (int64_t kb = 0; kb < Kb; kb += 2) {
    const uint16_t* a = xp + kb * TK;
    const uint16_t* b = wblock + kb * 16 * 32;
    const bool two = kb + 1 < Kb;
    _tile_loadd(5, b, 64);
    if (two) _tile_loadd(7, b + 16 * 32, 64);
#define PAGEDLLM_AMX_ROW(t)                                                    \
    if constexpr (MT > t) {                                                    \
      _tile_loadd(4, a + t * rstride, xstride);                               \
      _tile_dpbf16ps(t, 4, 5);                                                 \
      if (two) {                                                               \
        _tile_loadd(6, a + t * rstride + TK, xstride);                        \
        _tile_dpbf16ps(t, 6, 7);                                               \
      }                                                                        \
    }
    PAGEDLLM_AMX_ROW(0)
    PAGEDLLM_AMX_ROW(1)
    PAGEDLLM_AMX_ROW(2)
    PAGEDLLM_AMX_ROW(3)
#undef PAGEDLLM_AMX_ROW
  }
  if constexpr (MT > 0) _tile_stored(0, cbuf, 64);
  if constexpr (MT > 1) _tile_stored(1, cbuf + 256, 64);
  if constexpr (MT > 2) _tile_stored(2, cbuf + 512, 64);
  if constexpr (MT > 3) _tile_stored(3, cbuf + 768, 64);
  const int64_t cols = std::min(TN, N - n0);
  for (int64_t r = 0; r < M; ++r) {
    at::BFloat16* yr = y + r * N + n0;
    const float* c = cbuf + r * TN;
    if (cols == TN) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c)));
    } else {
      for (int64_t j = 0; j < cols; ++j) yr[j] = at::BFloat16(c[j]);
    }
  }
}
#endif

torch::Tensor amx_linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear_bf16: x must be a 2-d bf16 matrix");
  TORCH_CHECK(x.size(0) <= MAX_M, "amx_linear_bf16: at most 64 rows (larger GEMMs go to oneDNN)");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 32 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "amx_linear_bf16: packed must come from amx_pack_bf16");
  const int64_t M = x.size(0), K = x.size(1), Nb = packed.size(0), Kb = packed.size(1);
  TORCH_CHECK((K + TK - 1) / TK == Kb && (N + TN - 1) / TN == Nb, "amx_linear_bf16: x / N do not fit the packing");
  if (!amx_usable()) return at::linear(x, amx_unpack_bf16(packed, N, K));  // same product, without the tiles
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef PAGEDLLM_AMX
  // x zero padded to [MT * 16, Kb * 32]: A tiles are whole 16 x 32 tiles
  const int64_t MT = (M + 15) / 16, Kp = Kb * TK;
  std::vector<uint16_t> xp(MT * 16 * Kp, 0);
  auto xc = x.contiguous();
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < M; ++r) std::memcpy(xp.data() + r * Kp, xs + r * K, K * 2);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int nthreads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), Nb));
#pragma omp parallel num_threads(nthreads)
  {
    const TileConfig cfg;
    _tile_loadconfig(&cfg);
    alignas(64) float cbuf[MAX_M * TN];
    // static: each thread streams one contiguous run of the packed weight
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < Nb; ++nb) {
      const uint16_t* blk = w + nb * Kb * 16 * 32;
      switch (MT) {
        case 1: column_block<1>(xp.data(), Kb, blk, cbuf, yp, M, N, nb * TN); break;
        case 2: column_block<2>(xp.data(), Kb, blk, cbuf, yp, M, N, nb * TN); break;
        case 3: column_block<3>(xp.data(), Kb, blk, cbuf, yp, M, N, nb * TN); break;
        default: column_block<4>(xp.data(), Kb, blk, cbuf, yp, M, N, nb * TN); break;
      }
    }
    _tile_release();
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("amx_pack_bf16(Tensor w) -> Tensor");
  m.def("amx_linear_bf16(Tensor x, Tensor packed, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("amx_pack_bf16", &amx_pack_bf16);
  m.impl("amx_linear_bf16", &amx_linear_bf16);
}
