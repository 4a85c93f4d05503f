// y[M, N] = x[M, K] @ bf16(W)^T for small decode steps (M <= 32) on AMX tiles, W read as its GGUF Q4_1 blocks and
// rounded to bf16 in the kernel: the bits of amx_linear_bf16 on the matrix's bf16 copy, from 3.2x fewer bytes.
//
// A decode step streams its weights once: the embedded model's 30 layers are 212 MB as bf16 copies, 66 MB as Q4_1
// blocks. On 2 cores of an AMX Xeon the copies streamed at ~20 GB/s (~10 ms a step at 1-32 rows) and the tiles'
// products took a fraction of that. Here each K step of a task (32 columns: two 16-row blocks of W) dequantizes its
// 32 GGUF blocks into a 2 KB tile buffer in L1, each weight exactly as gguf's dequantize gives it (fma(q, d, m) in
// fp32) rounded to nearest even as torch rounds the copy, and those tiles are the A operands: C^T[n, m] += W[n, k]
// x[m, k], with x^T packed once a call as the B operands (its K pairs in the tiles' VNNI order), one or two 16-row
// groups. TDPBF16PS sums each output's pairs in the same order whichever operand is A, so the result equals the
// copy's GEMM bit for bit (tested). The C^T tiles are transposed on the way out (a gather a row of 16 outputs).
// The 30 layers' GEMMs, 2 cores, alternating with the copy (ms): 6.5-7.4 / 9.8-10.3 at 1-4 rows, 7.0-7.9 / 10.1-10.9
// at 8, 7.6-8.3 / 9.8-10.7 at 16, even at 32 (dequantizing 106M weights a step costs ~6 ms there). Q8_0 from its
// blocks (1.7x fewer bytes than bf16) measured even with its copy at 1-16 rows, so it keeps the copy.
// amx_blocks_linear_silu_bf16: the fused gate/up matrix (gate = W's first N / 2 rows) with silu(gate) * up in the
// epilogue, each rounded to bf16 first as amx_linear_silu_bf16 does.
// Without tiles (or a build without them) the op computes the same product through the dequantized matrix in bf16
// (ATen), so it is callable everywhere; the callers take it only where amx_linear_bf16 runs on tiles.
#include "ops_common.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace pagedllm_ops;

constexpr int64_t MAX_ROWS = 32;  // two 16-row groups against two n-blocks: accumulators 0-3

#ifdef PAGEDLLM_AMX
// lane i holds i * stride: the offsets of a gather over 16 rows (or columns) stride elements apart
inline __m512i lane_offsets(int64_t stride) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(static_cast<int32_t>(stride)));
}

// The scales of a K step's blocks (rows r < nrows of 16, row stride row_bytes, from w) as fp32 d[r] and m[r],
// converted 16 at a time from one gather of each block's first 32 bits; the blocks then broadcast them from memory
// (a load, not a shuffle on the port the conversions need).
inline void block_scales(const char* w, int64_t nrows, int64_t row_bytes, float* d, float* m) {
  const __m512i rows = lane_offsets(row_bytes);
  const __mmask16 mask = static_cast<__mmask16>((1u << nrows) - 1);
  const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, w, 1);
  _mm512_store_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
  _mm512_store_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
}

// 32 weights of a block as 32 bf16 (64 bytes) at out: exactly gguf's fp32 values, rounded to nearest even: its 16
// values d i + m (i < 16, fma: numpy's d * q + m, d * q being exact) looked up by nibble (VPERMPS reads an index's
// low 4 bits: no mask for the low nibbles, and one FMA a block instead of one per 16 weights).
inline void block_bf16(const BlockQ4_1& b, float d, float m, uint16_t* out) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m));
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs)));
  const __m512 lo = _mm512_permutexvar_ps(q, table), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// x [M, K] bf16 as the B tiles: xt[kb][g] is a 16 x 64-byte tile whose row kp holds the K pair (2 kp, 2 kp + 1) of
// column kb's 32 for rows 16 g .. 16 g + 15 (zero past M). One gather of 16 pairs a row.
void pack_xt(const uint16_t* x, int64_t M, int64_t K, int64_t Kb, int64_t G, uint32_t* xt) {
  const int32_t* x32 = reinterpret_cast<const int32_t*>(x);
  const __m512i rows = lane_offsets(K / 2);
#pragma omp for schedule(static)
  for (int64_t kb = 0; kb < Kb; ++kb)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t valid = std::min<int64_t>(16, M - 16 * g);
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
      const int32_t* base = x32 + 16 * g * (K / 2) + kb * 16;
      uint32_t* tile = xt + (kb * G + g) * 256;
      for (int64_t kp = 0; kp < 16; ++kp)
        _mm512_storeu_si512(tile + kp * 16,
                            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, base + kp, 4));
    }
}

// C^T for NB consecutive 16-row blocks of W (at w, rows nrows <= 16 NB of them, row stride row_bytes) against G
// row groups: NB x G <= 4 accumulators (n-block b, group g: tile b G + g) over Kb K steps. Each step's weight tiles
// are dequantized into abuf (two sets, alternating between steps, so the next step's writes do not wait for the
// loads that read the last); A tiles in 4/5, x^T tiles in 6/7. Two n-blocks a pass halve the x^T tiles read from
// L2 per product (at 33-64 rows, four groups against one n-block, those reads bound the pass). pf: the next
// blocks' bytes, prefetched into L2 pf_lines a step. Out: ct[b G + g] = 16 x 16 fp32 (row n, column m).
template <int NB, int G>
void block_pass(const char* w, int64_t nrows, int64_t row_bytes, int64_t Kb, const uint32_t* xt, uint16_t* abuf,
                float* ct, const char* pf, int64_t pf_lines) {
  static_assert(NB * G <= 4 && NB <= 2 && G <= 2, "four accumulators");
  _tile_zero(0);
  if constexpr (NB * G > 1) _tile_zero(1);
  if constexpr (NB * G > 2) { _tile_zero(2); _tile_zero(3); }
  for (int64_t kb = 0; kb < Kb; ++kb) {
    if (pf)
      for (int64_t l = 0; l < pf_lines; ++l) _mm_prefetch(pf + (kb * pf_lines + l) * 64, _MM_HINT_T1);
    uint16_t* a = abuf + (kb & 1) * 1024;
    alignas(64) float d[32], m[32];
    const char* wk = w + kb * sizeof(BlockQ4_1);
    for (int64_t h = 0; h < nrows; h += 16)
      block_scales(wk + h * row_bytes, std::min<int64_t>(16, nrows - h), row_bytes, d + h, m + h);
    for (int64_t r = 0; r < nrows; ++r)
      block_bf16(*reinterpret_cast<const BlockQ4_1*>(wk + r * row_bytes), d[r], m[r], a + r * 32);
    const uint32_t* bt = xt + kb * G * 256;
    _tile_loadd(4, a, 64);
    _tile_loadd(6, bt, 64);
    if constexpr (NB == 2) _tile_loadd(5, a + 512, 64);
    if constexpr (G == 2) _tile_loadd(7, bt + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (G == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NB == 2 && G == 1) _tile_dpbf16ps(1, 5, 6);  // tile numbers are immediates
    if constexpr (NB == 2 && G == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NB == 2 && G == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, ct, 64);
  if constexpr (NB * G > 1) _tile_stored(1, ct + 256, 64);
  if constexpr (NB * G > 2) { _tile_stored(2, ct + 512, 64); _tile_stored(3, ct + 768, 64); }
}

void block_pass_nbg(int64_t NB, int64_t G, const char* w, int64_t nrows, int64_t row_bytes, int64_t Kb,
                    const uint32_t* xt, uint16_t* abuf, float* ct, const char* pf, int64_t pf_lines) {
  if (NB == 2 && G == 2) return block_pass<2, 2>(w, nrows, row_bytes, Kb, xt, abuf, ct, pf, pf_lines);
  if (NB == 2) return block_pass<2, 1>(w, nrows, row_bytes, Kb, xt, abuf, ct, pf, pf_lines);
  if (G == 2) return block_pass<1, 2>(w, nrows, row_bytes, Kb, xt, abuf, ct, pf, pf_lines);
  return block_pass<1, 1>(w, nrows, row_bytes, Kb, xt, abuf, ct, pf, pf_lines);
}

template <bool SILU>
void run_blocks(const char* w, int64_t N, int64_t Kb, const uint16_t* x, int64_t M, int64_t K, at::BFloat16* y) {
  const int64_t G = (M + 15) / 16, row_bytes = Kb * static_cast<int64_t>(sizeof(BlockQ4_1)), Nb = (N + 15) / 16;
  // a task: 32 output columns (two n-blocks; SILU: two of gate and the same two of up), 16 at the edge
  const int64_t half = SILU ? Nb / 2 : Nb, tasks = (half + 1) / 2, ldy = SILU ? N / 2 : N;
  const int64_t pf_lines = (32 * row_bytes / 64 + Kb - 1) / Kb;
  std::vector<uint32_t> xt(Kb * G * 256);
  const int nthreads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), tasks));
#pragma omp parallel num_threads(nthreads)
  {
    pack_xt(x, M, K, Kb, G, xt.data());  // a worksharing loop: its barrier ends the packing
    const TileConfig cfg;
    _tile_loadconfig(&cfg);
    alignas(64) uint16_t abuf[2 * 1024];
    alignas(64) float ct[2][4 * 256];
    const __m512i col = lane_offsets(16);  // a C^T tile's column
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t n0 = 32 * t, nrows = std::min<int64_t>(32, (SILU ? N / 2 : N) - n0), NB = (nrows + 15) / 16;
      if (nrows % 16) std::memset(abuf, 0, sizeof(abuf));  // rows past N multiply as zeros
      const char* wt = w + n0 * row_bytes;
      const char* pf = t + 1 < tasks ? wt + nrows * row_bytes : nullptr;
      block_pass_nbg(NB, G, wt, nrows, row_bytes, Kb, xt.data(), abuf, ct[0], pf, pf_lines);
      if constexpr (SILU) {
        const char* wu = wt + N / 2 * row_bytes;
        block_pass_nbg(NB, G, wu, nrows, row_bytes, Kb, xt.data(), abuf, ct[1], pf ? wu + nrows * row_bytes : nullptr,
                       pf_lines);
      }
      for (int64_t b = 0; b < NB; ++b) {
        const int64_t cols = std::min<int64_t>(16, nrows - 16 * b);
        for (int64_t m = 0; m < M; ++m) {  // row m's 16 outputs: column m % 16 of C^T tile (b, m / 16)
          const int64_t tile = (b * G + m / 16) * 256 + m % 16;
          const __m512 v = _mm512_i32gather_ps(col, ct[0] + tile, 4);
          at::BFloat16* yr = y + m * ldy + n0 + 16 * b;
          if constexpr (SILU) {
            store16(yr, silu_mul16_bf16(round_bf16(v), round_bf16(_mm512_i32gather_ps(col, ct[1] + tile, 4))));
          } else if (cols == 16) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr), (__m256i)_mm512_cvtneps_pbh(v));
          } else {
            alignas(64) float tmp[16];
            _mm512_store_ps(tmp, v);
            for (int64_t j = 0; j < cols; ++j) yr[j] = at::BFloat16(tmp[j]);
          }
        }
      }
    }
    _tile_release();
  }
}
#endif

torch::Tensor blocks_gemm(const torch::Tensor& x, const torch::Tensor& blocks, int64_t N, bool silu, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x must be a 2-d bf16 matrix");
  const int64_t M = x.size(0), K = x.size(1), Kb = K / 32;
  TORCH_CHECK(K % 32 == 0 && blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(0) == N && blocks.size(1) == Kb * static_cast<int64_t>(sizeof(BlockQ4_1)),
              name, ": blocks must be Q4_1 rows, uint8 [N, K / 32 * 20] for x's K");
  TORCH_CHECK(M <= MAX_ROWS, name, ": at most ", MAX_ROWS, " rows, got ", M);
  TORCH_CHECK(!silu || N % 32 == 0, name, ": gate and up need a multiple of 16 rows each");
  if (!amx_usable()) {  // the same product through ATen: the dequantized matrix in bf16
    static const auto dequantize = op<torch::Tensor(const torch::Tensor&, int64_t, int64_t)>("pagedllm::dequantize");
    return linear_bf16_aten(x, dequantize.call(blocks, BlockQ4_1::kType, K).to(at::kBFloat16), silu);
  }
  auto y = torch::empty({M, silu ? N / 2 : N}, x.options());
#ifdef PAGEDLLM_AMX
  if (M == 0) return y;
  auto xc = x.contiguous();
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const char* w = reinterpret_cast<const char*>(blocks.data_ptr<uint8_t>());
  if (silu) run_blocks<true>(w, N, Kb, xs, M, K, y.data_ptr<at::BFloat16>());
  else run_blocks<false>(w, N, Kb, xs, M, K, y.data_ptr<at::BFloat16>());
#endif
  return y;
}

torch::Tensor amx_blocks_linear_bf16(torch::Tensor x, torch::Tensor blocks, int64_t N) {
  return blocks_gemm(x, blocks, N, false, "amx_blocks_linear_bf16");
}

torch::Tensor amx_blocks_linear_silu_bf16(torch::Tensor x, torch::Tensor blocks, int64_t N) {
  return blocks_gemm(x, blocks, N, true, "amx_blocks_linear_silu_bf16");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("amx_blocks_linear_bf16(Tensor x, Tensor blocks, int N) -> Tensor");
  m.def("amx_blocks_linear_silu_bf16(Tensor x, Tensor blocks, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("amx_blocks_linear_bf16", &amx_blocks_linear_bf16);
  m.impl("amx_blocks_linear_silu_bf16", &amx_blocks_linear_silu_bf16);
}
