// The sampler's reductions over a step's logits rows, for fp32 logits on x86 CPUs with AVX2.
//
// Every step needs each row's greedy pick (argmax) and, for the chosen token's logprob, the row's log-normaliser
// (logsumexp). With ATen that was two passes over [rows, vocab] plus a full log_softmax written to a fresh buffer and
// gathered from: at 64 rows of a 49,152-token vocabulary ~9 ms a step on an AMX Xeon, mostly the page faults of
// that 12.6 MB buffer. Here each row is read twice while it sits in L2 (max and argmax, then the sum of exp) and
// nothing of its size is written. argmax keeps ATen's rules: the first index of the maximum, a NaN beats every
// number (the first NaN's index, and a NaN logsumexp); a row of -inf gives index 0 and -inf, a +inf logit +inf.
#include "ops_common.h"

#include <sleef.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

using namespace pagedllm_ops;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// First index of the row's maximum and the maximum (NaN: the first NaN), n >= 1.
std::pair<int64_t, float> row_argmax(const float* x, int64_t n) {
  __m256 vmax = _mm256_set1_ps(kNegInf);
  __m256i vidx = _mm256_setzero_si256();
  __m256 nan = _mm256_setzero_ps();
  const __m256i step = _mm256_set1_epi32(8);
  __m256i cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t i = 0;
  for (; i + 8 <= n && i + 8 <= INT32_MAX; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);  // strict: each lane keeps its first maximum
    vmax = _mm256_blendv_ps(vmax, v, gt);
    vidx = _mm256_blendv_epi8(vidx, cur, _mm256_castps_si256(gt));
    cur = _mm256_add_epi32(cur, step);
  }
  if (_mm256_movemask_ps(nan)) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return {j, x[j]};
  }
  alignas(32) float m[8];
  alignas(32) int32_t id[8];
  _mm256_store_ps(m, vmax);
  _mm256_store_si256(reinterpret_cast<__m256i*>(id), vidx);
  float best = kNegInf;
  int64_t arg = 0;
  for (int l = 0; l < 8; ++l)
    if (m[l] > best || (m[l] == best && id[l] < arg)) best = m[l], arg = id[l];  // a lane at -inf kept index 0
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return {i, x[i]};
    if (x[i] > best) best = x[i], arg = i;
  }
  return {arg, best};
}

// log(sum(exp(x))) of a row whose maximum is mx (finite).
float row_logsumexp(const float* x, int64_t n, float mx) {
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  float s = 0.f;
#ifdef __AVX512F__
  {  // 2^((x - mx) log2 e) through exp2_16: a third of SLEEF's instructions, 16 lanes
    const __m512 vm16 = _mm512_set1_ps(mx), log2e = _mm512_set1_ps(1.4426950408889634f);
    __m512 acc16 = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
      acc16 = _mm512_add_ps(acc16, exp2_16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm16), log2e)));
    s = _mm512_reduce_add_ps(acc16);
  }
#endif
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
  s += hsum8(acc);
  for (; i < n; ++i) s += std::exp(x[i] - mx);
  return mx + std::log(s);
}

}  // namespace

// logits: [T, V] float32 CPU, contiguous, V >= 1. Returns (argmax [T] int64, logsumexp [T] float32).
std::tuple<torch::Tensor, torch::Tensor> argmax_logsumexp(torch::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous() && logits.size(1) >= 1,
              "logits must be a contiguous float32 CPU [T, V] tensor with V >= 1");
  const int64_t T = logits.size(0), V = logits.size(1);
  auto idx = torch::empty({T}, logits.options().dtype(at::kLong));
  auto lse = torch::empty({T}, logits.options());
  const float* xp = logits.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, (1 << 16) / V), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* x = xp + t * V;
      const auto [arg, mx] = row_argmax(x, V);
      ip[t] = arg;
      lp[t] = std::isnan(mx) || std::isinf(mx) ? mx : row_logsumexp(x, V, mx);  // ATen: NaN, +inf, -inf
    }
  });
  return {idx, lse};
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  // each row's argmax (ATen's rules) and logsumexp, reading each row while it is in cache
  m.def("argmax_logsumexp(Tensor logits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("argmax_logsumexp", &argmax_logsumexp); }
