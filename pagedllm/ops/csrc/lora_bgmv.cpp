// The batched LoRA delta of a mixed step on the CPU (Punica's BGMV, issue 32): each token adds its own adapter's
// B A x to the fused projection's output, reading only that adapter's slot. Torch's GEMMs can only do that by
// multiplying every token by every slot and masking (k times the FLOPs) or by one GEMM per adapter (many small
// ops); here a token costs its own rank-R shrink and expand, one call per fused projection and layer.
//
// Per token (parallel over tokens): s = A[slot] x over all the group's targets (dot products, 4 rows at a time
// sharing the loads of x), then for each target y[:, lo:lo+out] += s_target B[slot]^T (8 columns at a time,
// R fused multiply-adds). Tokens of slot -1 (the base model) are left untouched.
#include "ops_common.h"

#include <vector>

using namespace pagedllm_ops;

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

// s[j] = dot(x, a + j * K) for j < rows (a: rows x K, contiguous).
void shrink_rows(const float* x, const float* a, int64_t rows, int64_t K, float* s) {
  int64_t j = 0;
  for (; j + 4 <= rows; j += 4) {
    const float* a0 = a + j * K;
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 xv = _mm256_loadu_ps(x + k);
      c0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(a0 + k), c0);
      c1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(a0 + K + k), c1);
      c2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(a0 + 2 * K + k), c2);
      c3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(a0 + 3 * K + k), c3);
    }
    float r[4] = {hsum8(c0), hsum8(c1), hsum8(c2), hsum8(c3)};
    for (; k < K; ++k)
      for (int i = 0; i < 4; ++i) r[i] += x[k] * a0[i * K + k];
    for (int i = 0; i < 4; ++i) s[j + i] = r[i];
  }
  for (; j < rows; ++j) {
    const float* aj = a + j * K;
    __m256 c = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) c = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(aj + k), c);
    float r = hsum8(c);
    for (; k < K; ++k) r += x[k] * aj[k];
    s[j] = r;
  }
}

// y[c] += sum_r s[r] * b[r * N + c] for c < N (b: R x N, contiguous).
void expand_row(const float* s, const float* b, int64_t R, int64_t N, float* y) {
  int64_t c = 0;
  for (; c + 8 <= N; c += 8) {
    __m256 acc = _mm256_loadu_ps(y + c);
    for (int64_t r = 0; r < R; ++r) acc = _mm256_fmadd_ps(_mm256_set1_ps(s[r]), _mm256_loadu_ps(b + r * N + c), acc);
    _mm256_storeu_ps(y + c, acc);
  }
  for (; c < N; ++c) {
    float acc = y[c];
    for (int64_t r = 0; r < R; ++r) acc += s[r] * b[r * N + c];
    y[c] = acc;
  }
}

}  // namespace

// y: [T, W] float32 (rows contiguous), updated in place; x: [T, K] float32 contiguous; a: [S, n, R, K] float32
// contiguous (the slots' A of the group's n targets); bs: n tensors [S, R, N_i] float32 contiguous (B^T, already
// scaled); los: n column offsets of the targets in y; slots: [T] int64, each token's slot (-1: none).
void lora_bgmv(torch::Tensor y, torch::Tensor x, torch::Tensor a, std::vector<torch::Tensor> bs,
               std::vector<int64_t> los, torch::Tensor slots) {
  check_f32(y, "y");
  check_f32(x, "x");
  check_f32(a, "a");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, K] tensor");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == T && y.stride(1) == 1, "y must be a [T, W] tensor with contiguous rows");
  TORCH_CHECK(a.dim() == 4 && a.is_contiguous() && a.size(3) == K, "a must be a contiguous [S, n, R, K] tensor");
  const int64_t S = a.size(0), n = a.size(1), R = a.size(2);
  TORCH_CHECK(static_cast<int64_t>(bs.size()) == n && static_cast<int64_t>(los.size()) == n,
              "bs and los must have one entry per target (", n, ")");
  std::vector<const float*> bp(n);
  std::vector<int64_t> widths(n);
  for (int64_t i = 0; i < n; ++i) {
    check_f32(bs[i], "bs");
    TORCH_CHECK(bs[i].dim() == 3 && bs[i].is_contiguous() && bs[i].size(0) == S && bs[i].size(1) == R,
                "bs[", i, "] must be a contiguous [S, R, N] tensor");
    widths[i] = bs[i].size(2);
    TORCH_CHECK(los[i] >= 0 && los[i] + widths[i] <= y.size(1), "target ", i, "'s columns are outside y");
    bp[i] = bs[i].data_ptr<float>();
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == T && slots.is_contiguous() &&
                  slots.device().is_cpu(),
              "slots must be a contiguous int64 [T] CPU tensor");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= -1 && sp[t] < S, "slot ", sp[t], " is outside [-1, ", S, ")");
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ys = y.stride(0);
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> s(n * R);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      shrink_rows(xp + t * K, ap + slot * n * R * K, n * R, K, s.data());
      for (int64_t i = 0; i < n; ++i)
        expand_row(s.data() + i * R, bp[i] + slot * R * widths[i], R, widths[i], yp + t * ys + los[i]);
    }
  });
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  // y[t, los[i]:los[i] + N_i] += (a[slot_t, i] x_t) bs[i][slot_t] for each token t with slot_t >= 0 (in place)
  m.def("lora_bgmv(Tensor(a!) y, Tensor x, Tensor a, Tensor[] bs, int[] los, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("lora_bgmv", &lora_bgmv); }
