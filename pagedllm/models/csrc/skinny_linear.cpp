// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the few-token batches of decoding, on x86 CPUs with AVX2.
//
// At small M a linear layer is a stream over its weights, and MKL's sgemm streams them at under
// half the memory bandwidth (2-core EPYC: ~11 GB/s; this kernel ~25 GB/s at M = 1).  Each thread
// takes a contiguous range of row blocks of W (a block stays in L1 while every row of x is applied
// to it; x stays in L2), with fp32 accumulators in registers and one horizontal sum per output.
// W may be fp32 or bf16 (bf16 rows are widened in registers: half the bytes, fp32 math).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// MR rows of x against NR rows of W; K is a multiple of 8.
template <typename WT, int MR, int NR>
inline void tile(const float* x, int64_t K, const WT* w, float* y, int64_t ldy, const float* bias) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = load8(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum(acc[i][j]) + (bias ? bias[j] : 0.f);
}

template <typename WT, int NR>
inline void rows(const float* x, int64_t M, int64_t K, const WT* w, float* y, int64_t N, const float* bias) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile<WT, 2, NR>(x + m * K, K, w, y + m * N, N, bias);
  if (m < M) tile<WT, 1, NR>(x + m * K, K, w, y + m * N, N, bias);
}

template <typename WT, int64_t NR>
void run(const float* x, const WT* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = (N + NR - 1) / NR;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks)));
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n = b * NR;
    const float* bn = bias ? bias + n : nullptr;
    if (n + NR <= N) {
      rows<WT, NR>(x, M, K, w + n * K, y + n, N, bn);
    } else {
      for (int64_t r = n; r < N; ++r) rows<WT, 1>(x, M, K, w + r * K, y + r, N, bias ? bias + r : nullptr);
    }
  }
}

// One row of x: 8 weight rows at a time (more loads in flight); more rows: 4 (the 2x4 tile fits the registers).
template <typename WT>
void dispatch(const float* x, const WT* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  if (M == 1)
    run<WT, 8>(x, w, bias, y, M, N, K);
  else
    run<WT, 4>(x, w, bias, y, M, N, K);
}

}  // namespace

// x: [M, K] float32 contiguous; w: [N, K] float32 or bfloat16 contiguous; bias: None or [N] float32.
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes must be [M, K] and [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "w must be float32 or bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  TORCH_CHECK(x.size(1) % 8 == 0, "K must be a multiple of 8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias must have N elements");
    bp = b.data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  pybind11::gil_scoped_release no_gil;
  if (w.scalar_type() == at::kFloat)
    dispatch<float>(x.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), M, N, K);
  else
    dispatch<at::BFloat16>(x.data_ptr<float>(), w.data_ptr<at::BFloat16>(), bp, y.data_ptr<float>(), M, N, K);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "x @ w.T (+ bias) for small M, streaming fp32/bf16 weights");
}
