// Fused elementwise ops of a Llama decoder layer, for fp32 activations on x86 CPUs with AVX2.
//
// At batch 1 a decode step is bound by per-op overhead: ATen runs RMSNorm as ~8 ops, rotary as ~6 and
// the gated MLP activation as 2, each costing microseconds of dispatch for a few hundred floats.  Each
// op here is one call that touches every element once.  The arithmetic follows ATen's (fp32, the same
// operation order; expf is the SLEEF u1.0 routine ATen's own silu uses); only the RMSNorm sum of squares
// is summed in another order.  Rows are split over threads only for large batches (prefill).
#include "ops_common.h"

#include <sleef.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

// a*c - b*s rounds both products, like ATen's separate ops (gcc would otherwise contract it into an FMA).
#pragma GCC optimize("fp-contract=off")

namespace {

using namespace pagedllm_ops;

// Each thread gets at least this many elements (so decode steps run on the calling thread alone): below
// it, waking the pool costs more than it saves.
constexpr int64_t kGrainElems = 1 << 15;

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

void check_f32_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// h += d (when HasDelta); y = h * rsqrt(mean(h^2) + eps) * w, for one row of E elements.
template <bool HasDelta>
void add_rms_norm_row(float* __restrict h, const float* __restrict d, const float* __restrict w,
                      float* __restrict y, int64_t E, float eps) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 16 <= E; e += 16) {
    __m256 a = _mm256_loadu_ps(h + e), b = _mm256_loadu_ps(h + e + 8);
    if (HasDelta) {
      a = _mm256_add_ps(a, _mm256_loadu_ps(d + e));
      b = _mm256_add_ps(b, _mm256_loadu_ps(d + e + 8));
      _mm256_storeu_ps(h + e, a);
      _mm256_storeu_ps(h + e + 8, b);
    }
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  float ss = hsum8(_mm256_add_ps(acc0, acc1));
  for (; e < E; ++e) {
    if (HasDelta) h[e] += d[e];
    ss += h[e] * h[e];
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(E) + eps);
  for (int64_t i = 0; i < E; ++i) y[i] = (h[i] * r) * w[i];
}

// silu(g) * u = g / (1 + exp(-g)) * u on 8 lanes, ATen's silu formula.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
}

}  // namespace

// h: [T, E] (updated in place: h += delta), delta: None or [T, E], weight: [E]; all float32 contiguous.
// Returns rms_norm(h) * weight [T, E].
torch::Tensor add_rms_norm(torch::Tensor h, std::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  check_f32_cpu(h, "h");
  check_f32_cpu(weight, "weight");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [T, E] tensor");
  const int64_t T = h.size(0), E = h.size(1);
  TORCH_CHECK(weight.numel() == E && weight.is_contiguous(), "weight must be a contiguous [E] tensor");
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta) {
    check_f32_cpu(*delta, "delta");
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->is_contiguous(), "delta must be a contiguous [T, E] tensor");
  }
  auto y = torch::empty_like(h);
  float* hp = h.data_ptr<float>();
  const float* dp = has_delta ? delta->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float ep = static_cast<float>(eps);
  at::parallel_for(0, T, grain_rows(E), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (has_delta)
        add_rms_norm_row<true>(hp + t * E, dp + t * E, wp, yp + t * E, E, ep);
      else
        add_rms_norm_row<false>(hp + t * E, nullptr, wp, yp + t * E, E, ep);
    }
  });
  return y;
}

// Rotates x [T, N, D] in place (rotate-half layout: x1, x2 = halves of each head; x1*c - x2*s, x2*c + x1*s)
// by cos, sin [T, D/2] (contiguous float32). x may be a row-strided view (the q and k heads of a fused
// qkv output) but each row's heads must be contiguous. Or x is the fused output [T, W] itself and the first
// num_heads heads of D = 2 cos.size(1) of each row are rotated (no views to build at batch 1).
void rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t num_heads) {
  check_f32_cpu(x, "x");
  check_f32_cpu(cos, "cos");
  check_f32_cpu(sin, "sin");
  if (x.dim() == 2) {
    TORCH_CHECK(x.stride(1) == 1 && cos.dim() == 2 && num_heads >= 0 && num_heads * 2 * cos.size(1) <= x.size(1),
                "x [T, W] needs contiguous rows holding num_heads heads of 2 cos.size(1) values");
  } else {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
                "x must be [T, N, D] with contiguous rows of heads and even D");
  }
  const int64_t T = x.size(0), N = x.dim() == 2 ? num_heads : x.size(1), ld = x.stride(0);
  const int64_t half = x.dim() == 2 ? cos.size(1) : x.size(2) / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == T &&
                  cos.size(1) == half && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous [T, D/2] tensors");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(N * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict c = cp + t * half;
      const float* __restrict s = sp + t * half;
      for (int64_t n = 0; n < N; ++n) {
        float* __restrict x1 = xp + t * ld + n * 2 * half;
        float* __restrict x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// gate_up: [T, 2I] float32 contiguous (gate = first I columns). Returns silu(gate) * up [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2I] tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto y = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = yp + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8)
        _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
      if (i < I) {  // tail through a padded lane buffer: the same routine as the full lanes
        alignas(32) float gb[8] = {}, ub[8] = {}, ob[8];
        std::copy(g + i, g + I, gb);
        std::copy(u + i, u + I, ub);
        _mm256_store_ps(ob, silu_mul8(_mm256_load_ps(gb), _mm256_load_ps(ub)));
        std::copy(ob, ob + (I - i), o + i);
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  // h += delta (in place); returns rms_norm(h) * weight
  m.def("add_rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps) -> Tensor");
  // rotary embedding (rotate-half) in place on x [T, N, D], or on the first num_heads heads of each row of x [T, W]
  m.def("rope(Tensor(a!) x, Tensor cos, Tensor sin, int num_heads=-1) -> ()");
  // silu(gate) * up of a fused [T, 2I] gate/up output
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
}
