// Fused elementwise ops of a Llama decoder layer, for fp32 activations on x86 CPUs with AVX2.
//
// Where the next GEMM runs on bf16 weights (quantization="gguf-bf16" from BF16_MIN_ROWS rows up), the norm and the MLP
// activation write their output rounded to bf16 (`bf16_out`), and the residual add and the activation read the
// bf16 outputs of the GEMMs before them: the same values as rounding and widening with separate ATen casts (round
// to nearest even, like c10::BFloat16), without the casts' passes over memory and their parallel regions.
//
// At batch 1 a decode step is bound by per-op overhead: ATen runs RMSNorm as ~8 ops, rotary as ~6 and
// the gated MLP activation as 2, each costing microseconds of dispatch for a few hundred floats.  Each
// op here is one call that touches every element once.  The arithmetic follows ATen's (fp32, the same
// operation order; expf is the SLEEF u1.0 routine ATen's own silu uses); only the RMSNorm sum of squares
// is summed in another order.  Rows are split over threads only for large batches (prefill).
#include "fused_rows.h"
#include "ops_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

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

void check_f32_or_bf16_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), name,
              " must be a float32 or bfloat16 CPU tensor");
}

template <typename D, typename Y>
void add_rms_norm_rows(float* hp, const D* dp, const float* wp, Y* yp, int64_t T, int64_t E, float eps) {
  at::parallel_for(0, T, grain_rows(E), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (dp != nullptr)
        add_rms_norm_row<true>(hp + t * E, dp + t * E, wp, yp + t * E, E, eps);
      else
        add_rms_norm_row<false>(hp + t * E, dp, wp, yp + t * E, E, eps);
    }
  });
}

template <typename Y>
void add_rms_norm_any_delta(float* hp, const std::optional<torch::Tensor>& delta, const float* wp, Y* yp,
                            int64_t T, int64_t E, float eps) {
  if (!delta.has_value() || !delta->defined())
    add_rms_norm_rows<float, Y>(hp, nullptr, wp, yp, T, E, eps);
  else if (delta->scalar_type() == at::kBFloat16)
    add_rms_norm_rows(hp, delta->data_ptr<at::BFloat16>(), wp, yp, T, E, eps);
  else
    add_rms_norm_rows(hp, delta->data_ptr<float>(), wp, yp, T, E, eps);
}

}  // namespace

// h: [T, E] (updated in place: h += delta), delta: None or [T, E] (float32 or bfloat16), weight: [E]; h and weight
// float32; all contiguous. Returns rms_norm(h) * weight [T, E], in bfloat16 when bf16_out.
torch::Tensor add_rms_norm(torch::Tensor h, std::optional<torch::Tensor> delta, torch::Tensor weight, double eps,
                           bool bf16_out) {
  check_f32_cpu(h, "h");
  check_f32_cpu(weight, "weight");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [T, E] tensor");
  const int64_t T = h.size(0), E = h.size(1);
  TORCH_CHECK(weight.numel() == E && weight.is_contiguous(), "weight must be a contiguous [E] tensor");
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta) {
    check_f32_or_bf16_cpu(*delta, "delta");
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->is_contiguous(), "delta must be a contiguous [T, E] tensor");
  }
  auto y = torch::empty_like(h, bf16_out ? at::kBFloat16 : at::kFloat);
  float* hp = h.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float ep = static_cast<float>(eps);
  if (bf16_out)
    add_rms_norm_any_delta(hp, delta, wp, y.data_ptr<at::BFloat16>(), T, E, ep);
  else
    add_rms_norm_any_delta(hp, delta, wp, y.data_ptr<float>(), T, E, ep);
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
        float* x1 = xp + t * ld + n * 2 * half;
        rotate_head(x1, x1 + half, x1, x1 + half, c, s, half);
      }
    }
  });
}

// The fp32 form of a bf16 GEMM's fused output x [T, W] (contiguous rows) with its first num_heads heads of
// D = 2 cos.size(1) rotated as rope does: one pass instead of a widening copy and rope over the copy (the same bits:
// widening is exact), ~20 ms of a 2,048-token gguf-bf16 prefill step on an AMX Xeon.
torch::Tensor rope_widen(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t num_heads) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a bfloat16 CPU tensor [T, W] with contiguous rows");
  check_f32_cpu(cos, "cos");
  check_f32_cpu(sin, "sin");
  const int64_t T = x.size(0), W = x.size(1), half = cos.size(1), ld = x.stride(0);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == T &&
                  sin.sizes() == cos.sizes(), "cos and sin must be contiguous [T, D/2] tensors");
  TORCH_CHECK(num_heads >= 0 && num_heads * 2 * half <= W,
              "x [T, W] needs contiguous rows holding num_heads heads of 2 cos.size(1) values");
  auto y = torch::empty({T, W}, x.options().dtype(at::kFloat));
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(W), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::BFloat16* xr = xp + t * ld;
      float* yr = yp + t * W;
      const float* __restrict c = cp + t * half;
      const float* __restrict s = sp + t * half;
      for (int64_t n = 0; n < num_heads; ++n) {
        const at::BFloat16* x1 = xr + n * 2 * half;
        float* y1 = yr + n * 2 * half;
        rotate_head(x1, x1 + half, y1, y1 + half, c, s, half);
      }
      int64_t e = num_heads * 2 * half;
      for (; e + 8 <= W; e += 8) _mm256_storeu_ps(yr + e, load8(xr + e));
      for (; e < W; ++e) yr[e] = static_cast<float>(xr[e]);
    }
  });
  return y;
}

// gate_up: [T, 2I] float32 or bfloat16, contiguous (gate = first I columns). Returns silu(gate) * up [T, I],
// computed in fp32, in bfloat16 when bf16_out.
torch::Tensor silu_mul(torch::Tensor gate_up, bool bf16_out) {
  check_f32_or_bf16_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2I] tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto y = torch::empty({T, I}, gate_up.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  auto rows = [&](auto* gp, auto* yp) {
    at::parallel_for(0, T, grain_rows(I), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_mul_row(gp + t * 2 * I, yp + t * I, I);
    });
  };
  const bool bf16_in = gate_up.scalar_type() == at::kBFloat16;
  if (bf16_in && bf16_out) rows(gate_up.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  else if (bf16_in) rows(gate_up.data_ptr<at::BFloat16>(), y.data_ptr<float>());
  else if (bf16_out) rows(gate_up.data_ptr<float>(), y.data_ptr<at::BFloat16>());
  else rows(gate_up.data_ptr<float>(), y.data_ptr<float>());
  return y;
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  // h += delta (in place); returns rms_norm(h) * weight
  m.def("add_rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps, bool bf16_out=False) -> Tensor");
  // rotary embedding (rotate-half) in place on x [T, N, D], or on the first num_heads heads of each row of x [T, W]
  m.def("rope(Tensor(a!) x, Tensor cos, Tensor sin, int num_heads=-1) -> ()");
  // fp32 copy of a bf16 fused output [T, W] with rope applied to its first num_heads heads
  m.def("rope_widen(Tensor x, Tensor cos, Tensor sin, int num_heads) -> Tensor");
  // silu(gate) * up of a fused [T, 2I] gate/up output
  m.def("silu_mul(Tensor gate_up, bool bf16_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("rope_widen", &rope_widen);
  m.impl("silu_mul", &silu_mul);
}
