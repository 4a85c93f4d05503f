// Causal prefill attention over a bf16 paged KV pool on AMX tiles (AMX Xeons), head_dim 64.
//
// torch's CPU flash SDPA reached ~0.1 TFLOP/s on the embedded model's prompts (one 270-token prompt: 0.53 ms a
// layer on an AMX Xeon, 2 threads), and feeding it cost as much again: the context gathered out of the pool, q cast
// and transposed, the output copied back. Here K/V rows are read through the block table and the products run on
// the tiles, transposed (a key or a dim per tile row, a query per lane), so the online softmax's max and sums run
// down columns with no horizontal reductions:
//   S^T = K Q^T     (A: 16 keys x 32 dims, straight from the pool; B: Q^T in bf16 pairs)
//   P^T = 2^(S^T log2 e - max) in fp32 (AVX-512, exp2_16), rounded to bf16
//   O^T += V^T P^T  (A: 16 dims x 32 keys of V^T; B: P^T in key pairs)
// as torch's bf16 flash kernel computes (products accumulate in fp32; q and P rounded to bf16). A task is one
// (sequence, kv head, 64-row query chunk): it transposes the V rows its chunk sees into a thread-local buffer,
// then walks the 16-row query tiles of the heads sharing that kv head over them. Where there are no tiles the op
// computes the same through ATen.
// On AVX512-BF16 CPUs without tiles (Zen 4 / 5) the same layouts and softmax run with VDPBF16PS (dp_tile: a tile
// product as 16 rows of broadcast pairs against the B tile's 64-byte rows) instead of SDPA over a gathered context.
// Measured (same machine, 9 / 3 heads, 2 threads): 1 x 270 tokens 0.22 ms a layer (~380 GFLOP/s), 8 x 256 1.56 ms,
// 1 x 1024 2.0 ms (~600 GFLOP/s); SLEEF's expf16_u10 in the softmax had made them 0.30, 2.0 and 2.8 ms.
#include "ops_common.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace pagedllm_ops;

constexpr int64_t D = 64;        // head_dim served
constexpr int64_t QT = 16;       // query rows per tile
constexpr int64_t KB = 32;       // keys per block
constexpr int64_t QCHUNK = 64;   // query rows per task

#ifdef __AVX512BF16__
// 16 x 16 32-bit transpose in registers
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// V^T of keys [0, n) of one kv head, read through the block table: vt[block of 32 keys][dim tile][16 dims][32 keys]
// (A of O^T = V^T P^T), zero past n (pool rows past the context may hold anything: P is 0 there, NaN * 0 is not).
void layout_values(const uint16_t* v_head, const int32_t* table, int64_t block_size, int64_t n, uint16_t* vt) {
  // even / odd words of two rows: one dim of 32 keys from the pairs (d, d + 1) of keys 0-15 and 16-31
  alignas(64) static const uint16_t even[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
  alignas(64) static const uint16_t odd[32] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                               33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i ie = _mm512_load_si512(even), io = _mm512_load_si512(odd);
  for (int64_t b = 0; b * KB < n; ++b) {
    __m512i x[2][2][16];  // [key half][dim half][row]
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 16; ++i) {
        const int64_t j = b * KB + h * 16 + i;
        if (j < n) {
          const uint16_t* r = v_head + (table[j / block_size] * block_size + j % block_size) * D;
          x[h][0][i] = _mm512_loadu_si512(r);
          x[h][1][i] = _mm512_loadu_si512(r + 32);
        } else {
          x[h][0][i] = x[h][1][i] = _mm512_setzero_si512();
        }
      }
    for (int h = 0; h < 2; ++h) {
      transpose16(x[h][0]);
      transpose16(x[h][1]);
    }
    uint16_t* dst = vt + b * 4 * 512;
    for (int c = 0; c < 2; ++c)      // dim half
      for (int r = 0; r < 16; ++r) {  // dim pair (c * 32 + 2r, + 1): dims 2r, 2r + 1 of tile c * 2 + r / 8
        uint16_t* t = dst + (c * 2 + r / 8) * 512 + (2 * (r % 8)) * 32;
        _mm512_storeu_si512(t, _mm512_permutex2var_epi16(x[0][c][r], ie, x[1][c][r]));
        _mm512_storeu_si512(t + 32, _mm512_permutex2var_epi16(x[0][c][r], io, x[1][c][r]));
      }
  }
}

// A tile product without tiles: c [16, 16] fp32 (+)= a [16 rows, 2 * PAIRS bf16] (row stride a_stride elements)
// times b [PAIRS][16 columns][2], as _tile_dpbf16ps computes it (fp32 sums of bf16 pair products).
template <int PAIRS, bool ACCUMULATE>
inline void dp_tile(float* c, const uint16_t* a, int64_t a_stride, const uint16_t* b) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = ACCUMULATE ? _mm512_load_ps(c + 16 * i) : _mm512_setzero_ps();
  for (int kp = 0; kp < PAIRS; ++kp) {
    const __m512bh bv = (__m512bh)_mm512_load_si512(b + 32 * kp);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const int32_t pair = *reinterpret_cast<const int32_t*>(a + i * a_stride + 2 * kp);
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pair), bv);
    }
  }
  for (int i = 0; i < 16; ++i) _mm512_store_ps(c + 16 * i, acc[i]);
}

// One tile of query rows [q0, q0 + rows) of one head (positions pos0 + i) over keys [0, n_keys); writes out rows
// (fp32 or bf16, stride out_stride). Computed transposed, one key or dim a row and one query a lane, so the
// softmax's max and sums run down the columns with no horizontal reductions:
//   S^T = K Q^T   (A: 16 keys x 32 dims straight from the pool; B: Q^T in pairs, laid out once per tile)
//   O^T += V^T P^T (A: 16 dims x 32 keys of V^T; B: P^T in key pairs)
template <bool TILES, typename Q, typename O>
void query_tile(const Q* q, int64_t q_stride, int64_t rows, int64_t pos0, int64_t n_keys, const uint16_t* k_head,
                const int32_t* table, int64_t block_size, const uint16_t* vt, float scale, O* out,
                int64_t out_stride) {
  alignas(64) uint16_t qt[2 * 512];  // B tiles: per dim half, [16 dim pairs][16 queries][2]
  alignas(64) float s[KB * QT];      // S^T [32 keys][16 queries]
  alignas(64) uint16_t pt[512];      // P^T pairs [16 key pairs][16 queries][2]
  alignas(64) float o[D * QT];       // O^T [64 dims][16 queries]
  {
    __m512i r[2][16];
    for (int64_t i = 0; i < QT; ++i) {
      for (int c = 0; c < 2; ++c) {
        const Q* qr = q + i * q_stride + c * 32;
        const __m512 x0 = i < rows ? load16(qr) : _mm512_setzero_ps();
        const __m512 x1 = i < rows ? load16(qr + 16) : _mm512_setzero_ps();
        r[c][i] = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
      }
    }
    for (int c = 0; c < 2; ++c) {
      transpose16(r[c]);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(qt + c * 512 + i * 32, r[c][i]);
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  __m512 m = _mm512_set1_ps(-inf), l = _mm512_setzero_ps();
  // scores in log2 units (scale * log2 e), so P = 2^(s - max)
  const __m512 vscale = _mm512_set1_ps(scale * 1.4426950408889634f), neg_inf = _mm512_set1_ps(-inf);
  // the keys each lane (query) sees: up to its position, up to the context; lanes past `rows` see all
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i see = _mm512_min_epi32(
      _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int32_t>(rows))),
                              _mm512_set1_epi32(static_cast<int32_t>(n_keys)),
                              _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(pos0 + 1)))),
      _mm512_set1_epi32(static_cast<int32_t>(n_keys)));
  alignas(64) static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i ipair = _mm512_load_si512(pairs);
  const int64_t nblocks = (std::min(n_keys, pos0 + rows) + KB - 1) / KB;
  // S^T of block b into tiles 4 (keys 0-15) and 5 (16-31), K rows in 6, Q^T in 7 (a block of 32 keys sits in one
  // pool block). Issued a block ahead: the tiles compute the next scores while the vector units run this softmax.
  // Without tiles, straight into s (Q^T's two dim halves are one run of 32 pairs).
  auto scores = [&](int64_t b) {
    const int64_t key0 = b * KB;
    const uint16_t* k = k_head + (table[key0 / block_size] * block_size + key0 % block_size) * D;
    if constexpr (!TILES) {
      dp_tile<32, false>(s, k, D, qt);
      dp_tile<32, false>(s + 16 * QT, k + 16 * D, D, qt);
      return;
    }
#ifdef PAGEDLLM_AMX
    _tile_zero(4);
    _tile_zero(5);
    _tile_loadd(7, qt, 64);
    _tile_loadd(6, k, D * 2);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, k + 16 * D, D * 2);
    _tile_dpbf16ps(5, 6, 7);
    _tile_loadd(7, qt + 512, 64);
    _tile_loadd(6, k + 32, D * 2);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, k + 16 * D + 32, D * 2);
    _tile_dpbf16ps(5, 6, 7);
#endif
  };
  // O^T stays in tiles 0-3 (16 dims each) and goes through memory only to be rescaled; without tiles, in o
  if constexpr (TILES) {
#ifdef PAGEDLLM_AMX
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (nblocks > 0) scores(0);
#endif
  } else {
    std::fill(o, o + D * QT, 0.f);
  }
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t key0 = b * KB;
    if constexpr (TILES) {
#ifdef PAGEDLLM_AMX
      _tile_stored(4, s, 64);
      _tile_stored(5, s + 16 * QT, 64);
      if (b + 1 < nblocks) scores(b + 1);
#endif
    } else {
      scores(b);
    }
    __m512 sv[KB];
    __m512 mx = m;
    for (int j = 0; j < KB; ++j) {
      const __mmask16 valid = _mm512_cmpgt_epi32_mask(see, _mm512_set1_epi32(static_cast<int32_t>(key0 + j)));
      sv[j] = _mm512_mask_mul_ps(neg_inf, valid, _mm512_load_ps(s + j * QT), vscale);
      mx = _mm512_max_ps(mx, sv[j]);
    }
    // lanes that saw no key yet keep -inf: exp(-inf - -inf) would be NaN, so they subtract 0 instead
    const __mmask16 live = _mm512_cmp_ps_mask(mx, neg_inf, _CMP_NEQ_OQ);
    const __m512 mref = _mm512_maskz_mov_ps(live, mx);
    const __m512 alpha =
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, neg_inf, _CMP_NEQ_OQ), exp2_16(_mm512_sub_ps(m, mref)));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < KB; j += 2) {
      const __m512 p0 = exp2_16(_mm512_sub_ps(sv[j], mref));
      const __m512 p1 = exp2_16(_mm512_sub_ps(sv[j + 1], mref));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_store_si512(pt + (j / 2) * 32, _mm512_permutexvar_epi16(ipair, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
    }
    l = _mm512_fmadd_ps(l, alpha, sum);
    m = mx;
    const uint16_t* v = vt + b * 4 * 512;
    if constexpr (!TILES) {
      if (b > 0 && _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ))
        for (int64_t d = 0; d < D; ++d) _mm512_store_ps(o + d * QT, _mm512_mul_ps(_mm512_load_ps(o + d * QT), alpha));
      for (int t = 0; t < 4; ++t) dp_tile<16, true>(o + t * 16 * QT, v + t * 512, 32, pt);  // O^T += V^T P^T
      continue;
    }
#ifdef PAGEDLLM_AMX
    if (b > 0 && _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ)) {
      _tile_stored(0, o, 64);
      _tile_stored(1, o + 16 * QT, 64);
      _tile_stored(2, o + 32 * QT, 64);
      _tile_stored(3, o + 48 * QT, 64);
      for (int64_t d = 0; d < D; ++d) _mm512_store_ps(o + d * QT, _mm512_mul_ps(_mm512_load_ps(o + d * QT), alpha));
      _tile_loadd(0, o, 64);
      _tile_loadd(1, o + 16 * QT, 64);
      _tile_loadd(2, o + 32 * QT, 64);
      _tile_loadd(3, o + 48 * QT, 64);
    }
    // O^T += V^T P^T: P^T in 7, V^T in 6
    _tile_loadd(7, pt, 64);
    _tile_loadd(6, v, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(6, v + 512, 64);
    _tile_dpbf16ps(1, 6, 7);
    _tile_loadd(6, v + 1024, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(6, v + 1536, 64);
    _tile_dpbf16ps(3, 6, 7);
#endif
  }
  if constexpr (TILES) {
#ifdef PAGEDLLM_AMX
    _tile_stored(0, o, 64);
    _tile_stored(1, o + 16 * QT, 64);
    _tile_stored(2, o + 32 * QT, 64);
    _tile_stored(3, o + 48 * QT, 64);
#endif
  }
  // out rows = (O^T / l)^T, 16 dims at a time
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
  for (int64_t dt = 0; dt < D / 16; ++dt) {
    __m512i r[16];
    for (int d = 0; d < 16; ++d) r[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(o + (dt * 16 + d) * QT), inv));
    transpose16(r);
    for (int64_t i = 0; i < rows; ++i) store16(out + i * out_stride + dt * 16, _mm512_castsi512_ps(r[i]));
  }
}

template <bool TILES, typename Q>
void run(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
         int64_t block_size, double scale, int64_t first, int64_t end) {
  const int64_t H = q.size(1), Hkv = k_cache.size(0), group = H / Hkv, slots = k_cache.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  struct Task { int64_t seq, kv_head, q0; };
  std::vector<Task> tasks;
  for (int64_t i = first; i < end; ++i)
    for (int64_t q0 = 0; q0 < starts[i + 1] - starts[i]; q0 += QCHUNK)
      for (int64_t g = 0; g < Hkv; ++g) tasks.push_back({i, g, q0});
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const Q* qp = q.data_ptr<Q>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const bool out_f32 = out.scalar_type() == at::kFloat;
  float* of = out_f32 ? out.data_ptr<float>() : nullptr;
  at::BFloat16* ob = out_f32 ? nullptr : out.data_ptr<at::BFloat16>();
  const int nthreads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
#pragma omp parallel num_threads(nthreads)
  {
#ifdef PAGEDLLM_AMX
    const TileConfig cfg;
    if (TILES) _tile_loadconfig(&cfg);
#endif
    std::vector<uint16_t> vt;
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < static_cast<int64_t>(tasks.size()); ++ti) {
      const Task t = tasks[ti];
      const int64_t q_len = starts[t.seq + 1] - starts[t.seq], s_len = lens[t.seq], ctx0 = s_len - q_len;
      const int64_t rows = std::min(QCHUNK, q_len - t.q0);
      const int64_t n_keys = std::min(s_len, ctx0 + t.q0 + rows);  // the keys this chunk sees
      const int64_t nb = (n_keys + KB - 1) / KB;
      vt.resize(nb * 4 * 512);
      const int64_t g = t.kv_head;
      const int32_t* table = tables + t.seq * table_stride;
      layout_values(vc + g * slots * D, table, block_size, n_keys, vt.data());
      for (int64_t h = g * group; h < (g + 1) * group; ++h)  // the query heads reading this V^T
        for (int64_t r0 = 0; r0 < rows; r0 += QT) {
          const int64_t row = starts[t.seq] + t.q0 + r0, nr = std::min(QT, rows - r0);
          const Q* qr = qp + row * qs0 + h * qs1;
          if (out_f32)
            query_tile<TILES>(qr, qs0, nr, ctx0 + t.q0 + r0, n_keys, kc + g * slots * D, table, block_size,
                              vt.data(), static_cast<float>(scale), of + row * os0 + h * os1, os0);
          else
            query_tile<TILES>(qr, qs0, nr, ctx0 + t.q0 + r0, n_keys, kc + g * slots * D, table, block_size,
                              vt.data(), static_cast<float>(scale), ob + row * os0 + h * os1, os0);
        }
    }
#ifdef PAGEDLLM_AMX
    if (TILES) _tile_release();
#endif
  }
}
#endif

// Where this build has neither tiles nor VDPBF16PS: the same attention through ATen (q and P rounded to bf16 as on
// the tiles), so the op means the same everywhere.
void aten_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                    const torch::Tensor& query_start_loc, int64_t block_size, double scale, int64_t first,
                    int64_t end) {
  const int64_t group = q.size(1) / k_cache.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  for (int64_t i = first; i < end; ++i) {
    const int64_t q_len = starts[i + 1] - starts[i], s_len = lens[i];
    if (q_len == 0) continue;
    auto pos = torch::arange(s_len, torch::kLong);
    auto slots = block_tables[i].to(torch::kLong).index_select(0, pos.floor_divide(block_size)) * block_size +
                 pos.remainder(block_size);
    auto k = k_cache.index_select(1, slots).to(torch::kFloat).repeat_interleave(group, 0);
    auto v = v_cache.index_select(1, slots).to(torch::kFloat).repeat_interleave(group, 0);
    auto qi = q.narrow(0, starts[i], q_len).to(torch::kBFloat16).to(torch::kFloat).transpose(0, 1);
    auto s = torch::matmul(qi, k.transpose(1, 2)) * scale;
    auto mask = pos.unsqueeze(0) > (torch::arange(q_len, torch::kLong) + (s_len - q_len)).unsqueeze(1);
    auto p = torch::softmax(s.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
    out.narrow(0, starts[i], q_len).copy_(torch::matmul(p.to(torch::kBFloat16).to(torch::kFloat), v).transpose(0, 1));
  }
}

// out[T, H, 64] (fp32 or bf16) = causal attention of q[T, H, 64] (fp32 or bf16, rows of stride(0), heads of
// stride(1), dims contiguous) over sequences [first, end) of the batch, reading K/V [Hkv, slots, 64] bf16 in place.
void prefill_attention_amx(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                           int64_t block_size, double scale, int64_t first, int64_t end) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == D && q.stride(2) == 1, "prefill_attention_amx: q must be [T, H, 64] with "
              "contiguous dims");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "prefill_attention_amx: q must be "
              "float32 or bfloat16");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "prefill_attention_amx: out must be float32 or bfloat16 shaped like q");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
                  k_cache.dim() == 3 && k_cache.size(2) == D && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "prefill_attention_amx: k_cache / v_cache must be contiguous [Hkv, slots, 64] bfloat16");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "prefill_attention_amx: query heads must be a multiple of kv heads");
  TORCH_CHECK(block_size % KB == 0, "prefill_attention_amx: block_size must be a multiple of 32");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "prefill_attention_amx: block_tables, seq_lens, query_start_loc must be int32");
  TORCH_CHECK(0 <= first && first <= end && end < query_start_loc.numel() && end <= seq_lens.numel(),
              "prefill_attention_amx: sequences [first, end) out of range");
#ifdef __AVX512BF16__
  const bool f32 = q.scalar_type() == at::kFloat;
  if (amx_usable()) {
    if (f32) run<true, float>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale,
                              first, end);
    else run<true, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size,
                                 scale, first, end);
  } else if (f32) {
    run<false, float>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale, first,
                      end);
  } else {
    run<false, at::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale,
                             first, end);
  }
#else
  aten_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale, first, end);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("prefill_attention_amx(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int block_size, float scale, int first, int end) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("prefill_attention_amx", &prefill_attention_amx); }
