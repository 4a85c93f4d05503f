// The sampler's reductions over a step's logits rows, for fp32 logits on x86 CPUs with AVX2.
//
// exponential_race: a temperature-sampled row's draw, argmax(softmax(x / t) / E), E ~ Exp(1) from the hash of
// pagedllm/worker/noise.py, the same bits. ATen took ~15 passes over [rows, vocab] for it (the hash alone is 9 int32
// ops, each a pass): 13.9 ms of an 80 ms step at 64 sampled rows of a 49,152-token vocabulary (Zen 4, 2 threads).
// Here a row is read twice while it sits in L2: its maximum, then each token's exp((x - max) / t) / E and their
// argmax. The softmax's normaliser is a positive constant of the row, so it is left out: the same draw up to
// rounding.
//
// Every step needs each row's greedy pick (argmax) and, for the chosen token's logprob, the row's log-normaliser
// (logsumexp). With ATen that was two passes over [rows, vocab] plus a full log_softmax written to a fresh buffer and
// gathered from: at 64 rows of a 49,152-token vocabulary ~9 ms a step on an AMX Xeon, mostly the page faults of
// that 12.6 MB buffer. Here each row is read twice while it sits in L2 (max and argmax, then the sum of exp) and
// nothing of its size is written. argmax keeps ATen's rules: the first index of the maximum, a NaN beats every
// number (the first NaN's index, and a NaN logsumexp); a row of -inf gives index 0 and -inf, a +inf logit +inf.
#include "ops_common.h"

#include <sleef.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

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

// The noise hash's mixer (noise.mix32): xor-shift-multiply rounds on 8 lanes of uint32, multiplication wrapping.
inline __m256i mix32_8(__m256i x) {
  const __m256i mul = _mm256_set1_epi32(0x45D9F3B);
  x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16)), mul);
  x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16)), mul);
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

inline uint32_t mix32(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x45D9F3Bu;
  x = (x ^ (x >> 16)) * 0x45D9F3Bu;
  return x ^ (x >> 16);
}

constexpr uint32_t kGolden = 0x9E3779B1u;
constexpr float kTwo24 = 1.0f / (1 << 24), kBelowOne = 1.0f - 1.0f / (1 << 24);

// u in (0, 1) from a token's hash (its 24 high bits), as noise.exponential_noise forms it; its Exp(1) draw is -log(u).
inline __m256 uniform8(__m256i row, const uint32_t* col) {
  const __m256i h = mix32_8(_mm256_xor_si256(row, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col))));
  const __m256i bits = _mm256_and_si256(_mm256_srli_epi32(h, 8), _mm256_set1_epi32(0xFFFFFF));
  const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(0.5f)), _mm256_set1_ps(kTwo24));
  return _mm256_min_ps(u, _mm256_set1_ps(kBelowOne));
}

// One token's Exp(1) draw, -log(u), from the row's and the token id's hashes (uniform8's u on one lane).
inline float exponential1(uint32_t row, uint32_t col) {
  const uint32_t h = mix32(row ^ col);
  return -std::log(std::min(((h >> 8) + 0.5f) * kTwo24, kBelowOne));
}

// The row's draw: the first index of the largest w = exp(x / t - max / t) / E; 0 when the maximum is not finite
// (ATen's softmax is all NaN then, and its argmax 0). `row`: the row's hashed key and counter; `col`: each token's
// hashed id. A token can only beat the best w so far if E < p / best, and E = -log(u) >= 1 - u: tokens with
// (1 - u) best >= p (1 + 2^-10) lose for certain, so the log and the division run only for the few vectors holding
// another (the same result as computing every w: the margin covers their rounding).
int64_t row_race(const float* x, int64_t n, float t, uint32_t row, const uint32_t* col) {
  const float mx = row_argmax(x, n).second;
  if (!std::isfinite(mx)) return 0;
  const float scaled_max = mx / t;
  const __m256 vt = _mm256_set1_ps(t), vm = _mm256_set1_ps(scaled_max), one = _mm256_set1_ps(1.0f);
  const __m256 margin = _mm256_set1_ps(1.0f + 1.0f / 1024);
  const __m256i vrow = _mm256_set1_epi32(static_cast<int32_t>(row)), step = _mm256_set1_epi32(8);
  __m256i ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), best_id = _mm256_setzero_si256();
  __m256 best = _mm256_set1_ps(-1.0f);  // below every w: the first vector is all candidates
  int64_t i = 0;
  for (; i + 8 <= n; i += 8, ids = _mm256_add_epi32(ids, step)) {
    const __m256 p = Sleef_expf8_u10(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vt), vm));
    const __m256 u = uniform8(vrow, col + i);
    const __m256 maybe =
        _mm256_cmp_ps(_mm256_mul_ps(_mm256_sub_ps(one, u), best), _mm256_mul_ps(p, margin), _CMP_LT_OQ);
    if (!_mm256_movemask_ps(maybe)) continue;
    const __m256 w = _mm256_div_ps(p, _mm256_sub_ps(_mm256_setzero_ps(), Sleef_logf8_u10(u)));
    const __m256 gt = _mm256_cmp_ps(w, best, _CMP_GT_OQ);  // strict: each lane keeps its first maximum
    best = _mm256_blendv_ps(best, w, gt);
    best_id = _mm256_blendv_epi8(best_id, ids, _mm256_castps_si256(gt));
  }
  alignas(32) float b[8];
  alignas(32) int32_t id[8];
  _mm256_store_ps(b, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(id), best_id);
  float top = -1.0f;
  int64_t arg = 0;
  for (int l = 0; l < 8; ++l)
    if (b[l] > top || (b[l] == top && id[l] < arg)) top = b[l], arg = id[l];
  for (; i < n; ++i) {
    const float w = std::exp(x[i] / t - scaled_max) / exponential1(row, col[i]);
    if (w > top) top = w, arg = i;
  }
  return arg;
}

// A row's draw after top-k, top-p and min-p (the sampler's filter_logits rules over x / t, then the race of
// row_race among the kept tokens), without sorting the row: only the tokens with e = exp(x / t - max / t) >= tau are
// sorted, tau lowered by 64x until they must hold every kept token (k of them, more than top_p of the mass, or tau
// at or below min_p). ATen sorted all 49,152 logits of each row: ~2 ms a row.
int64_t row_filtered_race(const float* x, int64_t n, float t, int64_t k, float top_p, float min_p, uint32_t row,
                          const uint32_t* col, std::vector<float>& e, std::vector<std::pair<float, int32_t>>& cand) {
  const float mx = row_argmax(x, n).second;
  if (!std::isfinite(mx)) return 0;
  const float sm = mx / t;
  e.resize(n);
  const __m256 vt = _mm256_set1_ps(t), vm = _mm256_set1_ps(sm);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = Sleef_expf8_u10(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vt), vm));
    _mm256_storeu_ps(e.data() + i, v);
    acc = _mm256_add_ps(acc, v);
  }
  double z = hsum8(acc);
  for (; i < n; ++i) z += e[i] = std::exp(x[i] / t - sm);
  for (float tau = 1.0f / 64;; tau = tau > 1e-30f ? tau / 64 : 0.0f) {
    cand.clear();
    double mass = 0.0;
    const __m256 vtau = _mm256_set1_ps(std::max(tau, std::numeric_limits<float>::denorm_min()));
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {  // most vectors hold no token at or above tau
      for (int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e.data() + j), vtau, _CMP_GE_OQ)); bits;
           bits &= bits - 1) {
        const int64_t c = j + __builtin_ctz(bits);
        cand.emplace_back(x[c] / t, static_cast<int32_t>(c)), mass += e[c];
      }
    }
    for (; j < n; ++j)
      if (e[j] >= tau && e[j] > 0.0f) cand.emplace_back(x[j] / t, static_cast<int32_t>(j)), mass += e[j];
    if (static_cast<int64_t>(cand.size()) >= k || mass > top_p * z * (1 + 1e-5) || tau <= min_p || tau == 0.0f) break;
  }
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  // filter_logits' rules in rank order: a token goes when its rank reaches k, the mass before it exceeds top_p, or
  // its probability is below min_p times the first's (e of the first is 1); each only grows along the ranks
  const float inv_z = static_cast<float>(1.0 / z);
  float before = 0.0f, top = -1.0f;
  int64_t arg = 0;
  for (int64_t r = 0; r < static_cast<int64_t>(cand.size()); ++r) {
    const int32_t i = cand[r].second;
    const float p = e[i] * inv_z;
    if (r >= k || before > top_p || e[i] < min_p) break;
    before += p;
    const float w = e[i] / exponential1(row, col[i]);
    if (w > top || (w == top && i < arg)) top = w, arg = i;
  }
  return arg;
}

}  // namespace

static uint32_t row_key(int64_t key, int64_t counter) {
  return mix32(static_cast<uint32_t>(key) ^ mix32(static_cast<uint32_t>(counter) * kGolden));
}

// The races' checked inputs: (tokens out, temperatures, keys, counters, each token id's hash shared by the rows).
static std::tuple<torch::Tensor, const float*, const int64_t*, const int64_t*, std::vector<uint32_t>> race_inputs(
    const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& keys,
    const torch::Tensor& counters) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous() && logits.size(1) >= 1,
              "logits must be a contiguous float32 CPU [T, V] tensor with V >= 1");
  const int64_t T = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V < INT32_MAX, "the race: the vocabulary must fit int32 token ids");
  TORCH_CHECK(temperature.numel() == T && keys.numel() == T && counters.numel() == T,
              "the race: temperature, keys and counters need one entry per logits row");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && keys.scalar_type() == at::kLong &&
                  counters.scalar_type() == at::kLong && temperature.is_contiguous() && keys.is_contiguous() &&
                  counters.is_contiguous(),
              "the race: temperature must be contiguous float32, keys and counters contiguous int64");
  std::vector<uint32_t> col(V);
  at::parallel_for(0, V, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) col[i] = mix32(static_cast<uint32_t>(i) * kGolden);
  });
  return {torch::empty({T}, logits.options().dtype(at::kLong)), temperature.data_ptr<float>(),
          keys.data_ptr<int64_t>(), counters.data_ptr<int64_t>(), std::move(col)};
}

// logits: [T, V] float32 CPU, contiguous; temperature [T] float32 (a row's t <= 0 counts as 1: the caller keeps its
// greedy pick); keys, counters [T] int64 (their low 32 bits, as noise.exponential_noise reads them). Returns [T] int64.
torch::Tensor exponential_race(torch::Tensor logits, torch::Tensor temperature, torch::Tensor keys,
                               torch::Tensor counters) {
  auto [out, tp, kp, cp, col] = race_inputs(logits, temperature, keys, counters);
  const int64_t T = logits.size(0), V = logits.size(1);
  const float* xp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      op[r] = row_race(xp + r * V, V, tp[r] > 0.f ? tp[r] : 1.f, row_key(kp[r], cp[r]), col.data());
  });
  return out;
}

// The same with each row's top_k [T] int64 (<= 0: none), top_p and min_p [T] float32, for rows with a filter.
torch::Tensor filtered_race(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                            torch::Tensor min_p, torch::Tensor keys, torch::Tensor counters) {
  auto [out, tp, kp, cp, col] = race_inputs(logits, temperature, keys, counters);
  const int64_t T = logits.size(0), V = logits.size(1);
  auto k = top_k.to(at::kLong).contiguous();
  auto pp = top_p.to(at::kFloat).contiguous();
  auto mp = min_p.to(at::kFloat).contiguous();
  TORCH_CHECK(k.numel() == T && pp.numel() == T && mp.numel() == T,
              "filtered_race: top_k, top_p and min_p need one entry per logits row");
  const float* xp = logits.data_ptr<float>();
  const int64_t* kk = k.data_ptr<int64_t>();
  const float *ppp = pp.data_ptr<float>(), *mpp = mp.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e;
    std::vector<std::pair<float, int32_t>> cand;
    for (int64_t r = begin; r < end; ++r) {
      const float t = tp[r] > 0.f ? tp[r] : 1.f;
      const int64_t k_r = kk[r] > 0 && kk[r] < V ? kk[r] : V;
      op[r] = k_r == V && ppp[r] >= 1.f && mpp[r] <= 0.f  // a batch mate's filter: this row keeps every token
                  ? row_race(xp + r * V, V, t, row_key(kp[r], cp[r]), col.data())
                  : row_filtered_race(xp + r * V, V, t, k_r, ppp[r], mpp[r], row_key(kp[r], cp[r]), col.data(), e,
                                      cand);
    }
  });
  return out;
}

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
  // each temperature-sampled row's draw: argmax(softmax(logits / t) / E) over noise.exponential_noise's E
  m.def("exponential_race(Tensor logits, Tensor temperature, Tensor keys, Tensor counters) -> Tensor");
  // the same after each row's top-k, top-p and min-p (filter_logits' rules), sorting only the tokens that can stay
  m.def("filtered_race(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor keys, "
        "Tensor counters) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("argmax_logsumexp", &argmax_logsumexp);
  m.impl("exponential_race", &exponential_race);
  m.impl("filtered_race", &filtered_race);
}
