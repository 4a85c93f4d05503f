// What pagedllm's CPU kernels share: the torch headers an op library needs (ATen, the op registration macros;
// no Python: each kernel is a torch.library fragment of the `pagedllm` namespace, called as
// torch.ops.pagedllm.<op>, and the dispatcher releases the GIL around the call), the AVX2 helpers every kernel
// used its own copy of (horizontal sum / max, 8-lane loads of fp32, bf16 and int8 rows), and the GGUF block
// layouts with their argument check.
//
// AVX2 helpers exist only when the compiler targets AVX2 (-march=native on an AVX2 CPU): paged_attention.cpp
// keeps scalar paths for CPUs without it; the GEMM and fused kernels need it and fail to build there (their
// callers then fall back to ATen).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDLLM_AMX 1
#endif

namespace pagedllm_ops {

// An op (of any library) as C++ calls it through the dispatcher: how the fused calls (decode_layer.cpp,
// bf16_layers.cpp) run the separate ops, so that their results are those ops' bits.
template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

#ifdef __AVX2__
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// 8 consecutive elements as fp32: fp32 as they are, bf16 widened (the high half of an fp32), int8 converted.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// fp32 -> bf16, round to nearest even (c10::BFloat16's rounding, NaN kept quiet), 8 lanes.
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

#ifdef __AVX512F__
// The same on 16 lanes: bf16 is the high half of an fp32, widened in the register; stores round as store8 (not
// VCVTNEPS2BF16, which flushes subnormal inputs to zero).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// 2^x per lane, for softmax-like sums whose results are rounded to bf16 (not where a result must match ATen's exp
// bit for bit): x = n + f with n = round(x), |f| <= 1/2; 2^f by its Taylor polynomial to degree 6 (relative error
// < 1e-7, about an ulp); VSCALEF applies 2^n. Ten instructions where SLEEF's expf16_u10 takes about thirty, which
// made exp the bound of the AMX prefill attention. Below 2^-125 it gives 0 (-inf included) without producing a
// subnormal: an underflowing VSCALEF takes a microcode assist that tripled a causal prefill's time. NaN stays NaN.
inline __m512 exp2_16(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);
  x = _mm512_max_ps(_mm512_set1_ps(-125.f), x);  // MAXPS returns its second operand (x) for a NaN
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

// silu(g) * u = g / (1 + exp(-g)) * u on 16 lanes, for results rounded to bf16 (exp(-g) as exp2_16(-g log2 e)):
// the bf16 silu_mul and the AMX gate/up GEMM's epilogue compute it alike, so their results are the same bits.
inline __m512 silu_mul16_bf16(__m512 g, __m512 u) {
  const __m512 e = exp2_16(_mm512_mul_ps(g, _mm512_set1_ps(-1.4426950408889634f)));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

#ifdef __AVX512BF16__
// v rounded to bf16 (VCVTNEPS2BF16: nearest even) and widened back: a GEMM output as its bf16 result holds it
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
#endif
#endif
#endif

// x @ w^T through ATen (bf16 in and out), with SILU silu(gate) * up of it (gate: w's first half of rows): what the
// packed bf16 GEMMs (amx_gemm.cpp, amx_blocks.cpp) compute where a CPU or build has no kernel for them.
inline torch::Tensor linear_bf16_aten(const torch::Tensor& x, const torch::Tensor& w, bool silu) {
  auto y = at::linear(x, w);
  if (!silu) return y;
  const int64_t half = y.size(1) / 2;
  auto g = y.narrow(1, 0, half).to(at::kFloat);
  return (g * at::sigmoid(g) * y.narrow(1, half, half).to(at::kFloat)).to(at::kBFloat16);
}

// GGUF blocks of 32 weights (ggml's layout; kType: ggml's type number).
struct BlockQ4_1 {  // w = d * q + m; byte j holds q of weight j (low nibble) and of weight j + 16 (high)
  static constexpr int kType = 3;
  uint16_t d, m;
  uint8_t qs[16];
};
struct BlockQ8_0 {  // w = d * q
  static constexpr int kType = 8;
  uint16_t d;
  int8_t qs[32];
};
static_assert(sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34, "ggml block sizes");

inline void check_qtype(int64_t qtype) {
  TORCH_CHECK(qtype == BlockQ4_1::kType || qtype == BlockQ8_0::kType, "qtype must be Q4_1 (3) or Q8_0 (8), got ",
              qtype);
}

// Bytes of one block of the format qtype (checked).
inline int64_t block_bytes(int64_t qtype) {
  check_qtype(qtype);
  return qtype == BlockQ4_1::kType ? sizeof(BlockQ4_1) : sizeof(BlockQ8_0);
}

// wq: rows of GGUF blocks of format qtype covering K columns (uint8 [N, K / 32 * block bytes]); returns N.
inline int64_t check_blocks(const at::Tensor& wq, int64_t qtype, int64_t K) {
  const int64_t bytes = block_bytes(qtype);
  TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == at::kByte && wq.is_contiguous(),
              "wq must be a contiguous uint8 [N, bytes] tensor");
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(wq.size(1) == K / 32 * bytes, "wq rows must hold K / 32 = ", K / 32, " blocks of ", bytes, " bytes (",
              K / 32 * bytes, " bytes), got ", wq.size(1));
  return wq.size(0);
}

// An optional bias of N elements as contiguous fp32 (converted into holder when it is not), nullptr for None.
inline const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t N, at::Tensor& holder) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  holder = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(holder.numel() == N, "bias must have N = ", N, " elements, got ", holder.numel());
  return holder.data_ptr<float>();
}

// Whether this process may use AMX tiles: built for them, and Linux handed out the tile state (it does so only to a
// process that asks, once; oneDNN asks the same way).
inline bool amx_usable() {
#ifdef PAGEDLLM_AMX
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
#else
  return false;
#endif
}

#ifdef PAGEDLLM_AMX
// palette 1 with all eight tiles 16 rows x 64 bytes
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) rows[t] = 16, colsb[t] = 64;
  }
};
#endif

}  // namespace pagedllm_ops
