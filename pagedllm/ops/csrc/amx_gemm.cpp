// y[M, N] = x[M, K] @ W[N, K]^T in bf16 on AMX tiles (AMX Xeons), for decode steps and light-load prefills; on
// AVX512-BF16 CPUs without tiles (Zen 4 / 5) the same packing through VDPBF16PS (dp_gemm).
//
// W is packed once into the tiles' VNNI layout, 16 output columns at a time. Products accumulate in fp32 in the
// tiles (as oneDNN's do) and the result is rounded to bf16 like oneDNN's bf16 output: only summation order differs.
// - Up to 16 rows (one row tile): each thread streams one contiguous run of the packing (the hardware prefetcher's
//   best case) and each B tile is loaded once. oneDNN's prepacked GEMM streamed the embedded model's weights at
//   ~13 GB/s on 2 cores there, half of what the memory gives: 11.0 ms for the 30 layers' GEMMs against 15.4.
// - From 17 rows, 32 x 32 output blocks (2 x 2 tiles: four products per two A and two B loads). A thread owns
//   column pairs; each pair's B stays in cache while every row pair passes it, and the next pair's B is prefetched
//   into L2 meanwhile (without it, the first pass over a pair waited on memory: 51 -> 36 ms at 270 rows).
//   oneDNN JIT-compiles a primitive per distinct row count (~15-20 ms for the embedded model's four shapes), which
//   a prefill step with a new length pays; these kernels are compiled once.
//   Measured (30 layers' GEMMs, weights out of cache, Xeon with AMX, 2 threads; the VM drifts, so pairs are from
//   one run): 16.2 vs 20.1 ms at 32 rows, 19.6 vs 25.5 at 64; at 270 rows 36 ms against oneDNN's 39-47 (~58-65
//   when it meets the row count first); 73 vs 86 at 512, 142 vs 154 at 1,024; from ~1,100 rows oneDNN leads
//   (164 vs 149 at 1,152, 373 vs 199 at 2,048: a chunk's A no longer stays in L2), so callers keep those there.
// - amx_linear_silu_bf16: the fused gate/up matrix with silu(gate) * up in the epilogue. A task pairs gate block t
//   with up block t + Nb / 2, so a 2 x 2 block holds 16 gate and 16 up columns of 32 rows; each is rounded to bf16
//   as the plain output would be, then silu_mul16_bf16: silu_mul's bits, without writing [M, 2I] and reading it
//   back (the 30 layers' gate/up: 25.3 -> 15.8 ms at 270 rows, 69.2 -> 58.7 at 1,024).
// Tried for the 2 x 2 blocks and left out: prefetching A two K steps ahead into L1, B two column pairs ahead,
// 256-row chunks (these helped only past 1,100 rows, still behind oneDNN).
//
// Packed layout [Nb, Kb, 16, 32] bf16: for column block nb (16 columns) and K block kb (32), one B tile of 16 rows kp
// holding the pairs (W[n][kb*32 + 2kp], W[n][kb*32 + 2kp + 1]) of its columns n; zero past N and K.
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

#ifdef __AVX512BF16__
// rows of c (row stride cstride floats) into y (row stride ldy): with SILU, each row's 16 gate columns (c) and 16 up
// columns (c + up) as silu(gate) * up, each rounded to bf16 first as the plain GEMM's output would be (so the
// result is silu_mul's of that output, bit for bit); else cols columns rounded to bf16.
template <bool SILU>
inline void store_rows(const float* c, int64_t cstride, int64_t up, at::BFloat16* y, int64_t ldy, int64_t rows,
                       int64_t cols) {
  for (int64_t r = 0; r < rows; ++r, c += cstride, y += ldy) {
    if constexpr (SILU) {
      // rounded as silu_mul rounds (store16 keeps subnormal results, which VCVTNEPS2BF16 would flush)
      store16(y, silu_mul16_bf16(round_bf16(_mm512_loadu_ps(c)), round_bf16(_mm512_loadu_ps(c + up))));
      continue;
    }
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + j)));
    for (; j < cols; ++j) y[j] = at::BFloat16(c[j]);
  }
}
#endif

#ifdef PAGEDLLM_AMX
// One column block (16 columns) for the one row tile at a (row stride xstride bytes), in one pass over K: each
// B tile is loaded once (accumulator: tile 0; A and B double buffered in 4/6, 5/7 so a load does not wait for the
// product that reads the previous one). cbuf: [16, 16] fp32.
inline void column_block(const uint16_t* a, int64_t xstride, int64_t Kb, const uint16_t* wblock, float* cbuf) {
  _tile_zero(0);
  for (int64_t kb = 0; kb < Kb; kb += 2) {
    const uint16_t* b = wblock + kb * 16 * 32;
    _tile_loadd(5, b, 64);
    _tile_loadd(4, a + kb * TK, xstride);
    _tile_dpbf16ps(0, 4, 5);
    if (kb + 1 < Kb) {
      _tile_loadd(7, b + 16 * 32, 64);
      _tile_loadd(6, a + (kb + 1) * TK, xstride);
      _tile_dpbf16ps(0, 6, 7);
    }
  }
  _tile_stored(0, cbuf, 64);
}

// A 32 x 32 output block (row tiles at a0 and a1, row stride xstride bytes; column blocks at b0 and b1) in one pass
// over K: each K step loads two A and two B tiles for four products (accumulators 0-3, A in 4/5, B in 6/7). TWO_M /
// TWO_N: whether the second row tile / column block exists (odd counts at the edges). Each K step also prefetches
// pf_lines cache lines from each of pf0 and pf1 into L2 (the next task's two column blocks).
// cbuf: [32, 32] fp32, b0's columns first.
template <bool TWO_M, bool TWO_N>
inline void block_2x2(const uint16_t* a0, const uint16_t* a1, int64_t xstride, int64_t Kb, const uint16_t* b0,
                      const uint16_t* b1, float* cbuf, const char* pf0, const char* pf1, int64_t pf_lines) {
  _tile_zero(0);
  if constexpr (TWO_N) _tile_zero(1);
  if constexpr (TWO_M) _tile_zero(2);
  if constexpr (TWO_M && TWO_N) _tile_zero(3);
  for (int64_t kb = 0; kb < Kb; ++kb) {
    for (int64_t l = 0; l < pf_lines; ++l) {
      _mm_prefetch(pf0 + l * 64, _MM_HINT_T1);
      _mm_prefetch(pf1 + l * 64, _MM_HINT_T1);
    }
    pf0 += pf_lines * 64;
    pf1 += pf_lines * 64;
    _tile_loadd(4, a0 + kb * TK, xstride);
    _tile_loadd(6, b0 + kb * 16 * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TWO_N) {
      _tile_loadd(7, b1 + kb * 16 * 32, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (TWO_M) {
      _tile_loadd(5, a1 + kb * TK, xstride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (TWO_N) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 128);
  if constexpr (TWO_N) _tile_stored(1, cbuf + 16, 128);
  if constexpr (TWO_M) _tile_stored(2, cbuf + 16 * 32, 128);
  if constexpr (TWO_M && TWO_N) _tile_stored(3, cbuf + 16 * 32 + 16, 128);
}


// x's row tiles: full ones in place where K is a multiple of 32, the rest from a zero-padded copy
struct RowTiles {
  const uint16_t *xs, *tail;
  int64_t direct, K, Kp;  // direct: rows read in place
  const uint16_t* operator()(int64_t t) const { return t * 16 < direct ? xs + t * 16 * K : tail + (t * 16 - direct) * Kp; }
};

// The GEMM over the tasks of one tiling. Plain: a task is one column block (one row tile) or a column pair. SILU:
// a task is gate block t with up block t + Nb / 2, and its 16 output columns are silu(gate) * up.
template <bool SILU>
void run_tiles(const uint16_t* w, int64_t Nb, int64_t Kb, int64_t M, int64_t N, int64_t xstride,
               const RowTiles& row_tile, at::BFloat16* yp, int64_t ldy) {
  const int64_t MT = (M + 15) / 16, MP = (MT + 1) / 2, blk = Kb * 16 * 32;
  const int64_t tasks = SILU ? Nb / 2 : MT == 1 ? Nb : (Nb + 1) / 2;
  const int nthreads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), tasks));
#pragma omp parallel num_threads(nthreads)
  {
    const TileConfig cfg;
    _tile_loadconfig(&cfg);
    alignas(64) float cbuf[32 * 32];
    // static: a thread's tasks are one contiguous run of the packing (of each half, with SILU)
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      // the task's two column blocks, and whether the second exists
      const uint16_t* b0 = w + (SILU || MT == 1 ? t : 2 * t) * blk;
      const uint16_t* b1 = SILU ? b0 + Nb / 2 * blk : b0 + blk;
      const bool two_n = SILU || (MT > 1 && 2 * t + 1 < Nb);
      if (MT == 1) {  // one row tile: each column block streamed once
        column_block(row_tile(0), xstride, Kb, b0, cbuf);
        if (SILU) column_block(row_tile(0), xstride, Kb, b1, cbuf + 16 * 16);
        store_rows<SILU>(cbuf, 16, 16 * 16, yp + t * TN, ldy, M, std::min(TN, N - t * TN));
        continue;
      }
      // the next task's blocks, spread over this task's row pairs and K steps
      const int64_t pf_lines = t + 1 < tasks ? (Kb * 16 + MP * Kb - 1) / (MP * Kb) : 0;
      const char* pf0 = reinterpret_cast<const char*>(SILU ? b0 + blk : b0 + 2 * blk);
      const char* pf1 = reinterpret_cast<const char*>(SILU ? b1 + blk : b0 + 3 * blk);
      for (int64_t mp = 0; mp < MP; ++mp, pf0 += Kb * pf_lines * 64, pf1 += Kb * pf_lines * 64) {
        const uint16_t *a0 = row_tile(2 * mp), *a1 = 2 * mp + 1 < MT ? row_tile(2 * mp + 1) : a0;
        const bool two_m = 2 * mp + 1 < MT;
        if (two_m && two_n) block_2x2<true, true>(a0, a1, xstride, Kb, b0, b1, cbuf, pf0, pf1, pf_lines);
        else if (two_m) block_2x2<true, false>(a0, a1, xstride, Kb, b0, b1, cbuf, pf0, pf1, pf_lines);
        else if (two_n) block_2x2<false, true>(a0, a1, xstride, Kb, b0, b1, cbuf, pf0, pf1, pf_lines);
        else block_2x2<false, false>(a0, a1, xstride, Kb, b0, b1, cbuf, pf0, pf1, pf_lines);
        const int64_t rows = std::min<int64_t>(32, M - 32 * mp);
        if (SILU) store_rows<true>(cbuf, 32, 16, yp + 32 * mp * ldy + t * TN, ldy, rows, TN);
        else store_rows<false>(cbuf, 32, 0, yp + 32 * mp * ldy + 32 * t, ldy, rows, std::min<int64_t>(32, N - 32 * t));
      }
    }
    _tile_release();
  }
}
#endif

#ifdef __AVX512BF16__
// The same packing on AVX512-BF16 CPUs without tiles (Zen 4 / 5): VDPBF16PS multiplies a 64-byte row of a B tile
// (16 columns x one K pair) by one x row's K pair broadcast, so each weight line is read once for up to 8 rows. There
// oneDNN streamed the embedded model's bf16 weights at 11-13 GB/s at 8-16 rows; the 30 layers through this loop,
// median of 5 against oneDNN (Zen 4, 2 threads, from memory): 11.1 vs 15.9 ms at 8 rows, 42.8 vs 48.6 at 64, 79.1 vs
// 83.5 at 128, 554 vs 562 at 1,024 (even from there).
// xa: the run's rows of x as [Kp / 2][8] K pairs (pack_run), so the broadcasts read one line instead of 8 row
// streams. pf: the next pair's first block (or null): its lines go to L2 while this pass streams its own, so that
// pair's first pass does not wait on memory; this is run `run` of `runs` over the pair, and prefetches its share
template <int R, int NB>
void dp_block(const int32_t* xa, const uint16_t* w0, int64_t blk, int64_t Kb, float* out, int64_t ldo,
              const uint16_t* pf, int64_t run, int64_t runs) {
  __m512 acc[R][NB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t L = Kb * 16, first = run * L / runs, end = (run + 1) * L / runs;
  // K pairs: the packing is contiguous over a column block's K. One line of pf a block every `runs` pairs, from the
  // first (ceil(L / runs) of them, so the run's share of (end - first) lines is covered)
  for (int64_t p = 0, q = runs - 1, line = first; p < L; ++p) {
    if (pf && ++q == runs) {
      q = 0;
      if (line < end) {
        for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * blk + line * 32), _MM_HINT_T1);
        ++line;
      }
    }
    __m512bh b[NB];
    for (int j = 0; j < NB; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w0 + j * blk + p * 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xa[p * 8 + r]);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + r * ldo + 16 * j, acc[r][j]);
}

template <int NB>
void dp_rows(int64_t rows, const int32_t* xa, const uint16_t* w0, int64_t blk, int64_t Kb, float* out, int64_t ldo,
             const uint16_t* pf, int64_t run, int64_t runs) {
  switch (rows) {
    case 1: return dp_block<1, NB>(xa, w0, blk, Kb, out, ldo, pf, run, runs);
    case 2: return dp_block<2, NB>(xa, w0, blk, Kb, out, ldo, pf, run, runs);
    case 3: return dp_block<3, NB>(xa, w0, blk, Kb, out, ldo, pf, run, runs);
    case 4: return dp_block<4, NB>(xa, w0, blk, Kb, out, ldo, pf, run, runs);
    case 5: return dp_block<5, NB>(xa, w0, blk, Kb, out, ldo, pf, run, runs);
    case 6: return dp_block<6, NB>(xa, w0, blk, Kb, out, ldo, pf, run, runs);
    case 7: return dp_block<7, NB>(xa, w0, blk, Kb, out, ldo, pf, run, runs);
    default: return dp_block<8, NB>(xa, w0, blk, Kb, out, ldo, pf, run, runs);
  }
}

// rows (<= 8) of x (L K pairs a row) as [L][8] pairs, each pair's 8 rows side by side, transposed 8 x 8 at a time;
// slots past `rows` repeat the first row (never read)
void pack_run(const int32_t* x, int64_t L, int64_t rows, int32_t* dst) {
  const int32_t* src[8];
  for (int r = 0; r < 8; ++r) src[r] = x + (r < rows ? r : 0) * L;
  int64_t p = 0;
  for (; p + 8 <= L; p += 8) {
    __m256i v[8], t[8];
    for (int r = 0; r < 8; ++r) v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[r] + p));
    for (int r = 0; r < 8; r += 2) {
      t[r] = _mm256_unpacklo_epi32(v[r], v[r + 1]);
      t[r + 1] = _mm256_unpackhi_epi32(v[r], v[r + 1]);
    }
    for (int h = 0; h < 8; h += 4) {  // per 128-bit lane, rows h..h+3 of pairs (0, 4), (1, 5), (2, 6), (3, 7)
      v[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
      v[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
      v[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
      v[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (p + j) * 8),
                          _mm256_permute2x128_si256(v[j], v[j + 4], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (p + j + 4) * 8),
                          _mm256_permute2x128_si256(v[j], v[j + 4], 0x31));
    }
  }
  for (; p < L; ++p)
    for (int r = 0; r < 8; ++r) dst[p * 8 + r] = src[r][p];
}

// y = xp [M, Kp] (K zero-padded to the packing's Kp) @ W^T in bf16 (SILU: silu(gate) * up of it, [M, N / 2]):
// column-block pairs split over the threads, each pair's rows in ceil(M / 8) runs of as even sizes as can be (an
// odd row alone was a latency-bound pass of its own) over x packed by pack_run (the pair's B, Kp x 32 bf16, stays in
// cache between the runs). A pair is two neighbouring blocks, or with SILU gate block t and up block t + Nb / 2.
// Against runs of 8 over x's rows in place (Zen 4, the embedded model's four layer GEMMs, best of 21 alternating): 30
// layers from memory on 2 threads 11.2 -> 10.4 ms at 16 rows, 19.7 -> 18.1 at 32, 36.0 -> 34.1 at 64; 3 layers
// (cache) 142 -> 131 ms at 256 rows, 596 -> 543 at 1,024; one thread 21.7 -> 19.1 ms at 16, 286 -> 260 at 256
template <bool SILU>
void dp_gemm(const uint16_t* xp, int64_t M, int64_t Kp, const uint16_t* w, int64_t Nb, int64_t N, at::BFloat16* y) {
  const int64_t Kb = Kp / TK, blk = Kb * 16 * 32, pairs = SILU ? Nb / 2 : (Nb + 1) / 2, L = Kp / 2;
  const int64_t stride = SILU ? pairs * blk : blk, ldy = SILU ? N / 2 : N;  // between a pair's blocks; y's rows
  const int64_t runs = (M + 7) / 8;
  thread_local std::vector<int32_t> packed_x;
  if (static_cast<int64_t>(packed_x.size()) < runs * L * 8) packed_x.resize(runs * L * 8);
  int32_t* xa = packed_x.data();
  const auto run_start = [&](int64_t i) { return i * M / runs; };
  const auto pack = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      pack_run(reinterpret_cast<const int32_t*>(xp) + run_start(i) * L, L, run_start(i + 1) - run_start(i),
               xa + i * L * 8);
  };
  if (runs >= 4) at::parallel_for(0, runs, 1, pack);  // split from 4 runs: 2-5% faster at 32-512 rows
  else pack(0, runs);
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float c[8 * 32];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb = SILU ? p : 2 * p, nbs = std::min<int64_t>(2, Nb - nb), next = SILU ? p + 1 : 2 * p + 2;
      // the next pair of this thread, whole (a last odd block is left to the prefetcher), a 1 / runs share in each
      // run so that the memory is busy through the pair's every run: the 30 layers from memory (Zen 4)
      // 10.6 -> 9.3-10.0 ms at 8 rows, 14.5 -> 12.9-13.4 at 16 with it; spread instead of all in the first run,
      // 12.7 -> 11.9 at 16 rows, 30.0 -> 28.4 at 48, 38.2 -> 36.8 at 64, even from 256 (whole in the first run, it
      // cost 137 -> 143 ms at 256)
      const uint16_t* pf = p + 1 < p1 && (SILU || next + 1 < Nb) ? w + next * blk : nullptr;
      for (int64_t i = 0; i < runs; ++i) {
        const int64_t r0 = run_start(i), rows = run_start(i + 1) - r0;
        const int32_t* xr = xa + i * L * 8;
        if (SILU || nbs == 2) dp_rows<2>(rows, xr, w + nb * blk, stride, Kb, c, 32, pf, i, runs);
        else dp_rows<1>(rows, xr, w + nb * blk, stride, Kb, c, 32, pf, i, runs);
        at::BFloat16* yr = y + r0 * ldy + nb * TN;
        if (SILU) store_rows<true>(c, 32, 16, yr, ldy, rows, TN);
        else store_rows<false>(c, 32, 0, yr, ldy, rows, std::min<int64_t>(16 * nbs, N - nb * TN));
      }
    }
  });
}
#endif

// y = x @ W^T (SILU: silu(gate) * up of it, gate = W's first N / 2 rows) in bf16, W packed by amx_pack_bf16.
torch::Tensor amx_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, bool silu, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x must be a 2-d bf16 matrix");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 32 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              name, ": packed must come from amx_pack_bf16");
  const int64_t M = x.size(0), K = x.size(1), Nb = packed.size(0), Kb = packed.size(1);
  TORCH_CHECK((K + TK - 1) / TK == Kb && (N + TN - 1) / TN == Nb, name, ": x / N do not fit the packing");
  TORCH_CHECK(!silu || N % 32 == 0, name, ": gate and up need a multiple of 16 columns each");
  if (!amx_usable()) {  // same product without the tiles: VDPBF16PS over the packing where the CPU has it, else ATen
#ifdef __AVX512BF16__
    const int64_t Kp = Kb * TK;
    auto y = torch::empty({M, silu ? N / 2 : N}, x.options());
    auto xp = K == Kp ? x.contiguous() : at::constant_pad_nd(x, {0, Kp - K}).contiguous();
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>());
    const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
    if (M > 0 && silu) dp_gemm<true>(xs, M, Kp, w, Nb, N, y.data_ptr<at::BFloat16>());
    else if (M > 0) dp_gemm<false>(xs, M, Kp, w, Nb, N, y.data_ptr<at::BFloat16>());
    return y;
#else
    return linear_bf16_aten(x, amx_unpack_bf16(packed, N, K), silu);
#endif
  }
  auto y = torch::empty({M, silu ? N / 2 : N}, x.options());
  if (M == 0) return y;
#ifdef PAGEDLLM_AMX
  // A tiles are whole 16 x 32 tiles. Where K is a multiple of 32 the full row tiles are read from x in place; the
  // rest (a last partial tile, or every row where K is not) is copied into a zero-padded [.., Kb * 32] buffer.
  const int64_t MT = (M + 15) / 16, Kp = Kb * TK;
  auto xc = x.contiguous();
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const int64_t direct = K == Kp ? M / 16 * 16 : 0;  // rows read in place
  auto tail_t = torch::zeros({MT * 16 - direct, Kp}, x.options());
  uint16_t* tail = reinterpret_cast<uint16_t*>(tail_t.data_ptr<at::BFloat16>());
  for (int64_t r = direct; r < M; ++r) std::memcpy(tail + (r - direct) * Kp, xs + r * K, K * 2);
  const RowTiles row_tile{xs, tail, direct, K, Kp};
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (silu) run_tiles<true>(w, Nb, Kb, M, N, Kp * 2, row_tile, y.data_ptr<at::BFloat16>(), N / 2);
  else run_tiles<false>(w, Nb, Kb, M, N, Kp * 2, row_tile, y.data_ptr<at::BFloat16>(), N);
#endif
  return y;
}

torch::Tensor amx_linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return amx_gemm(x, packed, N, false, "amx_linear_bf16");
}

torch::Tensor amx_linear_silu_bf16(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return amx_gemm(x, packed, N, true, "amx_linear_silu_bf16");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("amx_pack_bf16(Tensor w) -> Tensor");
  m.def("amx_linear_bf16(Tensor x, Tensor packed, int N) -> Tensor");
  // silu(gate) * up [M, N / 2] of the [M, N] product (gate: its first N / 2 columns), as silu_mul of its bf16 output
  m.def("amx_linear_silu_bf16(Tensor x, Tensor packed, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("amx_pack_bf16", &amx_pack_bf16);
  m.impl("amx_linear_bf16", &amx_linear_bf16);
  m.impl("amx_linear_silu_bf16", &amx_linear_silu_bf16);
}
