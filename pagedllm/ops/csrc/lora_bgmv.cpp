// The batched LoRA delta of a mixed step on the CPU (Punica's BGMV, issue 32): each token adds its own adapter's
// B A x to the fused projection's output, reading only that adapter's slot. Torch's GEMMs can only do that by
// multiplying every token by every slot and masking (k times the FLOPs) or by one GEMM per adapter (many small
// ops); here a token costs its own rank-R shrink and expand, one call per fused projection and layer.
//
// Tokens are grouped by slot and cut into tiles of up to 4 tokens of one slot, which share every load of the
// slot's weights (parallel over tiles): s = A[slot] x over all the group's targets (2 rows of A at a time), then
// for each target y[:, lo:lo+out] += s_target B[slot]^T (16 columns at a time). Tokens of slot -1 (the base
// model) are left untouched.
#include "ops_common.h"

#include <vector>

using namespace pagedllm_ops;

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

constexpr int kTile = 4;  // tokens of one slot sharing each load of its A and B

// s[i][j] = dot(x[i], a + j * K) for NT tokens and j < rows (a: rows x K contiguous; s[i]: rows floats).
template <int NT>
void shrink_tile(const float* const* x, const float* a, int64_t rows, int64_t K, float* const* s) {
  for (int64_t j = 0; j < rows; j += 2) {
    const bool two = j + 1 < rows;
    const float* a0 = a + j * K;
    const float* a1 = two ? a0 + K : a0;
    __m256 c0[NT], c1[NT];
    for (int i = 0; i < NT; ++i) c0[i] = c1[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 v0 = _mm256_loadu_ps(a0 + k), v1 = _mm256_loadu_ps(a1 + k);
      for (int i = 0; i < NT; ++i) {
        const __m256 xv = _mm256_loadu_ps(x[i] + k);
        c0[i] = _mm256_fmadd_ps(xv, v0, c0[i]);
        c1[i] = _mm256_fmadd_ps(xv, v1, c1[i]);
      }
    }
    for (int i = 0; i < NT; ++i) {
      float r0 = hsum8(c0[i]), r1 = hsum8(c1[i]);
      for (int64_t kk = k; kk < K; ++kk) {
        r0 += x[i][kk] * a0[kk];
        r1 += x[i][kk] * a1[kk];
      }
      s[i][j] = r0;
      if (two) s[i][j + 1] = r1;
    }
  }
}

// y[i][c] += sum_r s[i][r] * b[r * N + c] for NT tokens and c < N (b: R x N contiguous).
template <int NT>
void expand_tile(const float* const* s, const float* b, int64_t R, int64_t N, float* const* y) {
  int64_t c = 0;
  for (; c + 16 <= N; c += 16) {
    __m256 lo[NT], hi[NT];
    for (int i = 0; i < NT; ++i) {
      lo[i] = _mm256_loadu_ps(y[i] + c);
      hi[i] = _mm256_loadu_ps(y[i] + c + 8);
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m256 b0 = _mm256_loadu_ps(b + r * N + c), b1 = _mm256_loadu_ps(b + r * N + c + 8);
      for (int i = 0; i < NT; ++i) {
        const __m256 sv = _mm256_broadcast_ss(s[i] + r);
        lo[i] = _mm256_fmadd_ps(sv, b0, lo[i]);
        hi[i] = _mm256_fmadd_ps(sv, b1, hi[i]);
      }
    }
    for (int i = 0; i < NT; ++i) {
      _mm256_storeu_ps(y[i] + c, lo[i]);
      _mm256_storeu_ps(y[i] + c + 8, hi[i]);
    }
  }
  for (; c < N; ++c)
    for (int i = 0; i < NT; ++i) {
      float acc = y[i][c];
      for (int64_t r = 0; r < R; ++r) acc += s[i][r] * b[r * N + c];
      y[i][c] = acc;
    }
}

// The delta of NT tokens of one slot: shrink against the group's A (n targets x R rows), expand per target.
template <int NT>
void tile(const float* const* x, const float* a, const std::vector<const float*>& b, const std::vector<int64_t>& widths,
          const std::vector<int64_t>& los, int64_t R, int64_t K, float* const* s, float* const* y) {
  const int64_t n = static_cast<int64_t>(b.size());
  shrink_tile<NT>(x, a, n * R, K, s);
  for (int64_t t = 0; t < n; ++t) {
    const float* st[NT];
    float* yt[NT];
    for (int i = 0; i < NT; ++i) {
      st[i] = s[i] + t * R;
      yt[i] = y[i] + los[t];
    }
    expand_tile<NT>(st, b[t], R, widths[t], yt);
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
  // tokens grouped by slot (a counting sort; base tokens dropped), cut into tiles of up to kTile tokens
  std::vector<int64_t> order;
  order.reserve(T);
  for (int64_t slot = 0; slot < S; ++slot)
    for (int64_t t = 0; t < T; ++t)
      if (sp[t] == slot) order.push_back(t);
  std::vector<int64_t> tiles;  // start of each tile in order
  for (int64_t i = 0; i < static_cast<int64_t>(order.size());) {
    tiles.push_back(i);
    int64_t j = i + 1;
    while (j < static_cast<int64_t>(order.size()) && j - i < kTile && sp[order[j]] == sp[order[i]]) ++j;
    i = j;
  }
  tiles.push_back(static_cast<int64_t>(order.size()));
  at::parallel_for(0, static_cast<int64_t>(tiles.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sbuf(kTile * n * R);
    for (int64_t q = begin; q < end; ++q) {
      const int64_t first = tiles[q], nt = tiles[q + 1] - first;
      const float* xs[kTile];
      float* ys_[kTile];
      float* ss[kTile];
      for (int64_t i = 0; i < nt; ++i) {
        const int64_t t = order[first + i];
        xs[i] = xp + t * K;
        ys_[i] = yp + t * ys;
        ss[i] = sbuf.data() + i * n * R;
      }
      const float* aslot = ap + sp[order[first]] * n * R * K;
      std::vector<const float*> bslot(n);
      for (int64_t i = 0; i < n; ++i) bslot[i] = bp[i] + sp[order[first]] * R * widths[i];
      switch (nt) {
        case 4: tile<4>(xs, aslot, bslot, widths, los, R, K, ss, ys_); break;
        case 3: tile<3>(xs, aslot, bslot, widths, los, R, K, ss, ys_); break;
        case 2: tile<2>(xs, aslot, bslot, widths, los, R, K, ss, ys_); break;
        default: tile<1>(xs, aslot, bslot, widths, los, R, K, ss, ys_); break;
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  // y[t, los[i]:los[i] + N_i] += (a[slot_t, i] x_t) bs[i][slot_t] for each token t with slot_t >= 0 (in place)
  m.def("lora_bgmv(Tensor(a!) y, Tensor x, Tensor a, Tensor[] bs, int[] los, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("lora_bgmv", &lora_bgmv); }
