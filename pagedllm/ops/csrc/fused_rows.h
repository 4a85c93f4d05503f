// The row kernels of the fused elementwise ops (fused_ops.cpp) that decode_layer.cpp also runs inline, on rows its
// threads own: the residual add + RMSNorm of a row, the gated MLP activation of a row, rope's rotation of a head. One
// source for both, so the fused call's rows are the ops' bits; compiled without FMA contraction (see fused_ops.cpp),
// as the ops are.
#pragma once

#include "ops_common.h"

#include <sleef.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace pagedllm_ops {

// n < 8 elements through padded lanes: the same routines as the full lanes.
template <typename T>
inline __m256 load_tail(const T* p, int64_t n) {
  alignas(32) T buf[8] = {};
  std::copy(p, p + n, buf);
  return load8(buf);
}
template <typename T>
inline void store_tail(T* p, __m256 v, int64_t n) {
  alignas(32) T buf[8];
  store8(buf, v);
  std::copy(buf, buf + n, p);
}

#ifdef __AVX512F__
// silu * up on 16 lanes (ATen's own AVX-512 build runs silu 16 wide through Sleef_expf16_u10): the same formula
// and rounding per element, half the instructions; silu_mul was 12% of a 2048-token bf16 prefill step on 8 lanes.
// Results rounded to bf16 take exp(-g) as exp2_16(-g log2 e) (within an ulp of SLEEF's before the rounding, so
// an output differs from the rounded ATen value by at most one bf16 ulp, and rarely): 1,691 x 1,536 bf16 went from
// 0.92 to 0.62 ms; fp32 outputs keep ATen's bits.
template <bool Bf16Out>
inline __m512 silu_mul16(__m512 g, __m512 u) {
  if constexpr (Bf16Out) {
    return silu_mul16_bf16(g, u);
  } else {
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
  }
}
#endif

// silu(g) * u = g / (1 + exp(-g)) * u on 8 lanes, ATen's silu formula.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
}

// h += d (when HasDelta); y = h * rsqrt(mean(h^2) + eps) * w, for one row of E elements. d: fp32 or bf16 (widened
// exactly); y: fp32, or bf16 rounded from the same fp32 value.
template <bool HasDelta, typename D, typename Y>
void add_rms_norm_row(float* __restrict h, const D* __restrict d, const float* __restrict w,
                      Y* __restrict y, int64_t E, float eps) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 16 <= E; e += 16) {
    __m256 a = _mm256_loadu_ps(h + e), b = _mm256_loadu_ps(h + e + 8);
    if (HasDelta) {
      a = _mm256_add_ps(a, load8(d + e));
      b = _mm256_add_ps(b, load8(d + e + 8));
      _mm256_storeu_ps(h + e, a);
      _mm256_storeu_ps(h + e + 8, b);
    }
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  float ss = hsum8(_mm256_add_ps(acc0, acc1));
  for (; e < E; ++e) {
    if (HasDelta) h[e] += static_cast<float>(d[e]);
    ss += h[e] * h[e];
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(E) + eps);
  if constexpr (std::is_same_v<Y, float>) {
    for (int64_t i = 0; i < E; ++i) y[i] = (h[i] * r) * w[i];
  } else {
    const __m256 rv = _mm256_set1_ps(r);
    int64_t i = 0;
    for (; i + 8 <= E; i += 8)
      store8(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(h + i), rv), _mm256_loadu_ps(w + i)));
    for (; i < E; ++i) y[i] = static_cast<Y>((h[i] * r) * w[i]);
  }
}

// silu(gate) * up of one row of I outputs; gate_up row: fp32 or bf16, out: fp32 or bf16.
template <typename G, typename Y>
void silu_mul_row(const G* g, Y* o, int64_t I) {
  const G* u = g + I;
  int64_t i = 0;
#ifdef __AVX512F__
  constexpr bool bf16_out = std::is_same_v<Y, at::BFloat16>;
  for (; i + 16 <= I; i += 16) store16(o + i, silu_mul16<bf16_out>(load16(g + i), load16(u + i)));
#endif
  for (; i + 8 <= I; i += 8) store8(o + i, silu_mul8(load8(g + i), load8(u + i)));
  if (i < I) store_tail(o + i, silu_mul8(load_tail(g + i, I - i), load_tail(u + i, I - i)), I - i);
}

// One head's rotate-half: y1 = x1 c - x2 s, y2 = x2 c + x1 s (fp32, each product rounded: fp-contract is off), eight
// lanes a time; y may be x itself (each lane group is read before it is written). x: fp32, or bf16 widened exactly.
template <typename X>
inline void rotate_head(const X* x1, const X* x2, float* y1, float* y2, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 a = load8(x1 + i), b = load8(x2 + i), cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(y1 + i, _mm256_sub_ps(_mm256_mul_ps(a, cv), _mm256_mul_ps(b, sv)));
    _mm256_storeu_ps(y2 + i, _mm256_add_ps(_mm256_mul_ps(b, cv), _mm256_mul_ps(a, sv)));
  }
  for (; i < half; ++i) {
    const float a = x1[i], b = x2[i];
    y1[i] = a * c[i] - b * s[i];
    y2[i] = b * c[i] + a * s[i];
  }
}

}  // namespace pagedllm_ops

#pragma GCC pop_options
